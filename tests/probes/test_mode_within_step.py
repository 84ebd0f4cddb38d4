"""A module whose training flag differs from the model's in one forward of a step is reported even when another
forward of the same step runs in step with the model: a validation pass after ``model.eval()`` that leaves a
Dropout in a plain list in training mode, followed by the next training forward before the optimizer step (the
usual epoch loop: validation ends the epoch, the next epoch's first step trains). The capture kept the last call's
mode only, so the training forward hid it and even cleared an earlier finding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import zoo
from torch import nn

import probes


def epoch_loop(model: nn.Module, opt: torch.optim.Optimizer, w, epochs: int, steps: int, validate: bool) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        model.train()
        for _ in range(steps):
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        if validate:
            model.eval()                              # does not reach regs[0]
            with torch.no_grad():
                model(torch.randn(8, 8, generator=g))


def mismatches(w) -> list[tuple[str, str, dict]]:
    return [(f.path, f.severity, f.evidence) for f in w.findings() if f.code == "training-mode-mismatch"]


def test_a_validation_forward_out_of_step_is_kept_when_a_training_forward_follows(run_dir):
    model = zoo.DropoutInList()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        epoch_loop(model, opt, w, epochs=3, steps=2, validate=True)
        found = mismatches(w)
    assert found == [("regs[0]", "error", {"module_training": True, "root_training": False})]


def test_training_alone_in_step_with_the_model_reports_nothing(run_dir):
    """The same loop without validation: regs[0] trains with the model, as it should."""
    model = zoo.DropoutInList()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        epoch_loop(model, opt, w, epochs=3, steps=2, validate=False)
        assert mismatches(w) == []
