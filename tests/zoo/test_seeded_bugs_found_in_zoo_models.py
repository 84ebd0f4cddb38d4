"""Seeded bugs in zoo models are found at the right path: a dead first call of torchvision ResNet's shared ReLU, a
timm classifier reset after the optimizer was built, and LoRA adapters added after the optimizer was built."""
import pytest
import torch
import zoo_harness as harness
import zoo_models as models
from torch import nn

import probes


def watched_findings(model: nn.Module, opt: torch.optim.Optimizer, batch, loss, run_dir, steps: int = 3):
    gen = torch.Generator().manual_seed(1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            value = loss(model, batch(gen))
            opt.zero_grad()
            value.backward()
            opt.step()
            w.step(value)
        assert not w.probe_errors, w.probe_errors
        return {(f.code, f.path): f for f in w.findings()}


def test_a_dead_first_call_of_resnets_shared_relu(run_dir):
    """torchvision's BasicBlock calls one nn.ReLU twice: after bn1 and after the residual add."""
    tv = harness.require("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=10)
    with torch.no_grad():
        model.layer1[0].bn1.bias.fill_(-100.0)          # every unit of the first call stays at zero
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    found = watched_findings(model, opt, models.images(2, 64), models.classify, run_dir)
    dead = found[("dead-layer", "layer1.0.relu")]
    assert dead.severity == "error" and (dead.evidence["call"], dead.evidence["calls"]) == (1, 2), dead
    assert "first of its 2 calls" in dead.message
    # what follows from it names it as the cause, and is no root cause of its own
    assert all(f.cause == ("dead-layer", "layer1.0.relu") for (code, path), f in found.items()
               if code == "dead-layer" and path != "layer1.0.relu"), sorted(found)


def test_a_timm_classifier_reset_after_the_optimizer_was_built(run_dir):
    timm = harness.require("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18d", pretrained=False, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.reset_classifier(5)                          # a new head the optimizer never sees
    found = watched_findings(model, opt, models.images(2, 64, classes=5), models.classify, run_dir)
    assert found[("not-in-optimizer", "fc.weight")].severity == "error"
    assert found[("not-in-optimizer", "fc.bias")].severity == "error"
    # the old head's tensors, still in the optimizer
    assert sorted(f.evidence["shape"] for (code, _), f in found.items() if code == "stale-optimizer-param") \
        == [[10], [10, 512]]


def test_lora_adapters_added_after_the_optimizer_was_built(run_dir):
    peft = harness.require("peft")
    harness.require("transformers")
    import hf_families
    torch.manual_seed(0)
    base = hf_families.build("llama")
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)     # the base model's parameters, before the adapters
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    found = watched_findings(model, opt, models._tokens(), models._hf_loss, run_dir)
    lora = {path for code, path in found if code == "not-in-optimizer"}
    layers = len(base.model.layers)
    assert lora == {f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_{ab}.default.weight"
                    for i in range(layers) for proj in ("q_proj", "v_proj") for ab in "AB"}, sorted(found)
    assert all(found[("not-in-optimizer", p)].severity == "error" for p in lora)


@pytest.mark.parametrize("name", ["resnet18"])
def test_the_same_models_unseeded_train_clean(name, run_dir):
    """The models the bugs are seeded in give no finding without them."""
    harness.assert_trains_clean(next(zm for zm in models.torchvision_models() if zm.name == name), run_dir)
