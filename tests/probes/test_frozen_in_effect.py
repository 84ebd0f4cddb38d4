"""A parameter that requires grad, that no optimizer holds and that no gradient reaches (a teacher or a frozen
feature extractor run under ``torch.no_grad()``, its ``requires_grad`` left True) is frozen in effect: an info,
not the ``not-in-optimizer`` error, whose message ("its gradient is computed") would be false. A gradient that
reaches it makes it the error again, and the bug the error is for (a head swapped after the optimizer was
built) stays an error from the start."""

from __future__ import annotations

import torch
import torch.nn as nn
from helpers import by_code

import probes


class Distill(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))    # requires_grad left True
        self.student = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        self.teach_with_grad = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.set_grad_enabled(self.teach_with_grad):
            target = self.teacher(x)
        return self.student(x), target


def step(model: Distill, opt: torch.optim.Optimizer, w) -> None:
    student, target = model(torch.randn(8, 16))
    loss = (student - target).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    w.step(loss)


def severities(w, prefix: str) -> set[str]:
    return {f.severity for f in by_code(w.findings()).get("not-in-optimizer", []) if f.path.startswith(prefix)}


def test_a_teacher_run_under_no_grad_is_frozen_in_effect_until_a_gradient_reaches_it(run_dir):
    model = Distill()
    opt = torch.optim.AdamW(model.student.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        step(model, opt, w)
        assert severities(w, "teacher.") == {"error"}                # one step does not show it yet
        for _ in range(2):
            step(model, opt, w)
        assert severities(w, "teacher.") == {"info"}
        (first, *_) = [f for f in w.findings() if f.path == "teacher.0.weight"]
        assert "no gradient has reached it" in first.message and "requires_grad_(False)" in first.fix
        assert first.evidence["gradient_reached"] is False and first.evidence["sampled_training_steps"] == 3
        model.teach_with_grad = True                                 # now the loss trains through it: the bug
        step(model, opt, w)
        assert severities(w, "teacher.") == {"error"}
        model.teach_with_grad = False
        for _ in range(3):
            step(model, opt, w)
        assert severities(w, "teacher.") == {"error"}                # once reached, it is no frozen copy


def test_a_head_swapped_after_the_optimizer_stays_an_error(run_dir):
    model = Distill()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        step(model, opt, w)
        model.student[2] = nn.Linear(8, 4)
        for _ in range(4):
            step(model, opt, w)
        assert severities(w, "student.2.") == {"error"}
        assert severities(w, "teacher.") == set()


class FrozenBaseInAList(nn.Module):
    """LoRA-style: the frozen base layers kept in a plain list (out of state_dict), trainable adapters registered;
    ``norm``: a BatchNorm beside them in a list too (its running statistics and mode are missed: still an error)."""

    def __init__(self, with_norm: bool = False) -> None:
        super().__init__()
        self.base = [nn.Linear(16, 16) for _ in range(2)]
        for layer in self.base:
            layer.requires_grad_(False)
        self.norms = [nn.BatchNorm1d(16)] if with_norm else []
        self.adapters = nn.ModuleList([nn.Sequential(nn.Linear(16, 2, bias=False), nn.Linear(2, 16, bias=False))
                                       for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, adapter in zip(self.base, self.adapters, strict=True):
            x = torch.relu(base(x) + adapter(x))
        for norm in self.norms:
            x = norm(x)
        return x


def test_a_frozen_base_kept_unregistered_is_a_warning_that_says_what_it_misses(run_dir):
    model = FrozenBaseInAList()
    opt = torch.optim.AdamW(model.adapters.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(3):
            out = model(torch.randn(8, 16))
            opt.zero_grad()
            out.pow(2).mean().backward()
            opt.step()
        found = {f.path: f for f in by_code(w.findings())["unregistered-module"]}
    assert set(found) == {"base"} and found["base"].evidence["layers"] == ["base[0]", "base[1]"]   # one list
    assert {f.severity for f in found.values()} == {"warning"}
    message = found["base"].message
    assert "all frozen" in message and "state_dict()" in message and "get gradients" not in message
    assert found["base"].evidence["frozen_only"] is True


def test_unregistered_blocks_that_train_or_hold_state_stay_errors():
    model = FrozenBaseInAList(with_norm=True)
    model.base[1].requires_grad_(True)                                    # trains, but no optimizer can hold it
    found = {f.path: f for f in by_code(probes.audit(model))["unregistered-module"]}
    assert {p: f.severity for p, f in found.items()} == {"base[0]": "warning", "base[1]": "error",
                                                         "norms[0]": "error"}
    assert "get gradients" in found["base[1]"].message and "frozen_only" not in found["base[1]"].evidence


def test_a_frozen_teacher_with_batchnorm_kept_unregistered_is_an_error_about_its_mode_not_gradients():
    """A frozen teacher in a plain list, with BatchNorm: nothing trains it, but model.eval() never reaches it (its
    statistics keep moving); the message says that, not that its parameters get gradients."""
    class Distill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = nn.Linear(8, 2)
            self.teachers = [nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).requires_grad_(False)]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.student(x)

    found = {f.path: f for f in by_code(probes.audit(Distill()))["unregistered-module"]}
    (f,) = found.values()
    assert (f.path, f.severity) == ("teachers[0]", "error")
    assert "all frozen" in f.message and "model.eval()/.train() never reach" in f.message
    assert "get gradients" not in f.message and "BatchNorm1d" in f.message
