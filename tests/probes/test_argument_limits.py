"""``probes.watch``'s arguments have documented limits (docs/usage.md, docs/security.md): beyond them a ValueError
names the limit, at the call, before anything is attached or written (a 10 MB ``run_name``, ``window=10**9``,
``every=10**7``). The same limits hold for the framework callbacks, ``modscope run``'s options and ``show()``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import probes
from probes.limits import MAX_EVERY, MAX_RUN_NAME, MAX_WINDOW

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(run_name="x" * 10_000_000), "run_name must be at most 200 characters, got 10,000,000"),
    (dict(run_name="run\x1b[2J"), "run_name must be printable (no control characters or line breaks)"),
    (dict(run_name="two\nlines"), "run_name must be printable"),
    (dict(window=10**9), "window must be an int from 1 to 256 (sampled steps), got 1000000000"),
    (dict(window=0), "window must be an int from 1 to 256"),
    (dict(every=10**7), "every must be None or an int from 1 to 1,000,000 (sample every N-th step), got 10000000"),
    (dict(overhead=float("nan")), "overhead must be a fraction in (0, 1]"),
    (dict(overhead=1e9), "overhead must be a fraction in (0, 1]"),
])
def test_arguments_beyond_their_limits_are_refused_at_the_call(tmp_path, kwargs, needle):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as exc:
        probes.watch(model, opt, run_dir=tmp_path / "run", **kwargs)
    assert needle in str(exc.value) and len(str(exc.value)) < 200
    assert not model._forward_hooks and not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_limits_themselves_are_accepted(tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path / "run", every=MAX_EVERY, window=MAX_WINDOW,
                      run_name="r" * MAX_RUN_NAME) as w:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
    assert w.probe_errors == {}


def test_the_callbacks_check_the_same_limits():
    from probes.integrations import WatchOptions
    with pytest.raises(ValueError, match="window must be an int from 1 to 256"):
        WatchOptions(window=10**9)
    with pytest.raises(ValueError, match="run_name must be at most 200 characters"):
        WatchOptions(run_name="y" * 201)


def test_show_refuses_an_absurd_height():
    with pytest.raises(ValueError, match="height must be an int from 100 to 10,000"):
        probes.show("runs", height=10**9)


def test_modscope_run_refuses_every_beyond_its_limit(tmp_path):
    (tmp_path / "x.py").write_text("")
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "run", "--every", "10000000", "x.py"],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
    assert r.returncode == 2 and r.stderr.strip() == ("modscope run: error: argument --every: '10000000': expected "
                                                      "an integer from 1 to 1,000,000 (sample every N-th step)")
