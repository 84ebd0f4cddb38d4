"""A watched model can be copied and saved whole: ``copy.deepcopy(model)`` (an EMA or Mean Teacher copy,
``AveragedModel`` for SWA, timm's ``ModelEmaV2``) and ``torch.save(model)`` copy the module's hook dicts, which hold
modscope's hooks. The copy gets none of them: copying never raises, and the copy's forwards are not the
watched model's (a copy run in training mode under no_grad is no validation of the model)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))


def step(model: nn.Module, opt: torch.optim.Optimizer, w, x: torch.Tensor, y: torch.Tensor, between=None) -> None:
    loss = F.cross_entropy(model(x), y)
    if between is not None:
        between()                                   # inside a sampled step: its hooks are live
    opt.zero_grad()
    loss.backward()
    opt.step()
    w.step(loss)


@pytest.mark.parametrize("when", ["before the first forward", "between steps", "inside a sampled step"])
def test_deepcopy_of_a_watched_model_works_and_the_copy_is_not_watched(run_dir, when):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    copies = []
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        if when == "before the first forward":
            copies.append(copy.deepcopy(model))
        step(model, opt, w, x, y, between=(lambda: copies.append(copy.deepcopy(model)))
             if when == "inside a sampled step" else None)
        if when == "between steps":
            copies.append(copy.deepcopy(model))
        (ema,) = copies
        ema.requires_grad_(False)
        for _ in range(3):
            with torch.no_grad():
                ema(x)                               # a teacher's targets, in training mode under no_grad
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.mul_(0.9).add_(p, alpha=0.1)
            step(model, opt, w, x, y)
        assert {f.code for f in w.findings()} & {"train-mode-under-no-grad", "training-mode-mismatch"} == set()
        assert w.probe_errors == {}
    copied = [h for m in ema.modules() for h in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]]
    assert copied == []                             # the copy holds none of modscope's hooks
    assert all(not p._backward_hooks for p in ema.parameters())


def test_averaged_model_and_update_bn_on_a_watched_model(run_dir):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        swa = torch.optim.swa_utils.AveragedModel(model)
        for _ in range(4):
            step(model, opt, w, x, y)
            swa.update_parameters(model)
        torch.optim.swa_utils.update_bn([x, x], swa)
        assert w.probe_errors == {}
    assert swa.n_averaged.item() == 4 and not torch.equal(swa.module[0].weight, model[0].weight)


def test_a_watched_model_saved_whole_loads_without_modscope_s_hooks(run_dir):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    buf = io.BytesIO()
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        step(model, opt, w, x, y)
        torch.save(model, buf)
        step(model, opt, w, x, y)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not loaded._forward_pre_hooks and not loaded._forward_hooks     # modscope's were left out
    model.eval()
    loaded.eval()
    assert loaded(x).shape == (32, 2)
