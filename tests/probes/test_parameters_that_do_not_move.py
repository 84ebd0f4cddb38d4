"""Parameters that do not move: every way a real training loop leaves a parameter the optimizer steps unchanged, or
a tensor with gradients that no optimizer updates, is flagged and says which way; healthy loops whose gradients are
zero at first (zero-initialised gates) or that accumulate gradients over micro-batches are not."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import probes


def mlp(layers: int = 1) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(8, 8), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(8, 4))


def batch():
    return torch.randn(16, 8), torch.randint(0, 4, (16,))


def train(model, opt, w, steps, *, after_backward=None, step=None):
    for i in range(steps):
        x, y = batch()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward(i)
        (step or opt.step)()
        w.step(loss)


def moving(w):
    """(code, severity, path, reason) of the findings about tensors that do not move or are not trained."""
    codes = {"not-updating", "not-in-optimizer", "stale-optimizer-param", "unregistered-tensor", "frozen-parameter",
             "no-gradient"}
    return sorted((f.code, f.severity, f.path, f.evidence.get("reason")) for f in w.findings() if f.code in codes)


def test_a_param_group_with_lr_zero(run_dir):
    model = mlp()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}], lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4)
        found = {f.path: f for f in w.findings()}
    assert sorted(found) == ["0.bias", "0.weight"]
    assert found["0.weight"].severity == "error" and "param group 0 has lr=0" in found["0.weight"].message


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-decay", "sgd-momentum"])
def test_a_hook_that_zeroes_one_gradient(optimizer, run_dir):
    """A gradient hook (a mask) zeroes 0.weight's gradient: SGD never moves it; AdamW's weight decay and SGD's momentum
    (the hook starts after 2 steps) still do, which is no learning either. One tensor of several: an info, as a loss
    that does not depend on a tensor gives."""
    model = mlp()
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
           "adamw-decay": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
           "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[optimizer](model.parameters())
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        if optimizer == "sgd-momentum":
            train(model, opt, w, 2)
        model[0].weight.register_hook(torch.zeros_like)
        train(model, opt, w, 4)
        assert moving(w) == [("not-updating", "info", "0.weight", "zero-gradient")]
        [f] = w.findings()
    moved = optimizer != "sgd"
    assert f.evidence["moved_by_decay_or_momentum"] is moved and f.evidence["every_tensor"] is False
    assert ("it moves only by weight decay or momentum" if moved else "so the optimizer never moves it") in f.message
    assert "a gradient hook or mask" in f.message and "remove the hook or mask" in f.fix


def test_a_loss_that_does_not_depend_on_a_parameter(run_dir):
    """A critic trained on a difference of means: its last bias cancels, its gradient is exactly zero every step."""
    critic = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    with probes.watch(critic, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            loss = critic(torch.randn(32, 8) + 1).mean() - critic(torch.randn(32, 8)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert moving(w) == [("not-updating", "info", "2.bias", "zero-gradient")]


def test_gradients_clipped_to_zero(run_dir):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, after_backward=lambda i: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.0))
        [f] = w.findings()
    assert (f.code, f.severity, f.path, f.evidence["reason"], f.evidence["n_tensors"]) == (
        "not-updating", "error", "", "zero-gradient", 4)
    assert f.message.startswith("4 tensors (0.weight, 0.bias, 2.weight, 2.bias) are held by the optimizer and "
                                "gradients reach them, but their .grad is exactly zero")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_between_backward_and_step(set_to_none, run_dir):
    """The classic: zero_grad() after backward(): .grad is None (or zero) when the optimizer steps, for every tensor:
    one error at the root."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, after_backward=lambda i: opt.zero_grad(set_to_none=set_to_none))
        [f] = w.findings()
    assert (f.code, f.severity, f.path, f.evidence["n_tensors"]) == ("not-updating", "error", "", 4)
    assert f.evidence["reason"] == ("gradient-cleared" if set_to_none else "zero-gradient")
    assert ("their .grad is None when the optimizer steps" if set_to_none else "their .grad is exactly zero") \
        in f.message


def test_every_tensor_of_a_larger_model_is_one_finding(run_dir):
    model = mlp(layers=6)                                        # 14 tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, after_backward=lambda i: opt.zero_grad())
        [f] = [f for f in w.findings() if f.code == "not-updating"]
    assert (f.path, f.evidence["n_tensors"], f.evidence["reason"]) == ("", 14, "gradient-cleared")
    assert f.message.startswith("14 tensors (0.weight, 0.bias, 2.weight, 2.bias, 4.weight and 9 more): gradients "
                                "reach them in backward(), but their .grad is None")


def test_a_few_gradients_cleared_are_named_one_by_one(run_dir):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def clear():
        model[0].weight.grad = None
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, after_backward=lambda i: clear())
        assert moving(w) == [("not-updating", "error", "0.weight", "gradient-cleared")]


class TwoHeads(nn.Module):
    """``unused`` is built and never called; ``aux`` runs, but the loss does not use its output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.body(x))
        self.aux_out = self.aux(h)
        return self.head(h)


def test_layers_no_gradient_reaches(run_dir):
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 7)
        assert ("not-updating", "warning", "unused.weight", "no-gradient") not in moving(w)     # 7 steps: not yet
        train(model, opt, w, 2)
        found = {(f.code, f.path): f for f in w.findings()}
    assert moving(w) == [("no-gradient", "warning", "aux", None),
                         ("not-updating", "warning", "aux.bias", "no-gradient"),
                         ("not-updating", "warning", "aux.weight", "no-gradient"),
                         ("not-updating", "warning", "unused.bias", "no-gradient"),
                         ("not-updating", "warning", "unused.weight", "no-gradient")]
    f = found[("not-updating", "unused.weight")]
    assert "no gradient has reached it in any of the 9 optimizer steps observed, and its values never" in f.message
    assert found[("not-updating", "aux.weight")].cause == ("no-gradient", "aux")   # it ran: its finding says why
    assert f.cause is None


def test_a_frozen_parameter_the_optimizer_still_holds(run_dir):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].requires_grad_(False)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4)
        [f] = w.findings()
    assert (f.code, f.severity, f.path) == ("frozen-parameter", "info", "0")
    assert "held by an optimizer, which skips them" in f.message


def test_a_layer_replaced_after_the_optimizer_was_built(run_dir):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[2] = nn.Linear(8, 4)                                   # the optimizer steps the old one
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4)
        found = {(f.code, f.path): f for f in w.findings()}
    assert found[("not-updating", "2.weight")].cause == ("not-in-optimizer", "2.weight")
    assert found[("not-in-optimizer", "2.weight")].severity == "error"
    assert any(code == "stale-optimizer-param" for code, _ in found)


def test_a_parameter_reassigned_and_its_data_reassigned(run_dir):
    """``model.fc.weight = nn.Parameter(...)`` after the optimizer was built leaves the optimizer a stale copy;
    ``p.data = ...`` keeps the Parameter the optimizer holds, which trains on."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].weight.data = torch.randn(8, 8) * 0.1               # the same Parameter: fine
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4)
        codes = {(f.code, f.path) for f in w.findings()}
    assert ("not-in-optimizer", "2.weight") in codes and ("not-updating", "2.weight") in codes
    assert not any(path.startswith("0.") for _, path in codes)


def test_an_optimizer_built_on_a_copy_of_the_model(run_dir):
    model = mlp()
    opt = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4)
        found = moving(w)
    assert ("not-in-optimizer", "error", "0.weight", None) in found
    assert ("not-updating", "error", "0.weight", None) in found
    assert sum(1 for code, *_ in found if code == "stale-optimizer-param") == 4


def test_the_model_converted_after_the_optimizer_was_built(run_dir):
    """``.to()`` keeps the Parameters (the optimizer's) unless PyTorch is told to replace them on conversion: then the
    optimizer steps the old ones."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            x, y = batch()
            loss = F.cross_entropy(model(x.double()), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert ("not-updating", "error", "0.weight", None) in moving(w)
        assert ("stale-optimizer-param", "warning", "optimizer.param_groups[0]['params'][0]", None) in moving(w)


def test_tensors_with_gradients_that_no_optimizer_holds(run_dir):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.scale = torch.ones(4, requires_grad=True)          # a plain tensor attribute, not a Parameter

        def forward(self, x):
            return self.net(x) * self.scale
    model = Scaled()
    opt = torch.optim.SGD(model.net[2].parameters(), lr=0.1)    # the first layer is left out
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4)
        found = {(f.code, f.path): f for f in w.findings()}
    assert found[("not-updating", "net.0.weight")].cause == ("not-in-optimizer", "net.0.weight")
    assert found[("not-updating", "scale")].cause == ("unregistered-tensor", "scale")
    assert found[("unregistered-tensor", "scale")].severity == "error"


def test_a_grad_scaler_that_skips_every_step(run_dir):
    """Inf gradients every time: scaler.step() never calls optimizer.step(); the model trains no more. Said at the
    root while it goes on, resolved once the optimizer steps again."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    poison = model[0].weight.register_hook(lambda g: g * float("inf"))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        def scaled_step():
            scaler.step(opt)
            scaler.update()
        for _ in range(10):
            x, y = batch()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaled_step()
            w.step(loss)
        [f] = w.findings()
        assert (f.code, f.severity, f.path, f.evidence["reason"]) == ("not-updating", "error", "", "optimizer-stalled")
        assert "without an optimizer step" in f.message and "GradScaler" in f.message
        poison.remove()                                           # the fix: finite gradients, steps again
        train(model, opt, w, 2, step=scaled_step)
        assert w.findings() == []


def test_an_optimizer_step_forgotten(run_dir):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 3)                                  # one forward per step
        train(model, opt, w, 8, step=lambda: None)               # then no optimizer.step()
        [f] = w.findings()
    assert f.evidence == {"forwards": 8, "most_forwards_per_step": 1, "since_step": 3, "reason": "optimizer-stalled"}
    assert f.message.startswith("The model ran 8 training forwards (a step had at most 1 before) since step 2 ended")


def test_forwards_after_the_last_step_are_no_stall(run_dir):
    """Metrics computed with the model still in training mode, with gradients, after the last optimizer step (an
    evaluation done carelessly, not a training loop without steps): the loop reports no steps (w.step), no finding."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 3)
        for _ in range(12):
            model(torch.randn(16, 8))
        assert w.findings() == []


def test_healthy_loops_do_not_flag_anything(run_dir):
    """Zero-initialised gates (ReZero, LoRA's B: the gated weights' gradients are zero in the first step only),
    gradient accumulation over 4 micro-batches (4 forwards a step), SGD with momentum: nothing."""
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.branch = nn.Linear(8, 8)
            self.alpha = nn.Parameter(torch.zeros(1))             # ReZero
            self.a = nn.Linear(8, 2, bias=False)                  # a LoRA pair, B zero-initialised
            self.b = nn.Linear(2, 8, bias=False)
            nn.init.zeros_(self.b.weight)
            self.out = nn.Linear(8, 4)

        def forward(self, x):
            h = self.inp(x)
            h = h + self.alpha * torch.relu(self.branch(h)) + self.b(self.a(h))
            return self.out(h)
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(12):
            opt.zero_grad()
            for _ in range(4):
                x, y = batch()
                (F.cross_entropy(model(x), y) / 4).backward()
            opt.step()
        assert w.findings() == []
        assert not w.probe_errors
