"""One activation module called twice a step, as torchvision's BasicBlock calls ``self.relu`` after bn1 and again
after the residual add: its calls are two layers and are judged apart. A dead first call was missed (its units were
active in the second call, and the two were merged) and the conv after it was reported as the root cause instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes

# torchvision's own block (tests/run.sh installs the torchvision built for your torch)
BasicBlock = pytest.importorskip("torchvision.models.resnet").BasicBlock


class Net(nn.Module):
    def __init__(self, dead: str | None = None) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.block = BasicBlock(16, 16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)
        if dead is not None:                    # its BatchNorm's bias far below zero: the ReLU after it is dead
            with torch.no_grad():
                getattr(self.block, dead).bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.block(self.stem(x))), 1))


def dead(run_dir, dead_bn: str | None, every: int | None) -> dict:
    torch.manual_seed(0)
    model = Net(dead_bn)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        for _ in range(4):
            x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return {f.path: f for f in w.findings() if f.code in ("dead-layer", "dead-units")}


@pytest.mark.parametrize("every", [1, None])
def test_a_dead_first_call_of_a_shared_relu_is_found_and_is_the_cause(run_dir, every):
    found = dead(run_dir, "bn1", every)
    assert set(found) == {"block.relu", "block.conv2"}, [str(f) for f in found.values()]
    relu = found["block.relu"]
    assert relu.code == "dead-layer" and relu.cause is None
    assert "in the first of its 2 calls a step" in relu.message
    assert (relu.evidence["call"], relu.evidence["calls"]) == (1, 2)
    # the conv after the dead call only passes it on: a consequence, whose cause is the ReLU
    assert found["block.conv2"].cause == ("dead-layer", "block.relu")
    assert found["block.conv2"].evidence["dead_input"] == "block.relu"


def test_a_dead_second_call_is_named_and_the_block_returning_it_is_not_reported_again(run_dir):
    """The ReLU after the residual add is dead (bn2's bias -100 outweighs the identity): the second call; the block
    returning its very output is a wrapper of that call, and the pooling after it a consequence."""
    found = dead(run_dir, "bn2", 1)
    assert set(found) == {"block.relu", "pool"}, [str(f) for f in found.values()]
    assert "in the second of its 2 calls a step" in found["block.relu"].message
    assert found["pool"].cause == ("dead-layer", "block.relu")


def test_a_healthy_basic_block_is_quiet(run_dir):
    assert dead(run_dir, None, 1) == {}
