"""A leaf module whose weights the module around it reads itself (torchvision's Swin attention passes
``self.qkv.weight`` to ``F.linear``) is an info; a block whose ``.forward()`` is called directly stays a warning."""
import torch
import torch.nn.functional as F
from torch import nn

import probes


class FunctionalAttention(nn.Module):
    """As torchvision's ShiftedWindowAttention: the projections' weights go to a function, never through __call__."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        return F.linear(att, self.proj.weight, self.proj.bias)


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.gain


class Model(nn.Module):
    def __init__(self, bypass_block: bool) -> None:
        super().__init__()
        self.attn = FunctionalAttention()
        self.block = Block()
        self.head = nn.Linear(8, 2)
        self.bypass_block = bypass_block

    def forward(self, x):
        x = self.attn(x)
        x = self.block.forward(x) if self.bypass_block else self.block(x)
        return self.head(x.mean(1))


def bypass_findings(bypass_block: bool, run_dir):
    model = Model(bypass_block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(3):
            loss = F.cross_entropy(model(torch.randn(4, 5, 8)), torch.randint(0, 2, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return {f.path: f for f in w.findings() if f.code == "forward-bypassed"}


def test_weights_read_by_the_module_around_them_are_an_info(run_dir):
    found = bypass_findings(False, run_dir)
    assert set(found) == {"attn.qkv", "attn.proj"}
    assert {f.severity for f in found.values()} == {"info"}
    assert found["attn.qkv"].evidence["by_design"] == "read-by-parent"
    assert "the module around it was called" in found["attn.qkv"].message


def test_a_block_whose_forward_is_called_directly_stays_a_warning(tmp_path):
    found = bypass_findings(True, tmp_path / "run")
    assert found["block"].severity == "warning"
    assert found["block"].evidence["forward_called"] is True
