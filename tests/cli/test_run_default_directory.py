"""``modscope run`` without ``--run-dir`` makes ``./runs/<time>``, a name anyone can predict: in a folder others can
write to, a link planted at that name, to a folder or to a name that does not exist yet, must neither be taken
for the new run directory nor stop the run."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TRAIN = '''
import torch, torch.nn as nn, torch.nn.functional as F
m = nn.Linear(2, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(4):
    loss = F.mse_loss(m(torch.randn(8, 2)), torch.zeros(8, 1)); opt.zero_grad(); loss.backward(); opt.step()
'''


def test_a_link_at_the_predictable_run_directory_is_not_used(tmp_path):
    work, elsewhere = tmp_path / "shared", tmp_path / "victim"
    (work / "runs").mkdir(parents=True)
    elsewhere.mkdir()
    (work / "train.py").write_text(TRAIN)
    now = datetime.datetime.now()
    planted = []
    for s in range(0, 90):          # every name the next minute and a half could give
        stamp = (now + datetime.timedelta(seconds=s)).strftime("%Y%m%d-%H%M%S")
        link = work / "runs" / stamp
        # a link to a folder that exists, or to one that does not yet (a race would create it)
        link.symlink_to(elsewhere if s % 2 else elsewhere / stamp, target_is_directory=True)
        planted.append(link)
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "run", "--every", "1", "train.py"], cwd=str(work),
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert list(elsewhere.iterdir()) == []                          # nothing written through a link
    assert all(link.is_symlink() for link in planted)              # and none removed
    made = [d for d in (work / "runs").iterdir() if not d.is_symlink()]
    assert len(made) == 1 and list(made[0].glob("modscope-*-rank0.sqlite")), r.stderr
    assert f"-> {Path('runs') / made[0].name}" in r.stderr
