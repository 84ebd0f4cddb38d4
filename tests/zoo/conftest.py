import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_and_no_leaks():
    """One torch thread per worker (the suite runs two), and no hook left behind by a watch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    gc.collect()
    from torch.nn.modules import module as m
    assert not m._global_forward_hooks, "global forward hook leaked"
    assert not m._global_forward_pre_hooks, "global forward pre-hook leaked"


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"
