"""An averaged copy of the model kept inside it (EMA, SWA: torch's ``AveragedModel``, timm's ``ModelEma``)
is updated by ``update_parameters()``, never by the optimizer, and ``AveragedModel`` copies the parameters
with ``requires_grad=True``: that is not the ``not-in-optimizer`` bug. A head swapped in beside it still is."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import codes, train
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import probes


class WithEma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.99))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch():
    return torch.randn(16, 8), torch.randint(0, 3, (16,))


def test_an_ema_copy_is_not_reported_as_missing_from_the_optimizer(run_dir):
    model = WithEma()
    opt = torch.optim.AdamW(model.net.parameters(), lr=1e-3)
    assert all(p.requires_grad for p in model.ema.parameters())       # as AveragedModel copies them
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(6):
            train(model, opt, w, 1, batch)
            model.ema.update_parameters(model.net)
            with torch.no_grad():
                model.ema(torch.randn(4, 8))
        model.net[2] = nn.Linear(16, 3)                            # the bug: a head swapped after the optimizer
        train(model, opt, w, 3, batch, loss_fn=F.cross_entropy)
        errors = codes(w.findings(), "error")
    assert not [p for c, p in errors if p.startswith("ema.")], errors
    assert ("not-in-optimizer", "net.2.weight") in errors
    assert not [f for f in probes.audit(model, opt) if f.path.startswith("ema.")]
