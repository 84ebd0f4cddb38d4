"""``w.findings()`` in a notebook: a list still, shown as its root causes, each with its fix and the
findings it explains, not as a wall of dataclass reprs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import probes
from probes import schema


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [nn.Linear(8, 8) for _ in range(2)]      # the bug: a plain list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


class Pretty:
    def __init__(self) -> None:
        self.out = ""

    def text(self, s: str) -> None:
        self.out += s


def test_findings_show_root_causes_with_what_they_explain(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Encoder(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(4):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        found = w.findings()
    assert isinstance(found, list) and all(isinstance(f, probes.Finding) for f in found)
    codes = {f.code for f in found}
    assert {"unregistered-module", "not-updating", "grad-accumulating"} <= codes
    roots = [f for f in found if f.cause is None]
    assert {f.path for f in roots if f.code == "unregistered-module"} == {"1.blocks"}       # one list, one cause
    n = len(roots)

    p = Pretty()
    found._repr_pretty_(p, False)
    lines = p.out.splitlines()
    # root causes first, then their consequences: as the dashboard and `modscope findings` count them
    errors, warnings = (sum(f.severity == s for f in roots) for s in ("error", "warning"))
    assert lines[0] == schema.count_text({"error": errors, "warning": warnings}, len(found) - n)
    assert lines[0].startswith(f"{n} root causes (") and lines[0].endswith(f" and {len(found) - n} consequences")
    i = lines.index(next(line for line in lines if line.startswith("[error] unregistered-module at 1.blocks: ")))
    assert "are held in the plain Python list 1.blocks (1.blocks[0], 1.blocks[1])" in lines[i]
    assert lines[i + 1].startswith("    fix: Hold sub-modules in nn.ModuleList")
    assert "    explains [error] not-updating at 1.blocks[0].weight" in lines[i + 2:]
    assert "    explains [warning] grad-accumulating at 1.blocks[0].weight" in lines[i + 2:]
    assert sum(line.startswith("[") for line in lines) == n          # consequences only under their cause
    assert "Finding(" not in p.out and "evidence" not in p.out

    page = found._repr_html_()
    assert page.count("<tr>") == 1 + n             # the head row and one per root cause
    assert "<code>not-updating</code> at <code>1.blocks[1].bias</code>" in page
