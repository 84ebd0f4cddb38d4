"""The embedded demo: ``python app.py`` with no store runs examples/demo_train.py in a child
process (this interpreter) writing to a fresh run directory, and stops it on exit (a SIGINT first,
so that it closes its run)."""

from __future__ import annotations

import datetime as _dt
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..paths import demo_script

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


def _load_libc() -> tuple[Any, Any]:
    """libc's prctl and signal, loaded here in the parent: the child, between fork and exec, must only
    call them (loading a library there could wait forever on a lock another thread held at the fork)."""
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        return libc.prctl, libc.signal
    except (OSError, AttributeError):
        return None, None


_PRCTL, _SIGNAL = _load_libc()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM if the dashboard dies without cleaning up (PR_SET_PDEATHSIG).
    SIGINT goes back to its default: an ignored signal stays ignored across exec (a dashboard started
    in the background of a script ignores it), and stop_demo's SIGINT must reach the training."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)
        _SIGNAL(signal.SIGINT, None)        # SIG_DFL


def die_with_parent() -> Callable[[], None] | None:
    """The ``preexec_fn`` that ties a child to this process's life, where the platform has one."""
    return _die_with_parent if _PRCTL is not None else None


def start_demo(run_dir: Path, extra_args: list[str] | None = None,
               script: Path = DEMO_SCRIPT) -> subprocess.Popen[bytes]:
    """Start the demo training writing to ``run_dir``, in this process's folder (the script finds
    probes by its own path). The path is passed absolute: the dashboard reads the same folder.

    The child has a process group of its own, so that a Ctrl-C in the terminal reaches only the
    dashboard, which then stops it with one SIGINT (stop_demo): a second one, arriving while the
    child closes its run, would cut the close short."""
    if not script.exists():
        raise FileNotFoundError(f"{script}: demo script not found")
    run_dir = run_dir.absolute()
    cmd = [sys.executable, str(script), "--run-dir", str(run_dir), *(extra_args or [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(run_dir / "demo.log", "ab") as log:      # the child keeps its own descriptor
        # preexec_fn only calls prctl and signal (loaded above): nothing that takes a lock runs between fork and exec
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=die_with_parent())  # noqa: PLW1509


def stop_demo(proc: subprocess.Popen[Any], timeout: float = 5.0) -> int | None:
    """Stop ``proc`` the way that lets a training close its watcher (a SIGINT: a KeyboardInterrupt
    leaves ``with probes.watch(...)`` through its close, and the run ends ``closed``); SIGTERM, then
    SIGKILL, for a child that does not exit within ``timeout`` seconds of each."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if proc.poll() is not None:
            return proc.returncode
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    return proc.wait()
