"""The embedded demo: ``python app.py`` with no store runs examples/demo_train.py in a child
process (this interpreter) writing to a fresh run directory, and stops it on exit."""

from __future__ import annotations

import datetime as _dt
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _load_prctl() -> Any:
    """libc's prctl, loaded here in the parent: the child, between fork and exec, must only call it
    (loading a library there could wait forever on a lock another thread held at the fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM if the dashboard dies without cleaning up (PR_SET_PDEATHSIG)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


def die_with_parent() -> Callable[[], None] | None:
    """The ``preexec_fn`` that ties a child to this process's life, where the platform has one."""
    return _die_with_parent if _PRCTL is not None else None


def start_demo(run_dir: Path, extra_args: list[str] | None = None,
               script: Path = DEMO_SCRIPT) -> subprocess.Popen[bytes]:
    if not script.exists():
        raise FileNotFoundError(f"{script}: demo script not found")
    cmd = [sys.executable, str(script), "--run-dir", str(run_dir), *(extra_args or [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(run_dir / "demo.log", "ab") as log:      # the child keeps its own descriptor
        # preexec_fn only calls prctl (loaded above): nothing that takes a lock runs between fork and exec
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), env=env,
                                preexec_fn=die_with_parent())  # noqa: PLW1509


def stop_demo(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode
