"""Outputs with few values per unit per call: a unit is judged dead only once its outputs held MIN_UNIT_VALUES
values over the window, and an output of one value per call is constant only when that value stayed the same over
as many calls. A Squeeze-and-Excitation ReLU on pooled features (batch 2: 2 values a unit a call) and a critic's
hidden layer on one state a step were reported with dead units after 3 calls; a scalar loss module called in
forward, which changes every step, is not constant, while one that returns the same value every step is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes
from probes.findings import detectors

# torchvision's own block (tests/run.sh installs the torchvision built for your torch)
SqueezeExcitation = pytest.importorskip("torchvision.ops").SqueezeExcitation


def findings(model, run_dir, steps, batch_fn, every=1) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        for _ in range(steps):
            loss = batch_fn()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return {f.path: f for f in w.findings() if f.code in ("dead-layer", "dead-units")}


class SENet(nn.Module):
    def __init__(self, dead: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU())
        self.se = SqueezeExcitation(32, 8)          # pooled to 1x1, then conv 1x1 -> ReLU -> conv 1x1 -> sigmoid
        self.head = nn.Linear(32, 4)
        if dead:
            with torch.no_grad():
                self.se.fc1.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.se(self.stem(x)).mean((2, 3)))


def se_run(run_dir, dead: bool, steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = SENet(dead)
    g = torch.Generator().manual_seed(0)
    return findings(model, run_dir, steps, lambda: F.cross_entropy(
        model(torch.rand(2, 3, 32, 32, generator=g)), torch.randint(0, 4, (2,), generator=g)))


def test_a_squeeze_excitation_relu_on_pooled_features_is_not_judged_on_six_values(run_dir):
    assert se_run(run_dir, dead=False) == {}
    # the same ReLU dead (constant zero, as a healthy one can be on two pooled samples for a few steps) is found
    # once its outputs held MIN_UNIT_VALUES values a unit: 8 steps of 2 samples, not 7
    per_step = 2
    assert se_run(run_dir / "dead7", dead=True, steps=detectors.MIN_UNIT_VALUES // per_step - 1) == {}
    found = se_run(run_dir / "dead", dead=True, steps=detectors.MIN_UNIT_VALUES // per_step)
    assert set(found) == {"se.activation"} and found["se.activation"].code == "dead-layer"


class Critic(nn.Module):
    def __init__(self, dead: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.ReLU())
        self.value = nn.Linear(32, 1)
        if dead:
            with torch.no_grad():
                self.body[0].bias.fill_(-100.0)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.value(self.body(state))


def critic_run(run_dir, dead: bool, steps: int) -> dict:
    """A critic evaluated on one state a step, along a slowly moving trajectory (batch 1)."""
    torch.manual_seed(0)
    model = Critic(dead)
    g = torch.Generator().manual_seed(0)
    state = torch.randn(1, 4, generator=g)

    def batch() -> torch.Tensor:
        nonlocal state
        state = state + 0.05 * torch.randn(1, 4, generator=g)
        return (model(state) - 1.0).pow(2).mean()
    return findings(model, run_dir, steps, batch)


def test_a_critic_on_one_state_a_step_is_not_judged_on_a_few_values(run_dir):
    assert critic_run(run_dir, dead=False, steps=6) == {}
    assert critic_run(run_dir / "dead15", dead=True, steps=detectors.MIN_UNIT_VALUES - 1) == {}
    found = critic_run(run_dir / "dead", dead=True, steps=detectors.MIN_UNIT_VALUES)
    assert set(found) == {"body.1"} and found["body.1"].code == "dead-layer"


class WithCriterion(nn.Module):
    """The loss module called inside forward, as many public training scripts do."""

    def __init__(self, frozen_logits: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.criterion = nn.CrossEntropyLoss()
        self.frozen_logits = frozen_logits

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        if self.frozen_logits:                  # the bug: the loss no longer depends on anything that changes
            logits = logits.detach() * 0.0
        return self.criterion(logits, y)


def criterion_run(run_dir, frozen: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model = WithCriterion(frozen)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (16,), generator=g)
    # (+ 0 x the weights: a loss that still backpropagates)
    return findings(model, run_dir, steps, lambda: model(torch.randn(16, 8, generator=g), y) + 0.0 * sum(
        p.sum() for p in model.parameters()))


def test_a_loss_module_in_forward_is_constant_only_when_its_value_never_changes(run_dir):
    assert criterion_run(run_dir, frozen=False, steps=detectors.MIN_UNIT_VALUES) == {}
    n = detectors.MIN_UNIT_VALUES
    assert "criterion" not in criterion_run(run_dir / "short", frozen=True, steps=n - 1)
    found = criterion_run(run_dir / "frozen", frozen=True, steps=n)
    assert found["criterion"].code == "dead-layer" and "constant" in found["criterion"].message
