"""Closure optimizers in real loops: ``optimizer.step(closure)`` runs forward and backward inside the step, several
times for LBFGS. The gradients stored for a step are those of the closure's first evaluation (the parameters as
they were before the step), its update is the whole step's change, and ``probes.begin_optimizer_step`` inside the
closure marks the moment itself."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes

STEPS = 5


def stored(run_dir: Path, path: str) -> dict[int, tuple[float, float]]:
    """step -> (grad_norm, update_norm) of the tensor at ``path``."""
    [db] = run_dir.glob("modscope-*.sqlite")
    con = sqlite3.connect(db)
    try:
        return {s: (g, u) for s, g, u in con.execute(
            "SELECT s.step, s.grad_norm, s.update_norm FROM param_stats s JOIN params p "
            "ON p.rank = s.rank AND p.param_id = s.param_id WHERE p.path = ?", (path,))}
    finally:
        con.close()


def losses(run_dir: Path) -> dict[int, float]:
    [db] = run_dir.glob("modscope-*.sqlite")
    con = sqlite3.connect(db)
    try:
        return dict(con.execute("SELECT step, loss FROM steps WHERE loss IS NOT NULL"))
    finally:
        con.close()


def regression() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(64, 4)
    return model, x, x.sum(1, keepdim=True)


def test_lbfgs_stores_its_first_evaluations_gradients_and_the_whole_steps_update(tmp_path):
    model, x, y = regression()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    weight = model[0].weight
    first_grads, changes, first_losses = [], [], []
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(STEPS):
            evaluations = []

            def closure(evaluations: list[int] = evaluations) -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                if not evaluations:
                    first_grads.append(float(weight.grad.norm()))
                    first_losses.append(float(loss.detach()))
                evaluations.append(1)
                return loss

            before = weight.detach().clone()
            loss = opt.step(closure)
            changes.append(float((weight.detach() - before).norm()))
            assert len(evaluations) > 1                 # LBFGS evaluated the closure several times
            w.step(loss)
        found = w.findings()
    rows = stored(tmp_path, "0.weight")
    assert [rows[s][0] for s in range(STEPS)] == pytest.approx(first_grads, rel=1e-5)
    assert [rows[s][1] for s in range(STEPS)] == pytest.approx(changes, rel=1e-4)
    assert [losses(tmp_path)[s] for s in range(STEPS)] == pytest.approx(first_losses, rel=1e-6)
    assert not [f for f in found if f.severity != "info"], found


def test_a_closure_that_is_never_evaluated_twice_is_an_ordinary_step(tmp_path):
    """SGD with a closure: one evaluation, before the update; the same values as without one."""
    model, x, y = regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(STEPS):
            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                grads.append(float(model[0].weight.grad.norm()))
                return loss
            w.step(opt.step(closure))
    rows = stored(tmp_path, "0.weight")
    assert [rows[s][0] for s in range(STEPS)] == pytest.approx(grads, rel=1e-5)
    assert all(rows[s][1] == pytest.approx(0.05 * grads[s], rel=1e-4) for s in range(STEPS))


@pytest.mark.parametrize("helper", [True, False])
def test_begin_optimizer_step_inside_the_closure_marks_the_moment(tmp_path, helper):
    """The closure clips its gradients after backward. Called before the clip, probes.begin_optimizer_step makes
    the stored norms the unclipped ones; without it the gradients count when the closure returns (clipped)."""
    model, x, y = regression()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    raw, clipped = [], []
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(3):
            evaluations = []

            def closure(evaluations: list[int] = evaluations) -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                if helper:
                    probes.begin_optimizer_step(opt)
                if not evaluations:
                    raw.append(float(model[0].weight.grad.norm()))
                nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                if not evaluations:
                    clipped.append(float(model[0].weight.grad.norm()))
                evaluations.append(1)
                return loss

            w.step(opt.step(closure))
    norms = [stored(tmp_path, "0.weight")[s][0] for s in range(3)]
    assert norms == pytest.approx(raw if helper else clipped, rel=1e-5)
    assert raw != pytest.approx(clipped, rel=1e-2)


def test_begin_optimizer_step_names_a_bad_argument_and_ignores_unwatched_optimizers(tmp_path):
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer .*got str: 'adam'"):
        probes.begin_optimizer_step("adam")
    model, _, _ = regression()
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with probes.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path) as w:
        probes.begin_optimizer_step(other)             # watched by no watcher: nothing to tell
        with pytest.raises(ValueError, match="is not watched by"):
            w.begin_optimizer_step(other)
        with pytest.raises(ValueError, match="is not watched by"):
            w.begin_optimizer_step(3)
