import os

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed_and_no_leaks():
    torch.manual_seed(0)
    yield
    # what an integration attaches it detaches: no global module hook may outlive a test
    from torch.nn.modules import module as m
    assert not m._global_forward_hooks, "global forward hook leaked"
    assert not m._global_forward_pre_hooks, "global forward pre-hook leaked"


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"
