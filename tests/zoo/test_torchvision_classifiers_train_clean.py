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
