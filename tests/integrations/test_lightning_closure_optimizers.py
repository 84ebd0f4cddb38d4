"""LBFGS under the real Lightning (CPU). Lightning runs training_step and backward inside
``optimizer.step(closure)`` and calls ``on_before_optimizer_step`` after every evaluation of the closure; the
callback's watcher stores the gradients of the first evaluation (the parameters before the step) and the
whole step's update. Under manual optimization a closure marks the moment with ``probes.begin_optimizer_step``
on the ``LightningOptimizer`` it holds."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes

pl = pytest.importorskip("lightning.pytorch")
EPOCHS = 4


def stored(run_dir: Path, path: str) -> list[tuple[int, float, float]]:
    [db] = run_dir.glob("modscope-*.sqlite")
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT s.step, s.grad_norm, s.update_norm FROM param_stats s JOIN params p "
                           "ON p.rank = s.rank AND p.param_id = s.param_id WHERE p.path = ? ORDER BY s.step",
                           (path,)).fetchall()
    finally:
        con.close()


class Regression(pl.LightningModule):
    """LBFGS on a small regression; records, per step, the first evaluation's gradient norm (unclipped) and the
    step's change of ``net.0.weight``."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.automatic_optimization = not manual
        self.first_grads: list[float] = []
        self.changes: list[float] = []
        self.evaluations: list[int] = []
        self._before: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._before = self.net[0].weight.detach().clone()
        self.evaluations.append(0)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        assert self._before is not None
        self.changes.append(float((self.net[0].weight.detach() - self._before).norm()))

    def on_after_backward(self) -> None:
        if self.evaluations[-1] == 0:
            self.first_grads.append(float(self.net[0].weight.grad.norm()))
        self.evaluations[-1] += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.automatic_optimization:
            return F.mse_loss(self(x), y)
        opt = self.optimizers()

        def closure() -> torch.Tensor:
            loss = F.mse_loss(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            probes.begin_optimizer_step(opt)         # a LightningOptimizer: the gradients are final here
            self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
            return loss

        opt.step(closure=closure)
        return None

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


def fit(tmp_path: Path, manual: bool) -> Regression:
    from probes.integrations.lightning import ModscopeCallback

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=64)
    model = Regression(manual)
    cb = ModscopeCallback(run_dir=tmp_path, every=1)
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(model, loader)
    assert not [f for f in cb.watcher.findings() if f.severity != "info"]
    return model


def test_lbfgs_under_automatic_optimization(tmp_path):
    model = fit(tmp_path, manual=False)
    assert all(n > 1 for n in model.evaluations)          # several evaluations per step
    rows = stored(tmp_path, "net.0.weight")
    assert [r[0] for r in rows] == list(range(EPOCHS))
    assert [r[1] for r in rows] == pytest.approx(model.first_grads, rel=1e-5)
    assert [r[2] for r in rows] == pytest.approx(model.changes, rel=1e-4)


def test_lbfgs_under_manual_optimization_marks_its_gradients_with_the_helper(tmp_path):
    model = fit(tmp_path, manual=True)
    rows = stored(tmp_path, "net.0.weight")
    assert [r[0] for r in rows] == list(range(EPOCHS))
    # marked before the closure clipped them: the unclipped norms, not 1e-3
    assert [r[1] for r in rows] == pytest.approx(model.first_grads, rel=1e-5)
    assert min(model.first_grads) > 1e-2
    assert [r[2] for r in rows] == pytest.approx(model.changes, rel=1e-4)
