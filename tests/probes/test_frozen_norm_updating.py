"""A frozen backbone (every parameter ``requires_grad=False``) left in training mode by ``model.train()``: its
BatchNorm layers keep updating running_mean and running_var to the fine-tuning batches, so the frozen part still
changes and evaluation uses statistics it was never trained with. One warning naming the layers; none once they
are in eval mode (the info about frozen statistics then says it is on purpose), none where only the layers' affine
parameters are frozen while the convolutions around them train, none for a frozen block without such layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes


class FineTune(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 2)
        self.no_grad_backbone = False      # features taken under no_grad, a common way to fine-tune a head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.no_grad_backbone):
            feats = self.backbone(x)
        return self.head(feats)


def train(model: nn.Module, w, steps: int, before_step=None) -> None:
    opt = w._optimizers[0]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        model.train()
        if before_step is not None:
            before_step(model)
        x, y = torch.randn(4, 3, 10, 10, generator=g) * 3 + 1, torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)


def frozen_backbone() -> FineTune:
    torch.manual_seed(0)
    model = FineTune()
    model.backbone.requires_grad_(False)
    return model


def freeze_norms(m: FineTune) -> None:
    """The fix the warning gives: the backbone's BatchNorms in eval after model.train()."""
    for layer in m.backbone.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.eval()


def updating(w) -> list:
    return [f for f in w.findings() if f.evidence.get("running_statistics_updated")]


@pytest.mark.parametrize("no_grad_backbone", [False, True])
def test_a_frozen_backbone_in_training_mode_is_a_warning(tmp_path, no_grad_backbone):
    model = frozen_backbone()
    model.no_grad_backbone = no_grad_backbone
    before = model.backbone[1].running_mean.clone()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        train(model, w, 4)
        found = updating(w)
    assert not torch.equal(model.backbone[1].running_mean, before)     # what the finding says: they moved
    assert len(found) == 1
    f = found[0]
    assert f.code == "training-mode-mismatch" and f.severity == "warning"
    assert f.evidence["modules"] == ["backbone.1", "backbone.4"] and f.evidence["n_modules"] == 2
    assert "running_mean" in f.message and "backbone.1" in f.message
    assert "eval" in f.fix and "FrozenBatchNorm2d" in f.fix
    assert f.first_step == 1 and f.count == 3      # its parameters seen unchanged from one sampled step to the next


def test_the_default_budget_finds_it_too(tmp_path):
    model = frozen_backbone()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path) as w:
        train(model, w, 6)
        assert len(updating(w)) == 1


def test_layers_put_in_eval_mode_are_frozen_on_purpose(tmp_path):
    """The fix the warning gives: the warning goes, and the info about frozen statistics says it is meant."""
    model = frozen_backbone()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)

    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        train(model, w, 3)
        assert len(updating(w)) == 1
        train(model, w, 3, before_step=freeze_norms)
        assert updating(w) == []
        assert [f for f in w.findings() if f.evidence.get("frozen_normalization")]


def test_frozen_affine_parameters_in_a_trained_network_are_not_reported(tmp_path):
    """A recipe of its own: the convolutions train, so the statistics must follow the changing features."""
    torch.manual_seed(0)
    model = FineTune()
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        train(model, w, 4)
        assert updating(w) == []


def test_unfreezing_the_backbone_ends_it(tmp_path):
    """Gradual unfreezing: once the backbone trains, its statistics are meant to move."""
    model = frozen_backbone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)        # holds the backbone already (a common recipe)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        train(model, w, 3)
        assert len(updating(w)) == 1
        model.backbone.requires_grad_(True)
        train(model, w, 2)
        assert updating(w) == []


def test_no_warning_without_running_statistics_or_a_training_step(tmp_path):
    """A frozen block of LayerNorms, or BatchNorms that track no statistics, has nothing that moves; and a
    forward in training mode with no optimizer step (statistics recomputed on purpose, swa_utils.update_bn's way)
    is no training step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.BatchNorm1d(16, track_running_stats=False),
                          nn.ReLU(), nn.Linear(16, 2))
    model[:3].requires_grad_(False)
    opt = torch.optim.SGD(model[4].parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(3):
            loss = F.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 2, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert updating(w) == []

    model = frozen_backbone()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path / "stats", every=1) as w:
        model.train()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(4, 3, 10, 10))
                w.step()
        assert updating(w) == []


def without_affine(model: FineTune) -> FineTune:
    """The backbone's BatchNorms with no parameters of their own (affine=False): frozen with their block."""
    for i in (1, 4):
        model.backbone[i] = nn.BatchNorm2d(8, affine=False)
    return model


def test_a_layer_without_parameters_of_its_own_is_frozen_with_its_block(tmp_path):
    model = without_affine(frozen_backbone())
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        train(model, w, 4)
        found = updating(w)
    assert [f.evidence["modules"] for f in found] == [["backbone.1", "backbone.4"]]


def momentum_update(style: str, k: nn.Parameter, q: nn.Parameter, m: float = 0.99) -> None:
    if style == "in_place":               # BYOL-style, under no_grad: bumps the parameter's version counter
        k.mul_(m).add_(q, alpha=1 - m)
    elif style == "data_in_place":        # DINO: param_k.data.mul_(m).add_(...): .data has a counter of its own
        k.data.mul_(m).add_((1 - m) * q.detach().data)
    else:                                 # MoCo: param_k.data = param_k.data * m + param_q.data * (1 - m)
        k.data = k.data * m + q.data * (1.0 - m)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("style", ["in_place", "data_in_place", "data_assigned"])
def test_parameters_updated_without_gradients_are_not_frozen(run_dir, affine, style):
    """A momentum encoder (MoCo, BYOL, DINO): requires_grad=False, updated from the online encoder every step (in
    place, or through ``.data``, which no version counter sees) and run in training mode on purpose. Its parameters
    change: not frozen, not reported (nor its BatchNorms without parameters of their own: their block's change)."""
    import copy
    torch.manual_seed(0)
    model = FineTune()
    if not affine:
        without_affine(model)
    model.momentum = copy.deepcopy(model.backbone).requires_grad_(False)
    opt = torch.optim.SGD([*model.backbone.parameters(), *model.head.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            with torch.no_grad():
                for k, q in zip(model.momentum.parameters(), model.backbone.parameters(), strict=True):
                    momentum_update(style, k, q)
            x = torch.randn(4, 3, 10, 10, generator=g)
            pred = model(x)                             # the model's forward first: its mode is known in the step
            with torch.no_grad():
                target = model.momentum(x)
            loss = (model.backbone(x) - target).pow(2).mean() + pred.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert updating(w) == []


def test_the_fix_with_a_trained_head_s_batchnorm_is_frozen_on_purpose(run_dir):
    """The warning's fix when the trained head has a BatchNorm of its own in training mode: the backbone's layers in
    eval are frozen on purpose (an info), not out of step with the model (an error)."""
    class WithNormHead(FineTune):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

    torch.manual_seed(0)
    model = WithNormHead()
    model.backbone.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)

    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, w, 4, before_step=freeze_norms)
        found = [f for f in w.findings() if f.code == "training-mode-mismatch"]
    assert [(f.path, f.severity) for f in found] == [("", "info")]
    assert found[0].evidence["modules"] == ["backbone.1", "backbone.4"]
    assert "inside frozen blocks" in found[0].message


def test_a_discriminator_frozen_again_after_its_own_step_is_not_reported(run_dir):
    """pix2pix's set_requires_grad(netD, False) after D's update: D trains every step (its parameters change), so
    its BatchNorm in training mode is no frozen part's."""
    torch.manual_seed(0)

    class GAN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
            self.D = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, z: torch.Tensor) -> torch.Tensor:    # the model's forward runs: its mode is known
            return self.G(z)
    model = GAN()
    G, D = model.G, model.D
    opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    bce = F.binary_cross_entropy_with_logits
    with probes.watch(model, [opt_g, opt_d], run_dir=run_dir, every=1) as w:
        for _ in range(5):
            fake = model(torch.randn(8, 4))
            D.requires_grad_(True)
            d_loss = bce(D(torch.randn(8, 8)), torch.ones(8, 1)) + bce(D(fake.detach()), torch.zeros(8, 1))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            D.requires_grad_(False)
            g_loss = bce(D(fake), torch.ones(8, 1))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
        assert updating(w) == []


def test_a_part_evaluated_within_the_step_does_not_hide_it(run_dir):
    """A kNN monitor or a probe evaluated between backward and the optimizer step (``model.eval()``, the backbone
    under no_grad, ``model.train()``): the training forward already moved the frozen layers' statistics."""
    model = frozen_backbone()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            model.train()
            x, y = torch.randn(4, 3, 10, 10, generator=g), torch.randint(0, 2, (4,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            model.eval()
            with torch.no_grad():
                model.backbone(x)
            model.train()
            opt.step()
            w.step(loss)
        found = updating(w)
    assert [f.evidence["modules"] for f in found] == [["backbone.1", "backbone.4"]]


class FrozenBatchNorm2d(nn.Module):
    """torchvision.ops.FrozenBatchNorm2d (detectron2's too): constant statistics and affine parameters, in buffers;
    its training flag changes nothing."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((n,), value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        return x * scale[None, :, None, None] + (self.bias - self.running_mean * scale)[None, :, None, None]


def test_frozen_batchnorm_is_no_normalization_layer_with_running_statistics(run_dir):
    """mmdetection's recipe: a backbone with FrozenBatchNorm2d (in training mode: it changes nothing) and a trained
    neck whose BatchNorms are put in eval after model.train() (``norm_eval``). The neck's layers are frozen on purpose
    (the info), not out of step with the model (errors), and the FrozenBatchNorm2d layers are never reported."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), FrozenBatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            model.train()
            model[4].eval()                                    # norm_eval
            x, y = torch.randn(4, 3, 10, 10, generator=g), torch.randint(0, 2, (4,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        found = [f for f in w.findings() if f.code == "training-mode-mismatch"]
    assert [(f.path, f.severity, f.evidence.get("modules")) for f in found] == [("", "info", ["4"])]


def test_a_frozen_stem_at_the_top_of_the_model_is_frozen_too(run_dir):
    """torchvision's ResNet freezes its stem (``conv1``, ``bn1`` on the model itself) with the first stages; the
    model around them trains. ``bn1`` is frozen with the layer before it, as the stage's layers are with theirs."""
    class ResNetLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3)
            self.bn1 = nn.BatchNorm2d(8)
            self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
            self.layer2 = nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
            self.fc = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
            return self.fc(x.mean((2, 3)))

    torch.manual_seed(0)
    model = ResNetLike()
    for part in (model.conv1, model.bn1, model.layer1):
        part.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, w, 4)
        found = updating(w)
    assert [f.evidence["modules"] for f in found] == [["bn1", "layer1.1"]]
