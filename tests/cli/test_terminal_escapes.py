"""Names printed to a terminal have their control characters escaped: a module attribute, a class or a run
directory named with an escape sequence (ESC ] 0 ; ... BEL retitles a terminal, ESC [ 2 J clears it) reaches
``modscope run``'s lines, ``modscope findings`` and the CLI's error lines as ``\\x1b...``, never raw. Real
processes; the store is written by the real writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ESC = "\x1b"

SCRIPT = r'''
import torch, torch.nn as nn, torch.nn.functional as F

def init(self):
    nn.Module.__init__(self)
    self.stem = nn.Linear(2, 8)
    setattr(self, "blocks\x1b]0;pwned\x07", [nn.Linear(8, 8)])      # a plain list: unregistered
    self.head = nn.Linear(8, 1)

def forward(self, x):
    x = torch.relu(self.stem(x))
    for block in getattr(self, "blocks\x1b]0;pwned\x07"):
        x = torch.relu(block(x))
    return self.head(x)

Model = type("Evil\x1b[2JNet", (nn.Module,), {"__init__": init, "forward": forward})
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(6):
    loss = F.mse_loss(model(torch.randn(16, 2)), torch.zeros(16, 1))
    opt.zero_grad(); loss.backward(); opt.step()
'''


def modscope(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashboard.cli", *args], cwd=str(cwd), capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)


def test_control_characters_are_escaped_in_every_line_modscope_prints(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    run_dir = f"runs/{ESC}[31mred"
    r = modscope("run", "--run-dir", run_dir, "--every", "1", "train.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ESC not in r.stderr and ESC not in r.stdout
    assert "modscope: watching Evil\\x1b[2JNet -> runs/\\x1b[31mred" in r.stderr
    assert "modscope: Evil\\x1b[2JNet: 1 root cause (1 error)" in r.stderr

    found = modscope("findings", "--run", run_dir, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert ESC not in found.stdout and "\x07" not in found.stdout
    assert "unregistered-module  blocks\\x1b]0;pwned\\x07[0]" in found.stdout
    assert "runs/\\x1b[31mred: 1 root cause (1 error)" in found.stdout

    as_json = modscope("findings", "--run", run_dir, "--json", cwd=tmp_path)    # JSON escapes them itself
    assert ESC not in as_json.stdout
    assert any(f["path"] == "blocks\x1b]0;pwned\x07[0]" for f in json.loads(as_json.stdout))


def test_error_lines_escape_what_the_user_typed(tmp_path):
    r = modscope("findings", "--run", f"nothere{ESC}[2J", cwd=tmp_path)
    assert r.returncode == 2 and ESC not in r.stderr
    assert r.stderr.strip() == "modscope: error: --run nothere\\x1b[2J: no such file or directory"
    r = modscope("findings", "--run", "x", "--fail-on", f"{ESC}[2J", cwd=tmp_path)
    assert r.returncode == 2 and ESC not in r.stderr and "invalid choice: '\\x1b[2J'" in r.stderr


def test_a_finding_prints_escaped(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from probes.findings.finding import make
        print(make("unregistered-module", "blocks\\x1b[2J[0]", "held in a plain list\\x07"))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[error] unregistered-module at blocks\\x1b[2J[0]: held in a plain list\\x07"
