"""The embedded demo: ``python app.py`` with no store runs examples/demo_train.py in a child
process (this interpreter) writing to a fresh run directory, and stops it on exit."""

from __future__ import annotations

import datetime as _dt
import os
import signal
import subprocess
import sys
from pathlib import Path

from .paths import demo_script

REPO = Path(__file__).resolve().parent.parent
DEMO_SCRIPT = demo_script()      # examples/demo_train.py in a checkout, dashboard/demo_train.py in a wheel
# default arguments of the demo: train until stopped, sampling every step
DEMO_ARGS = ("--steps", "0", "--delay", "0.1")


def fresh_run_dir(base: Path) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    d = base / f"demo-{stamp}"
    n = 1
    while d.exists():
        n += 1
        d = base / f"demo-{stamp}-{n}"
    d.mkdir(parents=True)
    return d


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM if the dashboard dies without cleaning up."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_demo(run_dir: Path, extra_args: list[str] | None = None,
               script: Path = DEMO_SCRIPT) -> subprocess.Popen:
    if not script.exists():
        raise FileNotFoundError(f"{script}: demo script not found")
    log = open(run_dir / "demo.log", "ab")
    cmd = [sys.executable, str(script), "--run-dir", str(run_dir), *(extra_args or [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), env=env,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    finally:
        log.close()


def stop_demo(proc: subprocess.Popen, timeout: float = 5.0) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode
