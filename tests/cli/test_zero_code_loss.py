"""``modscope run`` records the loss of a script that never calls modscope: the tensor ``backward()`` ran on in
each step, as the script computed it (a plain loop; gradient accumulation, whose steps hold the sum of their
micro-batches' losses; a loss scaled by a GradScaler, stored unscaled; LBFGS, whose closure's first evaluation
counts). Real subprocesses; the script prints its own losses to compare. What ``modscope run`` prints names no
API the script did not call, and the wrapper around ``torch.autograd.backward`` is gone once it closes."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
ADOPTED_AT = 2          # watching starts at an optimizer's third step (the script's step 2)

SCRIPT = '''
import sys
import torch
import torch.nn.functional as F
from torch import nn

mode = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = (torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3) if mode == "lbfgs"
       else torch.optim.SGD(model.parameters(), lr=0.05))
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if mode == "scaler" else None
g = torch.Generator().manual_seed(1)
for step in range(STEPS):
    x = torch.randn(32, 4, generator=g)
    y = x.sum(1, keepdim=True)
    if mode == "lbfgs":
        first = []
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            first.append(loss.item())
            return loss
        opt.step(closure)
        print("LOSS", step, first[0])
        continue
    opt.zero_grad()
    if mode == "accumulate":                  # two micro-batches, each loss halved, then one step
        total = 0.0
        for xb, yb in zip(x.chunk(2), y.chunk(2)):
            loss = F.mse_loss(model(xb), yb) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        print("LOSS", step, total)
        continue
    loss = F.mse_loss(model(x), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    print("LOSS", step, loss.item())
'''.replace("STEPS", str(STEPS))


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def run_zero_code(tmp_path: Path, mode: str) -> tuple[dict[int, float], dict[int, float], str]:
    """(the losses the script printed by its step, the losses stored by watched step, what modscope printed)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "run", "--run-dir", str(run_dir), "--every", "1",
                        str(script), mode], env=env(), cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    printed = {int(s): float(v) for _, s, v in (line.split() for line in r.stdout.splitlines()
                                                 if line.startswith("LOSS"))}
    [db] = run_dir.glob("modscope-*.sqlite")
    con = sqlite3.connect(db)
    try:
        stored = dict(con.execute("SELECT step, loss FROM steps ORDER BY step"))
    finally:
        con.close()
    return printed, stored, r.stderr


@pytest.mark.parametrize("mode", ["plain", "accumulate", "scaler", "lbfgs"])
def test_a_script_that_never_calls_modscope_gets_its_loss_recorded(tmp_path, mode):
    printed, stored, said = run_zero_code(tmp_path, mode)
    assert len(printed) == STEPS and len(stored) == STEPS - ADOPTED_AT
    assert None not in stored.values()
    # watched step k is the script's step k + ADOPTED_AT
    assert [stored[k] for k in sorted(stored)] == \
        pytest.approx([printed[k + ADOPTED_AT] for k in sorted(stored)], rel=1e-5)
    lines = [line for line in said.splitlines() if line.startswith("modscope")]
    assert lines[0] == f"modscope: watching Sequential -> {tmp_path / 'run'}"
    # nothing names an API the script did not call
    assert not [line for line in said.splitlines() if any(api in line for api in (
        "probes.", "w.step", "watcher.step", "watch(", "loss=", "begin_optimizer_step"))], said


def test_the_backward_wrapper_comes_off_at_close(tmp_path):
    from probes.launch import autowatch

    original = torch.autograd.backward, torch.amp.GradScaler.scale
    aw = autowatch.install(tmp_path / "run")
    assert torch.autograd.backward is not original[0]
    aw.close()
    assert (torch.autograd.backward, torch.amp.GradScaler.scale) == original
