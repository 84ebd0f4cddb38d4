"""``probes.watch`` on a model that an open watcher already watches (a notebook cell run again): the
first watcher is closed with a warning that names its run, so one training is one run and its hooks
are not run twice."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from helpers import stored, train

import probes


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch():
    return torch.randn(4, 8), torch.randint(0, 2, (4,))


def hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_watching_a_watched_model_again_closes_the_first_watcher(tmp_path):
    model, opt = mlp()
    first = probes.watch(model, opt, run_dir=tmp_path / "a", every=1)
    train(model, opt, first, 3, batch)
    hooks_of_one = hooks_on(model)
    with pytest.warns(UserWarning, match=rf"Sequential was already watched by run '{first.run_id}'.*now closed"):
        second = probes.watch(model, opt, run_dir=tmp_path / "b", every=1)
    try:
        assert first.closed and not second.closed
        assert stored(first, "SELECT status, step FROM ranks") == [("closed", 2)]
        train(model, opt, second, 4, batch)
        assert first.step_count == 3                 # the first run ended where the second began
        assert second.step_count == 4
        assert hooks_on(model) == hooks_of_one       # one watcher's hooks, not two
    finally:
        second.close()
    assert hooks_on(model) == 0


def test_the_model_inside_a_wrapper_is_the_same_model(tmp_path):
    model, opt = mlp()
    first = probes.watch(torch.compile(model), opt, run_dir=tmp_path / "a", every=1)
    with pytest.warns(UserWarning, match="already watched"):
        second = probes.watch(model, opt, run_dir=tmp_path / "b", every=1)
    second.close()
    assert first.closed


def test_closed_watchers_and_other_models_are_left_alone(tmp_path):
    model, opt = mlp()
    other, other_opt = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probes.watch(model, opt, run_dir=tmp_path / "a", every=1):
            pass
        again = probes.watch(model, opt, run_dir=tmp_path / "b", every=1)      # the first one was closed
        beside = probes.watch(other, other_opt, run_dir=tmp_path / "c", every=1)
    try:
        train(model, opt, again, 2, batch)
        train(other, other_opt, beside, 2, batch)
        assert not again.closed and not beside.closed
        assert (again.step_count, beside.step_count) == (2, 2)
    finally:
        again.close()
        beside.close()


def test_warnings_as_errors_still_close_the_first_watcher(tmp_path):
    """Under -W error the warning raises in watch(): the first watcher is closed already, its hooks gone."""
    model, opt = mlp()
    first = probes.watch(model, opt, run_dir=tmp_path / "a", every=1)
    train(model, opt, first, 2, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="already watched"):
            probes.watch(model, opt, run_dir=tmp_path / "b", every=1)
    assert first.closed and hooks_on(model) == 0
