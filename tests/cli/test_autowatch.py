"""probes.launch.autowatch in-process: which model an optimizer's steps lead to, which optimizers are
watched together, that the global module hooks go at the first step and every hook at close, and
that a failure in discovery never reaches the training loop."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

from probes.launch import autowatch


class Pair(nn.Module):
    """Two parts trained by one optimizer but called separately: the container never runs forward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(4, 8), nn.Linear(8, 4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def global_hooks() -> tuple[int, int, int]:
    return (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks),
            len(optimizer_hooks._global_optimizer_post_hooks))


@pytest.fixture
def aw(tmp_path):
    before = global_hooks()
    out = io.StringIO()
    w = autowatch.install(tmp_path / "runs", every=1, out=out)
    w.test_out = out
    yield w
    w.close()
    assert global_hooks() == before, "autowatch left a global hook behind"


def step(model_call, opts, target):
    loss = F.mse_loss(model_call(), target)
    for o in opts:
        o.zero_grad()
    loss.backward()
    for o in opts:
        o.step()


def test_module_hooks_go_at_the_first_step_and_the_model_is_the_one_that_ran(aw):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    base = global_hooks()
    step(lambda: model(x), [opt], y)
    assert global_hooks()[:2] == (base[0] - 1, base[1] - 1)        # the forward tracking is gone
    assert not aw.watchers                                          # the first step only announces it
    for _ in range(3):
        step(lambda: model(x), [opt], y)
    (w,) = aw.watchers
    assert w._model_ref() is model
    assert "modscope: watching Net -> " in aw.test_out.getvalue()
    assert aw.top_level_calls == 1 and aw.discovery_s > 0


def test_optimizers_that_step_together_share_one_watcher(aw):
    model = Net()
    opt_body = torch.optim.SGD(model.body.parameters(), lr=0.1)        # as Muon + AdamW split a model
    opt_head = torch.optim.Adam(model.head.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(4):
        step(lambda: model(x), [opt_body, opt_head], y)
    (w,) = aw.watchers
    assert w._model_ref() is model
    assert not [f for f in w.findings() if f.code == "not-in-optimizer"]


def test_an_optimizer_over_two_top_level_modules_watches_their_container(aw):
    pair = Pair()
    opt = torch.optim.SGD(pair.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(3):
        step(lambda: pair.dec(torch.relu(pair.enc(x))), [opt], x)
    (w,) = aw.watchers
    assert w._model_ref() is pair


def test_an_optimizer_that_stepped_once_is_watched_at_close(tmp_path):
    out = io.StringIO()
    aw = autowatch.install(tmp_path / "runs", every=1, out=out)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step(lambda: model(torch.randn(8, 4)), [opt], torch.randn(8, 1))
    aw.close()
    assert len(aw.watchers) == 1 and aw.watchers[0].closed
    assert len(list((tmp_path / "runs").glob("modscope-*-rank0.sqlite"))) == 1
    assert "modscope: Net: no findings" in out.getvalue()


def test_a_failure_in_discovery_is_one_line_and_training_goes_on(aw, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire\nsecond line")
    monkeypatch.setattr(autowatch, "watch", broken)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(4):
        step(lambda: model(x), [opt], y)
    assert not aw.watchers
    assert aw.test_out.getvalue().splitlines() == ["modscope: not watching: RuntimeError: disk on fire"]


def test_a_model_the_script_watches_itself_is_left_to_it(aw, tmp_path):
    import probes
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with probes.watch(model, opt, run_dir=tmp_path / "own", every=1) as own:
        for _ in range(4):
            step(lambda: model(x), [opt], y)
        assert not own.closed and own.step_count == 4
    assert not aw.watchers
    assert f"modscope: Net is already watched by the script's own probes.watch() ({tmp_path / 'own'}): left to it" \
        in aw.test_out.getvalue()
    aw.close()
    # the summary says where the findings are, not that no model was watched (the run dir it names is
    # removed when empty: `modscope findings --run` on it found nothing)
    last = aw.test_out.getvalue().splitlines()[-1]
    assert last == ("modscope: Net was watched by the script's own probes.watch() "
                    f"(modscope findings --run {tmp_path / 'own'})")


def test_tensors_no_module_holds_are_noted_once(aw):
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(3):
        loss = (w - 1).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not aw.watchers
    assert aw.test_out.getvalue().count("steps tensors that no nn.Module holds") == 1


def test_bad_arguments_raise_at_once(tmp_path):
    with pytest.raises(ValueError, match="every must be None or an int from 1 to 1,000,000"):
        autowatch.install(tmp_path, every=0)
    with pytest.raises(ValueError, match=r"overhead must be a fraction in \(0, 1\]"):
        autowatch.install(tmp_path, overhead=2.0)
    with pytest.raises(TypeError, match=r"run_dir must be a str or os\.PathLike"):
        autowatch.install(3)  # type: ignore[arg-type]


def test_forward_tracking_stops_without_an_optimizer_step(aw):
    model = Net()
    base = global_hooks()
    with torch.no_grad():
        for _ in range(autowatch.MAX_TRACKED_CALLS + 5):
            model(torch.randn(2, 4))
    assert global_hooks()[:2] == (base[0] - 1, base[1] - 1)       # an inference-only script gets its fast path back
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        step(lambda: model(torch.randn(8, 4)), [opt], torch.randn(8, 1))
    (w,) = aw.watchers                                               # found among the modules seen before
    assert w._model_ref() is model
