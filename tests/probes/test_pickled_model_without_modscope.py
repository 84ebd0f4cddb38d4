"""A model saved whole while it is watched (``torch.save(model)``, between steps and inside a sampled step) loads in
a fresh process where modscope cannot be imported: nothing of modscope is in the pickle (its hooks are left out of
the module's hook dicts), and the loaded model computes what the watched one did. Watching leaves no trace in
pickling either: after ``close()`` no class of the model is in copyreg's table."""

from __future__ import annotations

import copyreg
import os
import pickletools
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

import probes

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.body(x))
'''

# modscope cannot be imported here: its packages are blocked, as on a machine where it is not installed
LOAD = '''
import sys
sys.modules["probes"] = None
sys.modules["dashboard"] = None
import torch
for path in sys.argv[2:]:
    model = torch.load(path, weights_only=False)
    model.eval()
    hooks = [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    out = model(torch.load(sys.argv[1]))
    print(path.rsplit("/", 1)[-1], len(hooks), repr(out.sum().item()), flush=True)
'''


def globals_in(path: Path) -> set[str]:
    """The module names a pickle imports (GLOBAL / STACK_GLOBAL opcodes)."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            found.add(arg.split(" ")[0])
        elif op.name == "STACK_GLOBAL":
            found.add(strings[-2])
    return found


def test_a_model_saved_while_watched_loads_without_modscope(tmp_path, monkeypatch):
    (tmp_path / "netdef.py").write_text(textwrap.dedent(MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    from netdef import Net

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    torch.save(x, tmp_path / "x.pt")
    saved = []
    with probes.watch(model, opt, run_dir=tmp_path / "run", every=1) as w:
        for i in range(4):
            loss = F.cross_entropy(model(x), y)
            if i == 2:          # inside a sampled step: the step's hooks are on the model too
                torch.save(model, tmp_path / "inside.pt")
                saved.append("inside.pt")
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        torch.save(model, tmp_path / "between.pt")
        saved.append("between.pt")
        assert model._forward_hooks and model._forward_pre_hooks      # still watched: the hooks are there
    for name in saved:
        assert not {m for m in globals_in(tmp_path / name) if m.split(".")[0] in ("probes", "dashboard")}
    model.eval()
    with torch.no_grad():
        expected = repr(model(x).sum().item())

    r = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "x.pt"), *(str(tmp_path / n) for n in saved)],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, check=False)
    assert r.returncode == 0, r.stderr
    loaded = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
    assert loaded["between.pt"] == ["0", expected]              # no hook, the same output as the watched model's
    assert loaded["inside.pt"][0] == "0"
    # what watching changed in pickling is undone by close()
    assert type(model) not in copyreg.dispatch_table and torch.nn.Sequential not in copyreg.dispatch_table
