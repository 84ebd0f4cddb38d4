"""A 6-layer tanh MLP (width 256, batch 128, SGD) trained for real under ``probes.watch``: the run the layer views,
``modscope series`` and its pandas function are tested on. The gradient norms are taken in the training loop too,
to compare with what the store holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import probes

WIDTH, BATCH, LAYERS, IN, CLASSES = 256, 128, 6, 32, 10


def tanh_mlp() -> nn.Sequential:
    """Six Linear layers with a Tanh after each but the last."""
    dims = [IN] + [WIDTH] * (LAYERS - 1) + [CLASSES]
    mods: list[nn.Module] = []
    for i in range(LAYERS):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < LAYERS - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods)


@dataclass(frozen=True)
class TrainedRun:
    run_dir: Path
    grad_norms: dict[tuple[int, str], float]      # (step, parameter path) -> ||grad|| taken in the loop
    steps: int
    layer_paths: tuple[str, ...]                 # the Linear layers, in order


def train(run_dir: Path, steps: int = 200, every: int | None = 1, seed: int = 0, dense: bool = True) -> TrainedRun:
    """Train the MLP for ``steps`` steps on a fixed random task, watched (``every``: the sampling interval;
    ``dense``: the dense tier between full samples)."""
    torch.manual_seed(seed)
    model = tanh_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(BATCH * 4, IN)
    y = torch.randint(0, CLASSES, (BATCH * 4,))
    norms: dict[tuple[int, str], float] = {}
    with probes.watch(model, opt, run_dir=run_dir, every=every, run_name="tanh-mlp", dense=dense) as w:
        for step in range(steps):
            i = (step % 4) * BATCH
            loss = nn.functional.cross_entropy(model(x[i:i + BATCH]), y[i:i + BATCH])
            opt.zero_grad()
            loss.backward()
            for name, p in model.named_parameters():
                assert p.grad is not None
                norms[(step, name)] = float(p.grad.norm())
            opt.step()
            w.step(loss)
    layers = tuple(name for name, m in model.named_children() if isinstance(m, nn.Linear))
    return TrainedRun(Path(run_dir), norms, steps, layers)


# Every 4th step a full sample: 50 of the 200 steps hold gradient norms, enough for the layer views (40 or more
# columns) at a quarter of every=1's time. The views are tested on the full samples alone (dense=False); with the
# dense tier, the steps between hold gradient and weight norms too (tests/dashboard/test_series_dense_tier.py).
EVERY = 4
_RUNS: dict[tuple[int, int | None, bool], TrainedRun] = {}


def shared_run(tmp_path_factory, steps: int = 200, every: int | None = EVERY, dense: bool = False) -> TrainedRun:
    """One trained run per pytest session (the CLI, the page data and the browser tests read the same)."""
    key = (steps, every, dense)
    if key not in _RUNS:
        _RUNS[key] = train(tmp_path_factory.mktemp("tanh-mlp") / "run", steps, every, dense=dense)
    return _RUNS[key]
