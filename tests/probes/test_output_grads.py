"""The gradient norm of each module's output, against autograd's own gradients of the same run."""
import sqlite3

import pytest
import torch
from helpers import train
from torch import nn

import probes
from probes import batch


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 8))


def _reference_norms(model: nn.Module, steps: int, rows: int) -> dict[tuple[str, int], float]:
    """(module path, step) -> the norm of the gradient of its output, read with tensor hooks."""
    norms: dict[tuple[str, int], float] = {}
    step = [0]

    def hook(path):
        def forward_hook(module, args, output):
            output.register_hook(lambda g: norms.__setitem__((path, step[0]), g.norm().item()))
        return forward_hook

    for path, m in model.named_modules():
        m.register_forward_hook(hook(path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        step[0] = s
        train(model, opt, None, 1, lambda: (torch.randn(rows, 64, generator=g), torch.randint(0, 8, (rows,),
                                                                                            generator=g)))
    return norms


@pytest.mark.parametrize("rows", [128, 8], ids=["large-outputs", "small-outputs"])
def test_each_module_gets_the_gradient_of_its_own_output(tmp_path, rows):
    """Large outputs (a gradient hook each) and small ones (kept by autograd) alike. A large output is freed
    once the next module ran, and the next output of its shape often gets its address, its id and version 0:
    looked up by those at backward time, one module's gradient went to another and the first got none."""
    assert (rows * 64 > batch.SMALL_OUTPUT) == (rows == 128)
    steps = 4
    expected = _reference_norms(_model(), steps, rows)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        train(model, opt, w, steps, lambda: (torch.randn(rows, 64, generator=g), torch.randint(0, 8, (rows,),
                                                                                             generator=g)))
    con = sqlite3.connect(w.store_path)
    stored = {(path, step): norm for path, step, norm in con.execute(
        "SELECT m.path, s.step, s.out_grad_norm FROM module_stats s JOIN modules m USING(rank, module_id)")}
    con.close()
    assert set(stored) == set(expected)
    for key, norm in expected.items():
        assert stored[key] == pytest.approx(norm, rel=1e-5), key
