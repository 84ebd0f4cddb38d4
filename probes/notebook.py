"""``probes.show(run_dir)`` and ``Watcher.show()``: the live dashboard inline in a Jupyter notebook.

The dashboard runs as a process of its own (``python -m dashboard.cli serve --run DIR --host
127.0.0.1 --port <free port>``), and the notebook shows it in an ``<iframe>`` of its URL, which
is what Dash's ``jupyter_mode="inline"`` renders too, but Dash, Flask and their threads stay out
of the kernel that trains. It is the same server as ``modscope serve``, with the same rules:
bound to the loopback address, Host and Origin checked (docs/security.md; the dashboard lets
pages served from this machine's loopback names, such as Jupyter's ``http://localhost:8888``,
frame it). One server per run (directory or store file) per kernel: calling ``show()`` again
displays it again; the servers stop when the kernel exits. Outside a notebook only the URL is
printed, and it is printed in a notebook too, for a front end that does not show the frame.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ipython_shell", "on_cell_end", "show", "stop_all"]

START_TIMEOUT_S = 60.0        # how long show() waits for the dashboard to answer (a cold start imports Dash)
DEFAULT_HEIGHT = 650


@dataclasses.dataclass
class _Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


_servers: dict[str, _Server] = {}
_lock = threading.Lock()


def show(run: str | os.PathLike[str], *, height: int = DEFAULT_HEIGHT) -> str | None:
    """Serve the dashboard on ``run`` (a run directory, or one run's store file) and show it in
    the notebook's output; returns its URL (also printed), or None when the dashboard could not
    start (one line says why, with its log)."""
    if not isinstance(run, (str, os.PathLike)):
        raise TypeError(f"run must be a run directory or store file (str or os.PathLike), got "
                        f"{type(run).__qualname__}: {run!r:.80}")
    if isinstance(height, bool) or not isinstance(height, int) or height < 100:
        raise ValueError(f"height must be an int of at least 100 (pixels), got {height!r}")
    key = str(Path(run).resolve())
    with _lock:
        server = _servers.get(key)
        if server is None or server.proc.poll() is not None:
            server = _start(Path(key))
            if server is None:
                return None
            _servers[key] = server
    _display(server.url, height)
    print(f"modscope dashboard: {server.url}", flush=True)
    return server.url


def stop_all() -> None:
    """Stop every dashboard this kernel started (also done at exit)."""
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for s in servers:
        if s.proc.poll() is None:
            s.proc.terminate()
            try:
                s.proc.wait(5)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait(5)


atexit.register(stop_all)


def ipython_shell() -> Any | None:
    """The IPython shell that runs this process's cells, or None (IPython is never imported here: a process that
    has not imported it has no shell)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        return ipython.get_ipython()
    except Exception:                    # an unusual IPython: as without one
        return None


def on_cell_end(callback: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``callback`` after every cell the IPython shell of this process runs (its ``post_run_cell``
    event), also after a cell that raised or was interrupted; returns the function that stops it, or None
    outside IPython."""
    shell = ipython_shell()
    if shell is None:
        return None
    try:
        events = shell.events

        def after_cell(*args: object) -> None:
            callback()
        events.register("post_run_cell", after_cell)
    except Exception:                    # an unusual shell: nothing to do after its cells
        return None

    def stop() -> None:
        with contextlib.suppress(Exception):
            events.unregister("post_run_cell", after_cell)
    return stop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _child_env() -> dict[str, str]:
    """From a checkout, the dashboard is importable only with the checkout on its path."""
    env = dict(os.environ)
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "dashboard" / "cli.py").is_file():
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True                      # it answers
    except OSError:
        return False


def _start(run: Path) -> _Server | None:
    for _ in range(3):                   # a port taken between the check and the bind: another one
        port = _free_port()
        fd, log_name = tempfile.mkstemp(prefix="modscope-dashboard-", suffix=".log")
        log = Path(log_name)
        cmd = [sys.executable, "-m", "dashboard.cli", "serve", "--run", str(run), "--host", "127.0.0.1",
               "--port", str(port)]
        try:
            # its own session: interrupting the kernel (SIGINT to its process group) leaves it up
            proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=_child_env(), start_new_session=True)
        except OSError as exc:
            print(f"modscope: cannot start the dashboard: {exc}", file=sys.stderr)
            return None
        finally:
            os.close(fd)
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(url):
                return _Server(proc, url, log)
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
            break
        if "cannot listen" not in log.read_text(errors="replace"):
            break
    last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
    print(f"modscope: the dashboard did not start: {last} (log: {log})", file=sys.stderr)
    return None


def _display(url: str, height: int) -> None:
    """An IFrame in a Jupyter kernel (IPython's, as Dash's inline mode uses); nothing elsewhere."""
    try:
        from IPython.core.getipython import get_ipython
        shell = get_ipython()                                 # type: ignore[no-untyped-call]
        if shell is None or not hasattr(shell, "kernel"):    # a terminal IPython shows no HTML
            return
        from IPython.display import IFrame, display
        display(IFrame(url, width="100%", height=height))   # type: ignore[no-untyped-call]
    except Exception:                    # no IPython, or a front end without HTML: the URL is printed
        return
