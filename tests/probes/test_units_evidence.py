"""Dead units are judged on the values each unit held over the window, known exactly now (each call's values per
unit, from its layout) instead of a lower bound from the outputs' sizes alone, which with one batch size counted one
value per unit per call. So a module called in some sampled steps only is
judged once the window holds enough: a head used every other step with dead units is reported. Too few values
still are not, nor a dropout over sparse live units (its draws are not the unit's values)."""

from __future__ import annotations

import torch
from torch import nn

import probes


class TwoHeads(nn.Module):
    """A shared trunk and two heads used on alternate steps (a multi-task loop); head ``a`` has dead units."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.out = nn.Linear(32, 1)
        self.use_a = True
        with torch.no_grad():
            self.a[0].bias[:16] = -100.0         # 16 of its 32 units never activate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return self.out(self.a(h) if self.use_a else self.b(h))


def dead(model: nn.Module, run_dir, steps: int, batch: int, shape: tuple[int, ...], alternate: bool = False) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(steps):
            if alternate:
                model.use_a = step % 2 == 0
            loss = model(torch.randn(batch, *shape, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return {f.path: f for f in w.findings() if f.code in ("dead-layer", "dead-units")}


def test_a_head_used_every_other_step_with_dead_units_is_reported(run_dir):
    torch.manual_seed(0)
    found = dead(TwoHeads(), run_dir, steps=16, batch=16, shape=(16,), alternate=True)
    assert set(found) == {"a.1"}
    f = found["a.1"]
    assert f.code == "dead-units" and f.evidence["dead_fraction"] == 0.5
    assert f.evidence["window_samples"] == 8             # its calls: every other sampled step


def test_a_head_used_every_other_step_with_too_few_values_is_not_judged(run_dir):
    """Batch 2: 8 calls of 2 values per unit are 16, under SPARSE_ROWS: a live unit may just not have fired."""
    torch.manual_seed(0)
    found = dead(TwoHeads(), run_dir, steps=16, batch=2, shape=(16,), alternate=True)
    assert "a.1" not in found


class SparseFeatures(nn.Module):
    """Live ReLU units that each fire on about 2% of the inputs, then Dropout(0.5)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.drop, self.out = nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 4)
        with torch.no_grad():
            self.fc.weight.copy_(torch.nn.functional.normalize(torch.randn(128, 32), dim=1))
            self.fc.bias.fill_(-2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.act(self.fc(x))))


def test_a_heavy_dropout_over_sparse_live_units_is_not_judged(run_dir):
    """A dropout's draws are not each unit's values: a live unit non-zero in a few of them (sparse features, one-hot
    inputs) may have had all of those dropped. Its chance is bounded by one draw per call, as before."""
    torch.manual_seed(0)
    found = dead(SparseFeatures(), run_dir, steps=6, batch=16, shape=(32,))
    assert "drop" not in found
