"""The model zoo: every model constructor of torchvision.models, a broad set of timm models, and transformers,
diffusers and peft models built from small configs (nothing downloaded), each as a ``ZooModel``: how to build it,
a batch for it, the loss it trains on and its optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: ``build()`` returns it initialised from the current seed, ``batch(generator)`` one
    training batch, ``loss(model, batch)`` the scalar it trains on; ``adam``: trained with AdamW (transformers),
    else SGD with momentum (convolutional networks)."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    adam: bool = False
    lr: float | None = None            # default: 1e-3 with AdamW, 0.01 with SGD

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.adam:
            return torch.optim.AdamW(params, lr=self.lr or 1e-3)
        return torch.optim.SGD(params, lr=self.lr or 0.01, momentum=0.9)


def images(n: int, size: int | tuple[int, int], classes: int = 10, frames: int | None = None
           ) -> Callable[[torch.Generator], Batch]:
    h, w = (size, size) if isinstance(size, int) else size
    shape = (n, 3, h, w) if frames is None else (n, 3, frames, h, w)

    def make(gen: torch.Generator) -> Batch:
        return {"x": torch.randn(shape, generator=gen), "y": torch.randint(0, classes, (n,), generator=gen)}
    return make


def logits_of(out: Any) -> torch.Tensor:
    """The main output of a classifier: GoogLeNet and Inception v3 return their auxiliary heads' too in training."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["out"]
    return out[0]


def classify(model: nn.Module, batch: Batch) -> torch.Tensor:
    out = model(batch["x"])
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        # GoogLeNet/Inception in training: the auxiliary heads' losses count too (0.3 each, as the papers do)
        aux = [a for a in out[1:] if a is not None]
        return F.cross_entropy(out[0], batch["y"]) + sum(0.3 * F.cross_entropy(a, batch["y"]) for a in aux)
    return F.cross_entropy(logits_of(out), batch["y"])


def segment(model: nn.Module, batch: Batch) -> torch.Tensor:
    out = model(batch["x"])
    loss = F.cross_entropy(out["out"], batch["mask"])
    if out.get("aux") is not None:
        loss = loss + 0.5 * F.cross_entropy(out["aux"], batch["mask"])
    return loss


def segmentation_batch(n: int, size: int, classes: int) -> Callable[[torch.Generator], Batch]:
    def make(gen: torch.Generator) -> Batch:
        return {"x": torch.randn(n, 3, size, size, generator=gen),
                "mask": torch.randint(0, classes, (n, size, size), generator=gen)}
    return make


def detection_batch(n: int, size: int, classes: int, masks: bool = False, keypoints: int = 0
                    ) -> Callable[[torch.Generator], Batch]:
    def make(gen: torch.Generator) -> Batch:
        imgs, targets = [], []
        for _ in range(n):
            imgs.append(torch.rand(3, size, size, generator=gen))
            xy = torch.rand(2, 2, generator=gen) * (size / 2)
            boxes = torch.cat([xy, xy + size / 4 + torch.rand(2, 2, generator=gen) * (size / 4)], dim=1)
            t = {"boxes": boxes, "labels": torch.randint(1, classes, (2,), generator=gen)}
            if masks:
                m = torch.zeros(2, size, size, dtype=torch.uint8)
                for i, b in enumerate(boxes.long()):
                    m[i, b[1]:b[3], b[0]:b[2]] = 1
                t["masks"] = m
            if keypoints:
                kx = boxes[:, :1] + (boxes[:, 2:3] - boxes[:, :1]) * torch.rand(2, keypoints, generator=gen)
                ky = boxes[:, 1:2] + (boxes[:, 3:4] - boxes[:, 1:2]) * torch.rand(2, keypoints, generator=gen)
                t["keypoints"] = torch.stack([kx, ky, torch.ones(2, keypoints)], dim=2)
            targets.append(t)
        return {"images": imgs, "targets": targets}
    return make


def detect(model: nn.Module, batch: Batch) -> torch.Tensor:
    losses = model(batch["images"], batch["targets"])
    return sum(losses.values())


def flow_batch(n: int, size: int) -> Callable[[torch.Generator], Batch]:
    def make(gen: torch.Generator) -> Batch:
        return {"a": torch.randn(n, 3, size, size, generator=gen), "b": torch.randn(n, 3, size, size, generator=gen),
                "flow": torch.randn(n, 2, size, size, generator=gen)}
    return make


def flow_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    flows = model(batch["a"], batch["b"], num_flow_updates=2)
    # RAFT's sequence loss: later refinements weigh more
    return sum(0.8 ** (len(flows) - i - 1) * (f - batch["flow"]).abs().mean() for i, f in enumerate(flows))


# ----------------------------------------------------------------------------------------------- torchvision
# the smallest inputs each architecture takes (its downsampling, windows and pools), batch 2 unless said
_TV_SIZE = {"squeezenet1_0": 128, "squeezenet1_1": 128, "inception_v3": 75, "quantized_inception_v3": 75,
            "maxvit_t": 224, "vit_b_16": 32, "vit_l_16": 32,
            "vit_b_32": 64, "vit_l_32": 64, "vit_h_14": 28}
_TV_ADAM = ("vit_", "swin", "maxvit", "mvit")


def _tv_kwargs(name: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"weights": None}
    if name.startswith("vit_"):
        kwargs["image_size"] = _TV_SIZE[name]
    if name.startswith("quantized_"):
        kwargs["quantize"] = False           # the float model, as quantization-aware training starts from
    if "googlenet" in name or "inception" in name:
        kwargs["init_weights"] = True
    if "inception" in name:
        kwargs["aux_logits"] = False         # its auxiliary head needs 299 x 299 inputs: GoogLeNet trains one
    return kwargs


def torchvision_models() -> list[ZooModel]:
    """Every model constructor ``torchvision.models.list_models()`` names, at the smallest input it takes."""
    import torchvision
    from torchvision import models as tvm

    def get(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
        return lambda: torchvision.models.get_model(name, **{**_tv_kwargs(name), **kwargs})

    detection = set(tvm.list_models(tvm.detection))
    segmentation = set(tvm.list_models(tvm.segmentation))
    video = set(tvm.list_models(tvm.video))
    flow = set(tvm.list_models(tvm.optical_flow))
    zoo: list[ZooModel] = []
    for name in tvm.list_models():
        adam = name.startswith(_TV_ADAM) or name.startswith("swin3d")
        if name in detection:
            fixed = name.startswith("ssd")            # SSD resizes to its own 300 or 320
            kwargs: dict[str, Any] = {"weights_backbone": None, "num_classes": 3}
            if not fixed:
                kwargs.update(min_size=96, max_size=96)
            if "rcnn" in name:              # fewer proposals and sampled boxes: the same code paths, less work
                kwargs.update(rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=100, rpn_batch_size_per_image=64,
                              box_batch_size_per_image=32)
            if name.startswith("keypointrcnn"):
                kwargs.update(num_classes=2, num_keypoints=4)
            zoo.append(ZooModel(name, get(name, **kwargs),
                                detection_batch(2, 96, kwargs["num_classes"], masks=name.startswith("maskrcnn"),
                                                keypoints=4 if name.startswith("keypointrcnn") else 0), detect,
                                lr=1e-3 if name == "ssd300_vgg16" else None))   # VGG without BatchNorm
        elif name in segmentation:
            aux = {} if name.startswith("lraspp") else {"aux_loss": True}
            zoo.append(ZooModel(name, get(name, weights_backbone=None, num_classes=3, **aux),
                                segmentation_batch(2, 64, 3), segment))
        elif name in video:
            if name == "s3d":
                kwargs, batch = {"num_classes": 10}, images(1, 224, frames=14)
            elif name.startswith("mvit"):              # built for 16 frames of 224 x 224
                kwargs, batch = {"num_classes": 10}, images(1, 224, frames=16)
            else:
                kwargs, batch = {"num_classes": 10}, images(2, 32, frames=4)
            zoo.append(ZooModel(name, get(name, **kwargs), batch, classify, adam=adam))
        elif name in flow:
            zoo.append(ZooModel(name, get(name), flow_batch(1, 128), flow_loss, adam=True))
        else:
            zoo.append(ZooModel(name, get(name, num_classes=10), images(2, _TV_SIZE.get(name, 64)), classify,
                                adam=adam))
    return zoo


# ----------------------------------------------------------------------------------------------------- timm
# timm's own test models (tiny versions of its architecture families) and the smallest real model of more families
TIMM_NAMES = (
    "test_byobnet", "test_coatnet", "test_convnext", "test_convnext2", "test_convnext3", "test_efficientnet",
    "test_efficientnet_evos", "test_efficientnet_gn", "test_efficientnet_ln", "test_mambaout", "test_maxvit",
    "test_nfnet", "test_resnet", "test_vit", "test_vit2", "test_vit3", "test_vit4", "test_vit_relpos",
    "resnet18d", "resnet26t", "efficientnet_b0", "mobilenetv3_small_050", "mobilenetv4_conv_small", "convnext_atto",
    "regnety_002", "regnetx_002", "ghostnet_050", "rexnet_100", "lcnet_050", "tinynet_e", "mnasnet_small",
    "vit_tiny_patch16_224", "deit_tiny_patch16_224", "levit_128s", "poolformer_s12", "efficientformer_l1",
    "mobilevit_xxs", "dla34", "hrnet_w18_small", "edgenext_xx_small", "fastvit_t8", "repvit_m1", "densenet121",
    "cspresnet50", "xception41", "eva02_tiny_patch14_224", "swin_tiny_patch4_window7_224", "mixer_s32_224",
    "resmlp_12_224", "inception_v3", "dpn48b", "selecsls42b", "vovnet39a", "tresnet_m",
)
_TIMM_TRANSFORMERS = ("test_vit", "vit_", "deit_", "levit", "eva02", "swin", "mixer", "resmlp", "poolformer",
                      "efficientformer", "mobilevit", "fastvit", "edgenext", "test_coatnet", "test_maxvit",
                      "test_mambaout")


def timm_models(names: tuple[str, ...] = TIMM_NAMES) -> list[ZooModel]:
    """Each named timm model at its own default input size, or 64 x 64 where it takes any (batch 2)."""
    import timm

    zoo = []
    for name in names:
        size = timm.get_pretrained_cfg(name).input_size[-1] if name.startswith("test_") else None
        fixed = any(name.startswith(p) for p in ("vit_", "deit_", "levit", "eva02", "swin", "mixer", "resmlp",
                                                 "efficientformer", "fastvit", "inception", "xception",
                                                 "tresnet"))
        if size is None:
            size = 224 if fixed else 64

        def build(name: str = name) -> nn.Module:
            return timm.create_model(name, pretrained=False, num_classes=10)
        zoo.append(ZooModel(f"timm/{name}", build, images(2, size), classify,
                            adam=name.startswith(_TIMM_TRANSFORMERS)))
    return zoo


# -------------------------------------------------------------------- transformers, diffusers and peft
def _tokens(vocab: int = 100, seq: int = 12, labels: bool = True) -> Callable[[torch.Generator], Batch]:
    def make(gen: torch.Generator) -> Batch:
        ids = torch.randint(1, vocab, (2, seq), generator=gen)
        return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}
    return make


def _hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def transformers_models() -> list[ZooModel]:
    """The transformers families of ``tests/probes/hf_families.py`` and more, from small configs."""
    import hf_families
    import transformers as tf

    zoo = []
    for family in hf_families.FAMILIES:
        def build(family: str = family) -> nn.Module:
            return hf_families.build(family)
        if family == "t5":
            def t5_batch(gen: torch.Generator) -> Batch:
                return {"input_ids": torch.randint(1, 100, (2, 12), generator=gen),
                        "labels": torch.randint(1, 100, (2, 6), generator=gen)}
            zoo.append(ZooModel(f"transformers/{family}", build, t5_batch, _hf_loss, adam=True))
        else:
            zoo.append(ZooModel(f"transformers/{family}", build, _tokens(), _hf_loss, adam=True))

    def vit() -> nn.Module:
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=10))

    def vit_batch(gen: torch.Generator) -> Batch:
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen),
                "labels": torch.randint(0, 10, (2,), generator=gen)}

    def bart() -> nn.Module:
        return tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))

    def roberta() -> nn.Module:
        return tf.RobertaForSequenceClassification(tf.RobertaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, num_labels=3))

    def roberta_batch(gen: torch.Generator) -> Batch:
        return {"input_ids": torch.randint(3, 100, (2, 12), generator=gen),
                "labels": torch.randint(0, 3, (2,), generator=gen)}

    zoo += [ZooModel("transformers/vit", vit, vit_batch, _hf_loss, adam=True),
            ZooModel("transformers/bart", bart, _tokens(), _hf_loss, adam=True),
            ZooModel("transformers/roberta", roberta, roberta_batch, _hf_loss, adam=True)]
    return zoo


def _denoise(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The denoising objective: predict the noise added to the sample at a timestep."""
    kwargs = {k: batch[k] for k in ("encoder_hidden_states",) if k in batch}
    out = model(batch["noisy"], batch["t"], **kwargs).sample
    return F.mse_loss(out, batch["noise"])


def _latents(channels: int, size: int, context: int | None = None) -> Callable[[torch.Generator], Batch]:
    def make(gen: torch.Generator) -> Batch:
        b: Batch = {"noisy": torch.randn(2, channels, size, size, generator=gen),
                    "noise": torch.randn(2, channels, size, size, generator=gen),
                    "t": torch.randint(0, 1000, (2,), generator=gen)}
        if context:
            b["encoder_hidden_states"] = torch.randn(2, 4, context, generator=gen)
        return b
    return make


class ControlledUNet(nn.Module):
    """ControlNet training as diffusers' train_controlnet.py does it: the UNet frozen, the ControlNet (its zero
    convolutions included) trained, its residuals added into the UNet."""

    def __init__(self) -> None:
        super().__init__()
        import diffusers
        kwargs = dict(block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                      cross_attention_dim=16, layers_per_block=1, attention_head_dim=8, norm_num_groups=8,
                      in_channels=4)
        self.unet = diffusers.UNet2DConditionModel(
            **kwargs, out_channels=4, up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), sample_size=16)
        self.unet.requires_grad_(False)
        self.controlnet = diffusers.ControlNetModel(**kwargs, conditioning_embedding_out_channels=(8, 16))

    def forward(self, noisy, t, encoder_hidden_states, cond):
        down, mid = self.controlnet(noisy, t, encoder_hidden_states=encoder_hidden_states,
                                    controlnet_cond=cond, return_dict=False)
        return self.unet(noisy, t, encoder_hidden_states=encoder_hidden_states,
                         down_block_additional_residuals=down, mid_block_additional_residual=mid)


def _controlnet_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    out = model(batch["noisy"], batch["t"], batch["encoder_hidden_states"], batch["cond"]).sample
    return F.mse_loss(out, batch["noise"])


def diffusers_models() -> list[ZooModel]:
    import diffusers

    def unet2d() -> nn.Module:
        return diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                     block_out_channels=(32, 64), norm_num_groups=8,
                                     down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                     up_block_types=("AttnUpBlock2D", "UpBlock2D"))

    def unet_conditional() -> nn.Module:
        return diffusers.UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8)

    def vae() -> nn.Module:
        return diffusers.AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64), latent_channels=4,
                                       down_block_types=("DownEncoderBlock2D",) * 2,
                                       up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8)

    def vae_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        posterior = model.encode(batch["x"]).latent_dist
        recon = model.decode(posterior.sample(generator=None)).sample
        return F.mse_loss(recon, batch["x"]) + 1e-6 * posterior.kl().mean()

    def controlnet_batch(gen: torch.Generator) -> Batch:
        b = _latents(4, 16, 16)(gen)
        b["cond"] = torch.rand(2, 3, 32, 32, generator=gen)     # its embedding halves it to the latents
        return b

    return [ZooModel("diffusers/unet2d", unet2d, _latents(3, 16), _denoise, adam=True),
            ZooModel("diffusers/unet2d-conditional", unet_conditional, _latents(4, 16, 16), _denoise, adam=True),
            ZooModel("diffusers/autoencoder-kl", vae, images(2, 32), vae_loss, adam=True),
            ZooModel("diffusers/controlnet", ControlledUNet, controlnet_batch, _controlnet_loss, adam=True,
                     lr=1e-5)]


def peft_models() -> list[ZooModel]:
    """LoRA on a causal language model: the base frozen, the adapters trained (B starts at zero)."""
    import hf_families
    import peft

    def lora(family: str) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
            return peft.get_peft_model(hf_families.build(family), config)
        return build
    return [ZooModel(f"peft/lora-{family}", lora(family), _tokens(), _hf_loss, adam=True)
            for family in ("llama", "qwen3_moe")]
