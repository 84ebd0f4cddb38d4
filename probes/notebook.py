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
import re
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

TOKEN_ENV = "MODSCOPE_TOKEN"  # the dashboard's token, as dashboard/web/token_source.py reads it
MIN_TOKEN_LENGTH = 16         # dashboard/web/security.py's rule: 16 or more URL-safe characters
_TOKEN_CHARS = re.compile(r"^[A-Za-z0-9._~-]+$")
MAX_HEIGHT = 10_000           # pixels of the frame
START_TIMEOUT_S = 60.0        # how long show() waits for the dashboard to answer (a cold start imports Dash)
DEFAULT_HEIGHT = 650


@dataclasses.dataclass
class _Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    token: str | None = None


_servers: dict[str, _Server] = {}
_lock = threading.Lock()


def show(run: str | os.PathLike[str], *, height: int = DEFAULT_HEIGHT, token: str | None = None) -> str | None:
    """Serve the dashboard on ``run`` (a run directory, or one run's store file) and show it in
    the notebook's output; returns its URL (also printed), or None when the dashboard could not
    start (one line says why, with its log). ``token`` (default: ``MODSCOPE_TOKEN`` from the environment, if set)
    is required by the dashboard on every request: on a machine with other users. It reaches the dashboard's
    process in its environment, never on its command line, and is in the URL shown."""
    if not isinstance(run, (str, os.PathLike)):
        raise TypeError(f"run must be a run directory or store file (str or os.PathLike), got "
                        f"{type(run).__qualname__}: {run!r:.80}")
    check_height(height)
    token = check_token(os.environ.get(TOKEN_ENV) or None if token is None else token)
    key = str(Path(run).resolve())
    with _lock:
        server = _servers.get(key)
        if server is not None and server.token != token:
            _stop(server)                # the same run with another token: a new server
            server = None
        if server is None or server.proc.poll() is not None:
            server = _start(Path(key), token)
            if server is None:
                return None
            _servers[key] = server
    _display(server.url, height)
    print(f"modscope dashboard: {server.url}", flush=True)
    return server.url


def check_height(height: object) -> None:
    if isinstance(height, bool) or not isinstance(height, int) or not 100 <= height <= MAX_HEIGHT:
        raise ValueError(f"height must be an int from 100 to {MAX_HEIGHT:,} (pixels), got {height!r:.80}")


def check_token(token: object) -> str | None:
    """The token (or None) when the dashboard can use it, else ValueError naming its length, never the token."""
    if token is None:
        return None
    if not isinstance(token, str):
        raise TypeError(f"token must be a str or None, got {type(token).__qualname__}")
    if len(token) < MIN_TOKEN_LENGTH or not _TOKEN_CHARS.match(token):
        raise ValueError(f"token: {len(token)} characters; expected at least {MIN_TOKEN_LENGTH} of A-Z a-z 0-9 - _ . ~")
    return token


def stop_all() -> None:
    """Stop every dashboard this kernel started (also done at exit)."""
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for s in servers:
        _stop(s)


def _stop(s: _Server) -> None:
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


def _child_env(token: str | None) -> dict[str, str]:
    """This environment, the token (if any) in ``MODSCOPE_TOKEN`` and nowhere else."""
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    if token:
        env[TOKEN_ENV] = token
    return env


def _dashboard_command(args: list[str]) -> list[str]:
    """``python -c BOOT ARGS`` running ``dashboard.cli``: modscope's own packages first on the path (the kernel's
    working folder, which ``python -m`` would put first, may hold a ``dashboard/`` or an ``argparse.py`` of the
    user's; dashboard/commands/children.py does the same for ``modscope run``)."""
    root = str(Path(__file__).resolve().parent.parent)
    boot = (f"import sys; sys.path[0:0 if getattr(sys.flags, 'safe_path', False) else 1] = [{root!r}]; "
            "from dashboard.cli import main; sys.exit(main())")
    return [sys.executable, "-c", boot, *args]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True                      # it answers
    except OSError:
        return False


def _start(run: Path, token: str | None) -> _Server | None:
    for _ in range(3):                   # a port taken between the check and the bind: another one
        port = _free_port()
        fd, log_name = tempfile.mkstemp(prefix="modscope-dashboard-", suffix=".log")
        log = Path(log_name)
        cmd = _dashboard_command(["serve", "--run", str(run), "--host", "127.0.0.1", "--port", str(port)])
        try:
            # its own session: interrupting the kernel (SIGINT to its process group) leaves it up
            proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=_child_env(token), start_new_session=True)
        except OSError as exc:
            print(f"modscope: cannot start the dashboard: {exc}", file=sys.stderr)
            return None
        finally:
            os.close(fd)
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(url):
                return _Server(proc, url + (f"?token={token}" if token else ""), log, token)
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
