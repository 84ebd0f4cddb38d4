"""A model can hold computed (non-leaf) tensors where parameters are expected: ``AveragedModel`` deep-copies a
TorchScript submodule, whose copied "parameters" are plain tensors made by ``clone()`` (``is_leaf`` False,
``requires_grad`` True). They never get a ``.grad``, and reading it makes torch warn ("The .grad attribute of a Tensor
that is not a leaf Tensor is being accessed"): modscope must not read it, on a sampled step or at its end, and still
measure their values."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import stored
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import probes
from probes.capture import host_values
from probes.model import tensors


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)      # torch.jit.script is deprecated, still used
            self.scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 16), nn.ReLU()))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scripted(x))


class WithEma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.99))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.fixture(params=["cpu", "accelerator"])
def read_path(request, monkeypatch):
    if request.param == "accelerator":
        monkeypatch.setattr(tensors, "FREE_READ_DEVICES", frozenset())
        monkeypatch.setattr(host_values, "DEFERRED_COPY_DEVICES", {"cpu", "cuda"})
    return request.param


@pytest.mark.parametrize("every", [1, 3])
def test_no_grad_of_a_non_leaf_tensor_is_read(run_dir, read_path, every):
    torch.manual_seed(0)
    model = WithEma()
    copied = dict(model.ema.named_parameters())
    assert not copied["module.scripted.0.weight"].is_leaf and copied["module.scripted.0.weight"].requires_grad
    opt = torch.optim.AdamW(model.net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
            for _ in range(9):
                x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.ema.update_parameters(model.net)
                w.step(loss)
            found = w.findings()
            assert w.probe_errors == {}
    leaf = [f"{m.filename}:{m.lineno}" for m in caught if "not a leaf Tensor" in str(m.message)]
    assert leaf == []
    assert not [f for f in found if f.path.startswith("ema.")]
    # their values are measured at every sampled step still, their gradient never
    sampled = stored(w, "SELECT COUNT(*) FROM steps WHERE sampled = 1")[0][0]
    rows = stored(w, "SELECT p.path, COUNT(s.step), COUNT(s.data_norm), COUNT(s.grad_norm) FROM params p "
                     "JOIN param_stats s USING (rank, param_id) WHERE p.path LIKE 'ema.module.scripted.%' "
                     "GROUP BY p.path ORDER BY p.path")
    assert rows == [(f"ema.module.scripted.0.{n}", sampled, sampled, 0) for n in ("bias", "weight")]
