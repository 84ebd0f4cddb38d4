"""Findings across optimizers and sampled steps: a not-in-optimizer error is frozen in effect (an info) only after 2
sampled training steps of that tensor show no gradient (a head swapped mid-run is no teacher; a head used on steps
that are not sampled keeps its .grad); no-gradient is judged per optimizer that stepped (one optimizer per part);
grad-accumulating says what was seen and how many tensors are zeroed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import by_code

import probes


def not_in_optimizer(w, prefix: str) -> set[str]:
    return {f.severity for f in by_code(w.findings()).get("not-in-optimizer", []) if f.path.startswith(prefix)}


def test_a_head_swapped_in_mid_run_and_left_out_of_the_optimizer_stays_an_error(run_dir):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with probes.watch(m, opt, run_dir=run_dir, every=10) as w:
        for step in range(36):
            if step == 25:
                m[2] = nn.Linear(16, 1)          # opt.add_param_group forgotten
            loss = m(torch.randn(32, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert not_in_optimizer(w, "2.") == {"error"}


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 1)
        self.head_b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return (self.head_a if task == 0 else self.head_b)(torch.relu(self.trunk(x)))


def test_a_head_trained_only_in_steps_that_are_not_sampled_stays_an_error(run_dir):
    torch.manual_seed(0)
    m = TwoHeads()
    opt = torch.optim.SGD([*m.trunk.parameters(), *m.head_a.parameters()], lr=1e-2)    # head_b forgotten
    with probes.watch(m, opt, run_dir=run_dir, every=2) as w:
        for step in range(12):
            loss = m(torch.randn(32, 8), step % 2).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert not_in_optimizer(w, "head_b.") == {"error"}


class FrozenByMistake(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():            # the bug: meant for a warm-up only
            h = self.backbone(x)
        return self.head(h)


def test_no_gradient_to_a_part_with_an_optimizer_of_its_own(run_dir):
    torch.manual_seed(0)
    m = FrozenByMistake()
    opt_b = torch.optim.SGD(m.backbone.parameters(), lr=1e-4)
    opt_h = torch.optim.SGD(m.head.parameters(), lr=1e-2)
    with probes.watch(m, [opt_b, opt_h], run_dir=run_dir, every=1) as w:
        for _ in range(6):
            loss = m(torch.randn(32, 8)).pow(2).mean()
            opt_b.zero_grad()
            opt_h.zero_grad()
            loss.backward()
            opt_b.step()
            opt_h.step()
            w.step(loss)
        found = by_code(w.findings()).get("no-gradient", [])
        assert [f.path for f in found] == ["backbone.0"]
        assert "backbone.0.weight" in found[0].message


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def train_generator_first(run_dir, steps: int = 6, zero_d: bool = True, set_to_none: bool = True) -> list:
    torch.manual_seed(0)
    gan = GAN()
    bce = nn.functional.binary_cross_entropy_with_logits
    opt_g = torch.optim.Adam(gan.G.parameters(), 1e-3)
    opt_d = torch.optim.Adam(gan.D.parameters(), 1e-3)
    with probes.watch(gan, [opt_g, opt_d], run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            real, z = torch.randn(32, 8), torch.randn(32, 4)
            opt_g.zero_grad()
            fake = gan.G(z)
            bce(gan.D(fake), torch.ones(32, 1)).backward()
            opt_g.step()
            if zero_d:
                opt_d.zero_grad(set_to_none=set_to_none)
            d_loss = bce(gan.D(real), torch.ones(32, 1)) + bce(gan.D(fake.detach()), torch.zeros(32, 1))
            d_loss.backward()
            opt_d.step()
        return [f for f in w.findings() if f.code == "grad-accumulating"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_discriminator_zeroed_right_before_its_own_backward_does_not_accumulate(run_dir, set_to_none):
    """Generator first: its backward goes through D, whose .grad still holds D's last gradient; opt_D.zero_grad()
    right before D's own backward (setting .grad to None, or to zeros in place) makes D step with the right gradient:
    D's first gradient of the step found an old one, but the gradient D's optimizer steps on is its own."""
    assert train_generator_first(run_dir, set_to_none=set_to_none) == []


def test_a_discriminator_never_zeroed_still_accumulates(run_dir):
    """The same loop without opt_D.zero_grad(): D steps on the sum of every step's gradients, the bug."""
    found = train_generator_first(run_dir, zero_d=False)
    assert [f.path for f in found] == [""]
    assert "optimizer 1" in found[0].message


def test_a_tensor_left_unzeroed_does_not_say_most_others_are_zeroed(run_dir):
    """Only the head is zeroed (2 of 8 tensors): the other 6 accumulate, each its own finding."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                      nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    with probes.watch(m, opt, run_dir=run_dir, every=1) as w:
        for _ in range(6):
            loss = m(torch.randn(32, 8)).pow(2).mean()
            m[6].zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        found = {f.path: f for f in w.findings() if f.code == "grad-accumulating"}
    assert sorted(found) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    for f in found.values():
        assert "most other tensors" not in f.message
        assert "unless something zeroes it before step()" in f.message


def test_the_count_of_zeroed_tensors_is_said_when_known():
    from probes.findings.rules import GradAccumulating

    f = GradAccumulating.build("0.weight", [0.5, 0.7], [0.2, 0.2], 5, optimizer=0, zeroed=2, judged=8)
    assert "2 of the 8 tensors it holds that got gradients are zeroed" in f.message
    assert f.evidence["tensors_zeroed"] == 2 and f.evidence["tensors_with_gradients"] == 8
