"""Whatever was committed stays readable when the training process is killed with SIGKILL."""
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def committed_steps(run: Path) -> int:
    stores = list(run.glob("modscope-*.sqlite"))
    if not stores:
        return 0
    store = stores[0]
    try:
        con = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
        try:
            return con.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def test_sigkill_mid_run_keeps_every_committed_step(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "demo_train.py"), "--run-dir", str(run),
                             "--steps", "0", "--every", "1", "--delay", "0.01"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while committed_steps(run) < 30:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the demo did not commit 30 steps in 120 s"
            time.sleep(0.1)
        seen_before_kill = committed_steps(run)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    (store,) = run.glob("modscope-*.sqlite")
    con = sqlite3.connect(store)        # a reader after the crash (recovers the WAL)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    steps = [r[0] for r in con.execute("SELECT step FROM steps ORDER BY step")]
    assert len(steps) >= seen_before_kill
    assert steps == list(range(len(steps)))          # no hole: every committed step is there
    sampled = {r[0] for r in con.execute("SELECT DISTINCT step FROM module_stats")}
    assert set(range(len(steps) - 1)) <= sampled | {len(steps) - 1}
    status = con.execute("SELECT status FROM ranks").fetchone()[0]
    assert status == "running"                        # it never closed: the store says so
    paths = {r[0] for r in con.execute("SELECT path FROM findings WHERE code='unregistered-module'")}
    assert paths == {"encoder.blocks"}
