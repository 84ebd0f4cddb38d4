"""A run stopped with Ctrl-C (SIGINT) while a real Chromium page reads it leaves its data in the main store file:
the write-ahead log is empty (or gone) and the main file alone holds every row, closed.

* ``python app.py`` (the demo: the dashboard starts examples/demo_train.py and stops it with a SIGINT of its
  own when it gets one), with the Overview open;
* ``examples/demo_train.py`` run on its own, stopped with SIGINT, while ``python app.py serve --run DIR`` goes
  on serving it and the page goes on polling.
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from browser_helpers import REPO, demo_available, wait_for, wait_text
from selenium.webdriver.common.by import By

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not demo_available(), reason="needs torch, probes and examples/demo_train.py")]


def header_step(driver) -> int:
    parts = driver.find_element(By.ID, "run-status").text.split()      # "step 12 · running"
    return int(parts[1]) if len(parts) > 1 and parts[0] == "step" and parts[1].isdigit() else -1


def count(uri: str, sql: str) -> object:
    con = sqlite3.connect(uri, uri=True)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


def assert_main_file_holds_the_run(store: Path, tmp: Path) -> int:
    """The -wal is empty or gone, and the main file copied alone holds every step and the closed rank."""
    wal = Path(str(store) + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0, f"{wal}: {wal.stat().st_size} bytes left in the log"
    alone = tmp / "main-file-alone.sqlite"
    shutil.copyfile(store, alone)
    steps = count(f"file:{alone}?immutable=1", "SELECT COUNT(*) FROM steps")
    assert steps == count(f"file:{store}?mode=ro", "SELECT COUNT(*) FROM steps")
    assert count(f"file:{alone}?immutable=1", "SELECT status FROM ranks") == "closed"
    assert count(f"file:{alone}?immutable=1", "SELECT COUNT(*) FROM module_stats") > 0
    return int(steps)  # type: ignore[call-overload]


def test_ctrl_c_on_the_demo_with_a_page_open(page, server_factory, tmp_path):
    srv = server_factory(["--runs-dir", str(tmp_path / "runs")])
    page.get(srv.url)
    wait_text(page, "3 unregistered", "#ov-cards")
    wait_for(page, lambda d: header_step(d) >= 5, "five steps shown")
    srv.proc.send_signal(signal.SIGINT)                     # Ctrl-C in the dashboard's terminal
    assert srv.proc.wait(60) == 0
    page.get("about:blank")                                 # leave first: the page's polls fail, the server is gone
    page.get_log("browser")                                 # then drop the failures that were in flight
    [store] = (tmp_path / "runs").glob("demo-*/modscope-*.sqlite")
    assert assert_main_file_holds_the_run(store, tmp_path) >= 5


def test_a_training_stopped_while_the_dashboard_goes_on_reading(page, server_factory, tmp_path):
    run_dir = tmp_path / "run"
    train = subprocess.Popen([sys.executable, str(REPO / "examples" / "demo_train.py"), "--run-dir", str(run_dir),
                              "--steps", "0", "--delay", "0.05"], cwd=str(REPO), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        srv = server_factory(["serve", "--run", str(run_dir)])
        page.get(srv.url)
        wait_text(page, "3 unregistered", "#ov-cards")
        wait_for(page, lambda d: header_step(d) >= 10, "ten steps shown")
        train.send_signal(signal.SIGINT)
        _, err = train.communicate(timeout=60)
        assert b"KeyboardInterrupt" in err                  # stopped inside the loop; the watcher closed on the way out
        wait_text(page, "finished", "#run-status")          # the page read the closed run
        [store] = run_dir.glob("modscope-*.sqlite")
        steps = assert_main_file_holds_the_run(store, tmp_path)
        time.sleep(2)                                       # two more polls: the page reads the main file now
        wait_for(page, lambda d: header_step(d) == steps - 1, f"step {steps - 1} shown")
        assert srv.proc.poll() is None
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
