import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_no_leaks():
    torch.manual_seed(0)
    yield
    gc.collect()
    # a test must never leave a global module hook behind
    from torch.nn.modules import module as m
    assert not m._global_forward_hooks, "global forward hook leaked"
    assert not m._global_forward_pre_hooks, "global forward pre-hook leaked"


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"

