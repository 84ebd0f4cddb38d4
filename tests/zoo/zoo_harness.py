"""Train a zoo model a few steps, watched with every step sampled and unwatched, and compare the two."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import os
import struct
from pathlib import Path

import pytest
import torch
from zoo_models import ZooModel

import probes

STEPS = 3                     # every finding needs at most three sampled steps

# findings that are true of a model as initialised, on the zoo's random inputs, and so expected: SqueezeNet (no
# BatchNorm, kaiming-uniform weights, zero biases) starts with a quarter of some squeeze layers' units never active:
# over 64 random 128 x 128 images (14,400 values a unit) the same units stay at zero
TRUE_AT_INIT = {
    "squeezenet1_0": {("dead-units", "features.7.squeeze_activation")},
    "squeezenet1_1": {("dead-units", "features.9.squeeze_activation")},
}


@dataclasses.dataclass(frozen=True)
class Trained:
    losses: list[float]
    findings: list[probes.Finding]
    probe_errors: list[str]

    def loss_bits(self) -> list[bytes]:
        """The losses as their float32 bytes: bit-identical, NaN included."""
        return [struct.pack("<f", v) for v in self.losses]


def train(zm: ZooModel, run_dir: Path | None, steps: int = STEPS) -> Trained:
    """``zm`` built from seed 0 and trained ``steps`` steps on seeded batches; watched (every=1) when ``run_dir``."""
    torch.manual_seed(0)
    model = zm.build()
    model.train()
    opt = zm.optimizer(model)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(2)                       # dropout and drop-path draw from here, watched or not
    losses: list[float] = []
    if run_dir is None:
        for _ in range(steps):
            losses.append(train_step(zm, model, opt, gen))
        return Trained(losses, [], [])
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            losses.append(train_step(zm, model, opt, gen, w))
        return Trained(losses, w.findings(), [str(e) for e in w.probe_errors])


def train_step(zm: ZooModel, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
               w: probes.Watcher | None = None) -> float:
    loss = zm.loss(model, zm.batch(gen))
    opt.zero_grad()
    loss.backward()
    opt.step()
    if w is not None:
        w.step(loss)
    return loss.item()


def assert_trains_clean(zm: ZooModel, run_dir: Path) -> Trained:
    """No crash, no probe error, no error- or warning-level finding, the same losses to the bit as unwatched."""
    plain = train(zm, None)
    gc.collect()                               # the largest models (640M parameters) one at a time
    watched = train(zm, run_dir)
    gc.collect()
    assert not watched.probe_errors, watched.probe_errors
    expected = TRUE_AT_INIT.get(zm.name, set())
    loud = [str(f) for f in watched.findings if f.severity in ("error", "warning") and (f.code, f.path) not in expected]
    assert loud == [], "\n".join(loud)
    assert watched.loss_bits() == plain.loss_bits(), (plain.losses, watched.losses)
    assert all(v == v for v in plain.losses), f"{zm.name} diverged: {plain.losses}"     # a healthy run stays finite
    return watched


def require(module: str):
    """The zoo's framework, or a skip that names it; under ``MODSCOPE_ZOO_REQUIRED=1`` (CI) a missing one fails."""
    if os.environ.get("MODSCOPE_ZOO_REQUIRED") == "1":
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except Exception as e:      # not installed, or PyPI's CUDA torchvision beside a CPU torch ('torchvision::nms')
        pytest.skip(f"{module} cannot be imported here ({type(e).__name__}: {e}); tests/run.sh installs the one "
                    "built for your torch", allow_module_level=True)
