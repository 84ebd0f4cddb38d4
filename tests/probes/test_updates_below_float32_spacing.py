"""SGD at a small lr on a tensor whose gradient is tiny: the update lr x grad is below half the float32 spacing at the
tensor's values, so ``p - lr * g == p`` exactly. The optimizer stepped it; nothing is broken. Real patterns: a conv
with a bias before BatchNorm (which removes the bias: its gradient is float noise), and a branch behind a
zero-initialised 1x1 conv (ControlNet). The finding, if any, is an info that says the update is below the spacing,
with the numbers; a tensor that is really stuck keeps its error."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import probes


def conv_bn(c=16):
    """Every conv has bias=True and a BatchNorm after it, as many public CNNs do."""
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.norm = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.silu(self.norm(self.conv1(x))))


class ControlNetish(nn.Module):
    """A frozen main path; a trainable copy of its block, fed a hint, added back through a zero-initialised 1x1 conv."""

    def __init__(self, c=16):
        super().__init__()
        self.stem, self.block = nn.Conv2d(3, c, 3, padding=1), Block(c)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
        self.requires_grad_(False)
        self.control, self.hint, self.zero = Block(c), nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, c, 1)
        nn.init.zeros_(self.zero.weight)
        nn.init.zeros_(self.zero.bias)

    def forward(self, x, hint):
        h = self.stem(x)
        return self.head(self.block(h) + self.zero(self.control(h + self.hint(hint))))


def train(model, opt, run_dir, steps, batch, every=1):
    g = torch.Generator().manual_seed(1)
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        for _ in range(steps):
            loss = F.cross_entropy(*batch(g))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return w.findings()


def conv_bn_run(run_dir, lr, momentum, every):
    torch.manual_seed(0)
    model = conv_bn()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return train(model, opt, run_dir, 8, lambda g: (model(torch.randn(16, 3, 32, 32, generator=g)),
                                                   torch.randint(0, 10, (16,), generator=g)), every)


def controlnet_run(run_dir, lr, momentum, every, seed=0):
    torch.manual_seed(seed)
    model = ControlNetish()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=momentum)
    return train(model, opt, run_dir, 12, lambda g: (model(torch.randn(8, 3, 8, 8, generator=g),
                                                          torch.randn(8, 3, 8, 8, generator=g)),
                                                    torch.randint(0, 10, (8,), generator=g)), every)


def assert_below_spacing_infos(findings):
    """No error or warning; every not-updating finding an info that says the update is below the float32 spacing,
    with the estimated update per value and the spacing."""
    loud = [str(f) for f in findings if f.severity in ("error", "warning")]
    assert not loud, loud
    stuck = [f for f in findings if f.code == "not-updating"]
    for f in stuck:
        e = f.evidence
        assert f.severity == "info" and e["reason"] == "below-spacing", f
        assert 0 < e["update_per_value"] < e["spacing"] / 2 and e["reference"] == "float32", e
        assert "below the float32 spacing" in f.message and "Nothing is broken" in f.message, f.message
        assert f"{e['update_per_value']:.2g} per value" in f.message and f"spacing {e['spacing']:.2g}" in f.message
        assert "did not change it" not in f.message
    return stuck


@pytest.mark.parametrize(("lr", "momentum", "every"), [(1e-3, 0.9, 1), (1e-4, 0.9, None)])
def test_a_conv_bias_before_batchnorm_is_an_info_below_the_float32_spacing(run_dir, lr, momentum, every):
    stuck = assert_below_spacing_infos(conv_bn_run(run_dir, lr, momentum, every))
    assert [f.path for f in stuck] == ["6.bias"]          # the bias BatchNorm removes; seen before as an error
    assert "SGD: lr x the gradient" in stuck[0].evidence["estimate"] and "momentum 0.9" in stuck[0].message


BEHIND_ZERO = {"control.norm.weight", "control.conv1.bias", "control.conv2.bias", "hint.bias"}


@pytest.mark.parametrize(("lr", "momentum", "every"), [(1e-3, 0.0, 1), (1e-3, 0.9, 1), (1e-4, 0.0, None),
                                                       (1e-4, 0.9, None)])
def test_a_branch_behind_a_zero_initialised_conv_is_an_info_below_the_float32_spacing(run_dir, lr, momentum, every):
    """The GroupNorm's weight of 1 and the biases behind the zero conv (seen before as errors); under the default
    budget, from the first three steps, always sampled."""
    stuck = assert_below_spacing_infos(controlnet_run(run_dir, lr, momentum, every))
    assert stuck and {f.path for f in stuck} <= BEHIND_ZERO


def test_every_tensor_below_the_spacing_is_a_warning(run_dir):
    """A loss scaled far down on weights all far from zero: every tensor's update rounds away, nothing learns."""
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.6, 0.9)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    found = train(model, opt, run_dir, 4, lambda g: (model(torch.randn(32, 16, generator=g)) * 1e-3,
                                                     torch.randint(0, 4, (32,), generator=g)))
    stuck = [f for f in found if f.code == "not-updating"]
    assert {f.path for f in stuck} == {"0.weight", "0.bias", "1.weight", "1.bias"}, [str(f) for f in found]
    assert all(f.severity == "warning" and f.evidence["every_tensor"] for f in stuck)
    assert all("So is every tensor" in f.message for f in stuck)


class SkipsGroup1(torch.optim.Optimizer):
    """Plain SGD (its param groups have SGD's settings) that never steps its second param group (a bug): its
    tensors have full-size gradients."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
                                  "nesterov": False})

    @torch.no_grad()
    def step(self, closure=None):
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if i != 1 and p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_a_tensor_really_stuck_keeps_its_error(run_dir):
    """In the same run as the infos of the branch behind the zero conv, a head its optimizer never changes and a
    stem in a group with lr=0 stay errors."""
    model = ControlNetish()
    model.head.requires_grad_(True)
    model.stem.requires_grad_(True)
    branch = [p for m in (model.control, model.hint, model.zero) for p in m.parameters()]
    opt = SkipsGroup1([{"params": branch}, {"params": model.head.parameters()},
                       {"params": model.stem.parameters(), "lr": 0.0}], lr=1e-4)
    found = train(model, opt, run_dir, 12, lambda g: (model(torch.randn(8, 3, 8, 8, generator=g),
                                                            torch.randn(8, 3, 8, 8, generator=g)),
                                                      torch.randint(0, 10, (8,), generator=g)))
    by_path = {f.path: f for f in found if f.code == "not-updating"}
    head = [f for p, f in by_path.items() if p.startswith("head.")]
    assert head and all(f.severity == "error" and "did not change it" in f.message for f in head)
    for path in ("stem.weight", "stem.bias"):
        assert by_path[path].severity == "error" and "lr=0" in by_path[path].message
    infos = [f for p, f in by_path.items() if p in BEHIND_ZERO]
    assert infos and all(f.severity == "info" and f.evidence["reason"] == "below-spacing" for f in infos)
    assert set(by_path) <= BEHIND_ZERO | {"head.2.weight", "head.2.bias", "stem.weight", "stem.bias"}
