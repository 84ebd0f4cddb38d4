"""``modscope serve --run DIR`` on a path that does not exist says so once ("waiting for a run in DIR: it does not
exist yet") and follows the run when a real training writes it, read in Chromium."""

from __future__ import annotations

import subprocess
import sys

import pytest
from browser_helpers import REPO, wait_text

pytestmark = pytest.mark.browser


def test_serve_on_a_missing_run_says_so_once_then_follows_the_run(page, server_factory, tmp_path):
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
