"""``--run`` on a folder of run folders (``runs/`` rather than ``runs/<time>``): ``serve`` and ``findings`` list
the run folders, newest first, with how to pick one, and exit 2. (A path that does not exist yet:
tests/browser/test_browser_serve_missing_run.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import synth_store
from probes import schema

REPO = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def modscope(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashboard.cli", *args], env=env(), cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def folder_of_runs(tmp_path) -> Path:
    parent = tmp_path / "runs"
    for i, name in enumerate(("20250101-090000", "20250102-090000")):
        synth_store.demo(parent / name / schema.store_filename(f"r{i}", 0), steps=4)
        stamp = time.time() - 100 + i * 50                      # the second is the newer
        for f in (parent / name).iterdir():
            os.utime(f, (stamp, stamp))
    (parent / "notes").mkdir()                                  # a folder holding no run is not listed
    return parent


@pytest.mark.parametrize("command", ["serve", "findings"])
def test_a_folder_of_run_folders_lists_them_and_how_to_pick_one(folder_of_runs, command):
    r = modscope(command, "--run", str(folder_of_runs))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    newest, older = folder_of_runs / "20250102-090000", folder_of_runs / "20250101-090000"
    assert lines[0] == (f"modscope: error: --run {folder_of_runs}: a folder of 2 run folders, not a run; pick one "
                        f"(newest first), e.g. modscope {command} --run {newest}")
    assert [line.split("  (")[0].strip() for line in lines[1:]] == [str(newest), str(older)]
    assert all("(1 run, last written " in line for line in lines[1:])
