"""timm's test models (one tiny model of each architecture family) and the smallest real model of more families
train a few steps watched with every step sampled: no crash, no probe error, no error- or warning-level finding,
and losses bit-identical to the unwatched run."""
import pytest
import zoo_harness as harness
import zoo_models as models

harness.require("timm")
ZOO = {zm.name: zm for zm in models.timm_models()}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_trains_clean(name, run_dir):
    harness.assert_trains_clean(ZOO[name], run_dir)
