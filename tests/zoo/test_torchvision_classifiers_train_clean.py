"""Every image classifier constructor of torchvision.models (quantizable ones as float models) trains a few steps
watched with every step sampled: no crash, no probe error, no error- or warning-level finding, and losses
bit-identical to the unwatched run."""
import pytest
import zoo_harness as harness
import zoo_models as models

tv = harness.require("torchvision")
DENSE = set().union(*(tv.models.list_models(getattr(tv.models, m))
                      for m in ("detection", "segmentation", "video", "optical_flow")))
ZOO = {zm.name: zm for zm in models.torchvision_models() if zm.name not in DENSE}


def test_every_classifier_constructor_is_here():
    assert len(ZOO) == len(tv.models.list_models()) - len(DENSE) > 80


@pytest.mark.parametrize("name", sorted(ZOO))
def test_trains_clean(name, run_dir):
    harness.assert_trains_clean(ZOO[name], run_dir)


@pytest.mark.parametrize("name", sorted(harness.TRUE_AT_INIT))
def test_the_findings_true_at_init_are_true(name):
    """The units the zoo expects dead never activate over 64 random images at initialisation."""
    import torch
    torch.manual_seed(0)
    model = tv.models.get_model(name, num_classes=10)
    outputs = {}
    for _code, path in harness.TRUE_AT_INIT[name]:
        model.get_submodule(path).register_forward_hook(lambda m, i, o, path=path: outputs.__setitem__(path, o))
    with torch.no_grad():
        model(torch.randn(64, 3, 128, 128))
    for path, out in outputs.items():
        assert (out.amax(dim=(0, 2, 3)) == 0).float().mean() >= 0.25, path
