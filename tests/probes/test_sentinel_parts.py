"""Loops that never call the model itself, only its parts (``model.encoder(x)`` then ``model.decoder(z)``): after a
step without a forward of the model, the sentinels watch its children, so validation in train mode, a training step
in eval mode and evaluation that builds graphs are found there too; a frozen or momentum encoder run in training
mode under no_grad for its targets (MoCo, BYOL) is no validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1),
                                     nn.Linear(16, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # never called by the loop below
        return self.decoder(self.encoder(x))


def codes(w) -> set[str]:
    return {f.code for f in w.findings()}


def loop(run_dir, every: int, validate=None, steps: int = 8) -> set[str]:
    torch.manual_seed(0)
    model = AutoEncoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        for step in range(steps):
            x = torch.randn(32, 8, generator=g)
            loss = F.mse_loss(model.decoder(model.encoder(x)), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if validate is not None and step == 2:
                validate(model, x)
        return codes(w)


def in_train_mode(model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model.decoder(model.encoder(x))


def forget_train(model: nn.Module, x: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        model.decoder(model.encoder(x))


def without_no_grad(model: nn.Module, x: torch.Tensor) -> None:
    model.eval()
    model.decoder(model.encoder(x))
    model.train()


def done_right(model: nn.Module, x: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        model.decoder(model.encoder(x))
    model.train()


MODE_CODES = {"train-mode-under-no-grad", "train-step-in-eval-mode", "eval-builds-graph"}


@pytest.mark.parametrize("every", [1, 4])
@pytest.mark.parametrize(("validate", "expected"), [
    (None, set()),
    (done_right, set()),
    (in_train_mode, {"train-mode-under-no-grad"}),
    (forget_train, {"train-step-in-eval-mode"}),
    (without_no_grad, {"eval-builds-graph"}),
])
def test_a_loop_calling_the_parts_is_watched_like_the_model(run_dir, every, validate, expected):
    assert loop(run_dir, every, validate) & MODE_CODES == expected


def test_a_momentum_encoder_in_training_mode_under_no_grad_is_no_validation(run_dir):
    """MoCo's key encoder: requires_grad=False, updated from the query encoder, run in training mode under no_grad
    on purpose (a container root nobody calls)."""
    import copy
    torch.manual_seed(0)
    query = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model = nn.ModuleDict({"query": query, "key": copy.deepcopy(query).requires_grad_(False)})
    opt = torch.optim.SGD(model["query"].parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(6):
            x = torch.randn(32, 8, generator=g)
            with torch.no_grad():
                for k, q in zip(model["key"].parameters(), model["query"].parameters(), strict=True):
                    k.data.mul_(0.99).add_(0.01 * q.data)
                target = model["key"](x)
            loss = F.mse_loss(model["query"](x + 0.1), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert codes(w) & MODE_CODES == set()
        # the contrast: the trained encoder evaluated in training mode
        with torch.no_grad():
            model["query"](x)
        loss = F.mse_loss(model["query"](x), x[:, :4])
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)
        assert codes(w) & MODE_CODES == {"train-mode-under-no-grad"}


def test_a_part_called_inside_another_part_is_no_forward_of_its_own(run_dir):
    """A projection shared by the decoder (tied weights): its calls inside the decoder's forward belong to that
    forward; one evaluation without no_grad is two forwards of the model's parts (the projection, the decoder)."""
    class Decoder(nn.Module):
        def __init__(self, proj: nn.Linear) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.1)
            self.proj = proj

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(self.drop(torch.relu(self.fc(x))))

    torch.manual_seed(0)
    proj = nn.Linear(8, 8)
    model = nn.ModuleDict({"proj": proj, "decoder": Decoder(proj)})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(4):
            x = torch.randn(16, 8, generator=g)
            loss = F.mse_loss(model["decoder"](model["proj"](x)), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if step == 1:
                model.eval()
                model["decoder"](model["proj"](x))        # without no_grad
                model.train()
        (f,) = [f for f in w.findings() if f.code == "eval-builds-graph"]
    assert f.evidence["forwards"] == 2


def test_a_frozen_part_evaluated_properly_does_not_end_validation_in_train_mode(run_dir):
    """A diffusion-style loop over a container root: each step starts with a frozen text encoder in eval under
    no_grad (the recipe), and a validation samples the trained UNet under no_grad in training mode (the bug). The
    frozen encoder's calls are no evaluation of the model: they neither count nor end the finding."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"text": nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)),
                           "unet": nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))})
    model["text"].requires_grad_(False).eval()
    opt = torch.optim.AdamW(model["unet"].parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(6):
            x, c = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
            with torch.no_grad():
                cond = model["text"](c)
            loss = F.mse_loss(model["unet"](torch.cat([x, cond], 1)), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if step == 2:
                with torch.no_grad():                       # sampling, still in training mode
                    model["unet"](torch.cat([x, cond], 1))
        assert codes(w) & MODE_CODES == {"train-mode-under-no-grad"}


def test_an_ema_target_no_optimizer_holds_is_no_validation_even_requiring_grad(run_dir):
    """BYOL's target network: an EMA of the online one, requires_grad left True, held by no optimizer, run in
    training mode under no_grad as a part of a container root."""
    import copy
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model = nn.ModuleDict({"online": online, "target": copy.deepcopy(online)})
    opt = torch.optim.SGD(model["online"].parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(5):
            x = torch.randn(32, 8, generator=g)
            with torch.no_grad():
                target = model["target"](x + 0.1)
            loss = F.mse_loss(model["online"](x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for t, o in zip(model["target"].parameters(), model["online"].parameters(), strict=True):
                    t.mul_(0.99).add_(o, alpha=0.01)
            w.step(loss)
        assert codes(w) & MODE_CODES == set()


def test_the_model_s_own_parameter_read_beside_its_parts_is_no_bypass(run_dir):
    """CLIP's loop: the image and text towers called one by one (open_clip's encode_image/encode_text), the
    model's own logit_scale read directly. The model's forward never runs; nothing bypassed it."""
    torch.manual_seed(0)

    class Clip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.image = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 8))
            self.text = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.Linear(16, 8))
            self.logit_scale = nn.Parameter(torch.tensor(2.6))

        def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
            return self.logit_scale.exp() * self.image(img) @ self.text(txt).T

    model = Clip()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            img, txt = torch.randn(16, 8, generator=g), torch.randn(16, 6, generator=g)
            logits = model.logit_scale.exp() * F.normalize(model.image(img)) @ F.normalize(model.text(txt)).T
            loss = F.cross_entropy(logits, torch.arange(16))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert [f for f in w.findings() if f.code == "forward-bypassed"] == []
