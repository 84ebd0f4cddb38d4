"""A module out of step with the model although model.train()/eval() reach it: something set its mode after them.

- Monte Carlo dropout (``model.eval()``, then every Dropout back in training mode, several stochastic passes under
  no_grad) does it on purpose: one info naming the layers, not an error per layer that says eval() missed them.
- A part put in eval while the model trains (a Hugging Face model from ``from_pretrained()``, in eval mode, inside a
  module that trains; ``part.eval()`` left over from a freeze helper): one warning at the part, the modules inside it
  with the same flag told in that finding, not one finding per layer and container.
- A module that model.train()/eval() never reach (in a plain list) stays an error (test_findings_zoo,
  test_mode_reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes


class Block(nn.Module):
    """A user module with Dropouts (mode-relevant: it may read self.training)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.fc(x)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(x))
        for b in self.blocks:
            x = b(x)
        return x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def mode_findings(w) -> list[tuple[str, str, dict]]:
    return sorted((f.path, f.severity, f.evidence) for f in w.findings() if f.code == "training-mode-mismatch")


def run(run_dir, every: int, before_step=None, evaluate=None, steps: int = 6) -> list[tuple[str, str, dict]]:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        for _ in range(steps):
            model.train()
            if before_step is not None:
                before_step(model)
            x, y = torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if evaluate is not None:
                evaluate(model, x)
        return mode_findings(w)


def monte_carlo(model: nn.Module, x: torch.Tensor) -> None:
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.train()
    with torch.no_grad():
        torch.stack([model(x).softmax(-1) for _ in range(4)]).mean(0)


@pytest.mark.parametrize("every", [1, 3])
def test_monte_carlo_dropout_is_one_info(run_dir, every):
    found = run(run_dir, every, evaluate=monte_carlo)
    assert len(found) == 1
    path, severity, evidence = found[0]
    assert severity == "info" and evidence["monte_carlo_dropout"] is True
    assert evidence["modules"] == ["encoder.drop", "encoder.blocks.0.drop", "encoder.blocks.1.drop",
                                   "encoder.blocks.2.drop", "head.0"]
    assert path == "encoder.drop"


def test_a_part_left_in_eval_while_the_model_trains_is_one_warning(run_dir):
    found = run(run_dir, 1, before_step=lambda m: m.encoder.eval())
    assert found == [("encoder", "warning", {"module_training": False, "root_training": True, "modules_inside": 7,
                                             "mode_set_after_model": True})]


def test_a_dropout_turned_off_in_a_trained_part_is_a_warning_of_its_own(run_dir):
    found = run(run_dir, 1, before_step=lambda m: m.head[0].eval())
    assert found == [("head.0", "warning", {"module_training": False, "root_training": True,
                                            "mode_set_after_model": True})]


def test_evaluation_in_eval_mode_afterwards_ends_it(run_dir):
    """Monte Carlo evaluations first, plain ones (model.eval() alone) after: the layers are in step again."""
    calls = []

    def evaluate(model: nn.Module, x: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) <= 2:
            monte_carlo(model, x)
            return
        model.eval()
        with torch.no_grad():
            model(x)

    assert run(run_dir, 1, evaluate=evaluate) == []


def test_a_frozen_part_put_in_eval_is_frozen_on_purpose(run_dir):
    """A frozen encoder of a class of the user's own (a teacher, a backbone) put in eval while the head trains: how a
    frozen part is frozen, no finding (torch containers were never compared; a user module is)."""
    def freeze(model: nn.Module) -> None:
        model.encoder.requires_grad_(False)
        model.encoder.eval()

    assert run(run_dir, 1, before_step=freeze) == []


def tent(run_dir, dropout: bool) -> list:
    """Test-time adaptation (TENT's variant that keeps the model in eval): model.eval(), then the BatchNorms back in
    training mode and their affine parameters trained on the prediction entropy, with gradients."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
              nn.AdaptiveAvgPool2d(1), nn.Flatten(), *([nn.Dropout(0.5)] if dropout else []), nn.Linear(8, 5)]
    model = nn.Sequential(*layers).requires_grad_(False).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.train()
            m.requires_grad_(True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(5):
            out = model(torch.randn(16, 3, 10, 10, generator=g))
            entropy = -(out.softmax(1) * out.log_softmax(1)).sum(1).mean()
            opt.zero_grad()
            entropy.backward()
            opt.step()
            w.step(entropy)
        return [(f.code, f.path, f.severity, f.evidence.get("modules")) for f in w.findings()
                if f.code in ("training-mode-mismatch", "train-step-in-eval-mode", "eval-builds-graph")]


@pytest.mark.parametrize("dropout", [False, True])
def test_test_time_adaptation_is_one_warning_about_the_norms_not_a_step_trained_in_eval(run_dir, dropout):
    assert tent(run_dir, dropout) == [("training-mode-mismatch", "1", "warning", ["1", "4"])]


def test_an_evaluation_after_the_last_step_is_judged_when_the_watcher_closes(run_dir):
    """Monte Carlo dropout run once, after training: the info is there once the watcher has closed."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        monte_carlo(model, x)
    found = mode_findings(w)
    assert [(path, severity, evidence.get("monte_carlo_dropout")) for path, severity, evidence in found] == [
        ("encoder.drop", "info", True)]


def test_batchnorm_without_running_statistics_is_not_mode_sensitive(run_dir):
    """TENT's own configuration: BatchNorms without running statistics normalize by the batch in both modes, so
    their flag against the model's is nothing to report."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 5)).requires_grad_(False).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.train()
            m.requires_grad_(True)
            m.track_running_stats, m.running_mean, m.running_var = False, None, None
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            out = model(torch.randn(16, 3, 10, 10, generator=g))
            entropy = -(out.softmax(1) * out.log_softmax(1)).sum(1).mean()
            opt.zero_grad()
            entropy.backward()
            opt.step()
            w.step(entropy)
        assert mode_findings(w) == []


def test_a_trained_part_left_in_eval_tells_its_batchnorm_in_its_own_finding(run_dir):
    """``model.encoder.eval()`` on a part that trains, holding a BatchNorm: one warning at the part, the layer among
    those inside it, not also an info that calls the layer frozen on purpose."""
    class WithNorm(Model):
        def __init__(self) -> None:
            super().__init__()
            self.encoder.embed = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))

    torch.manual_seed(0)
    model = WithNorm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            model.train()
            model.encoder.eval()
            x, y = torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        found = mode_findings(w)
    assert [(path, severity) for path, severity, _ in found] == [("encoder", "warning")]
    assert found[0][2]["modules_inside"] == 9          # 4 dropouts, 3 blocks, the Sequential and its BatchNorm


def test_a_torch_container_put_in_eval_is_the_finding_s_module(run_dir):
    """``model.head.eval()`` on an nn.Sequential: the warning is at the container the user put in eval."""
    found = run(run_dir, 1, before_step=lambda m: m.head.eval())
    assert found == [("head", "warning", {"module_training": False, "root_training": True, "modules_inside": 1,
                                          "mode_set_after_model": True})]
