"""``--run PATH`` when PATH is not a run yet, or not a run at all:

* ``modscope serve --run DIR`` on a path that does not exist says so once ("waiting for a run in DIR: it does
  not exist yet") and follows the run when a training writes it (a real training, read in Chromium);
* on a folder of run folders (``runs/`` rather than ``runs/<time>``), ``serve`` and ``findings`` list the run
  folders, newest first, with how to pick one, and exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from browser_helpers import browser, download_dir, page, server_factory  # noqa: F401 (the browser fixtures)

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


@pytest.mark.browser
def test_serve_on_a_missing_run_says_so_once_then_follows_the_run(page, server_factory, tmp_path):
    from browser_helpers import wait_text

    run_dir = tmp_path / "not-yet" / "exp1"
    srv = server_factory(["serve", "--run", str(run_dir)])
    page.get(srv.url)
    wait_text(page, "waiting for the first sample", "#run-status")
    subprocess.run([sys.executable, str(REPO / "examples" / "demo_train.py"), "--run-dir", str(run_dir),
                    "--steps", "12", "--every", "1"], check=True, cwd=str(REPO), stdout=subprocess.DEVNULL,
                   timeout=300)
    wait_text(page, "3 unregistered", "#ov-cards")
    wait_text(page, "step 11", "#run-status")
    said = [line for line in srv.output().splitlines() if "waiting for a run" in line]
    assert said == [f"modscope: waiting for a run in {run_dir}: it does not exist yet"]
