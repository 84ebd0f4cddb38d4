"""What ``python app.py`` does once its arguments are parsed: open the stores, start the
demo, serve the app (port check, token, URL, SIGTERM, demo watcher and shutdown) and export
the standalone report. ``app.py`` only parses arguments and calls these.

Any unusable argument exits with status 2 and one line naming the path and the problem.
The heavy imports (Dash, the store) are deferred so that ``--help`` stays fast."""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn


def fail(msg: str) -> NoReturn:
    print(f"modscope: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def check_port(host: str, port: int) -> None:
    """Fail early (before starting a demo or printing a URL) when the address cannot be bound."""
    import socket
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        fail(f"--host {host}: cannot resolve ({exc.strerror})")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            fail(f"{host}:{port}: cannot listen ({exc.strerror or exc})")


def check_port_number(port: int) -> None:
    if not (0 < port < 65536):
        fail(f"--port {port}: not a port number")


def open_config(*, run: str | None = None, snapshot: str | None = None,
                compare: list[str] | None = None, poll_ms: int = 1000):
    """The AppConfig for a run (live), a snapshot (review) or two stores (compare)."""
    from .data import Store, StoreError
    from .server import AppConfig

    try:
        if compare:
            a, b = (Store.open_any(x) for x in compare)
            for s in (a, b):
                if not s.ready():
                    fail(f"{s.path}: no store yet (nothing written to this run)")
            return AppConfig(mode="compare", store=a, store_b=b, title="modscope: compare")
        if snapshot:
            return AppConfig(mode="review", store=Store.open_snapshot(snapshot), title="modscope: snapshot")
        return AppConfig(mode="live", store=Store.open_run(run), poll_ms=poll_ms)
    except StoreError as exc:
        fail(str(exc))


def start_demo_config(host: str, port: int, runs_dir: str | Path, demo_args: list[str],
                      poll_ms: int = 1000):
    """Check the address, start examples/demo_train.py writing to a fresh run directory under
    ``runs_dir``; returns ``(config, demo_proc)``."""
    from .data import Store, StoreError
    from .demo import fresh_run_dir, start_demo
    from .server import AppConfig

    check_port(host, port)
    run_dir = fresh_run_dir(Path(runs_dir))
    try:
        demo_proc = start_demo(run_dir, demo_args)
    except FileNotFoundError as exc:
        fail(str(exc))
    print(f"demo training started (pid {demo_proc.pid}), writing to {run_dir}", flush=True)
    try:
        return AppConfig(mode="live", store=Store.open_run(run_dir), poll_ms=poll_ms), demo_proc
    except StoreError as exc:
        fail(str(exc))


def _url(host: str, port: int, token: str | None) -> tuple[str, bool]:
    all_interfaces = host in ("0.0.0.0", "::", "")
    if all_interfaces:
        import socket
        shown_host = socket.gethostname()
    else:
        shown_host = f"[{host}]" if ":" in host else host
    return f"http://{shown_host}:{port}/" + (f"?token={token}" if token else ""), all_interfaces


def _watch_demo(proc, log_dir: Path) -> None:
    def watch():
        code = proc.wait()
        if code not in (0, -signal.SIGTERM, -signal.SIGKILL):
            print(f"modscope: demo training exited with code {code} (log: {log_dir}/demo.log)",
                  file=sys.stderr, flush=True)
    threading.Thread(target=watch, daemon=True).start()


def serve(config, host: str, port: int, token: str | None = None, demo_proc=None) -> int:
    """Serve ``config`` on host:port until Ctrl-C or SIGTERM; a non-loopback host without a
    token gets a generated one. Prints the URL; stops ``demo_proc`` (if any) on exit."""
    from .server import create_app, is_loopback

    if demo_proc is None:
        check_port(host, port)
    if not is_loopback(host) and not token:
        token = secrets.token_urlsafe(18)
    config.token = token
    app = create_app(config)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)

    url, all_interfaces = _url(host, port, token)
    print(f"modscope dashboard: {url}" + ("  (listening on all interfaces)" if all_interfaces else ""),
          flush=True)

    def on_term(signum, frame):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, on_term)

    if demo_proc is not None:
        _watch_demo(demo_proc, config.store.path.parent)
    try:
        app.run(host=host, port=port, debug=False)
    except OSError as exc:
        fail(f"{host}:{port}: cannot listen ({exc.strerror or exc})")
    except KeyboardInterrupt:
        pass
    finally:
        if demo_proc is not None:
            from .demo import stop_demo
            stop_demo(demo_proc)
    return 0


def export(output: str, *, run: str | None = None, snapshot: str | None = None, rank: int = 0) -> int:
    """Write the standalone HTML report of a run or snapshot to ``output``."""
    from .data import Store, StoreError
    from .report import write_report

    try:
        store = Store.open_run(run) if run else Store.open_snapshot(snapshot)
        if not store.ready():
            fail(f"{store.path}: no store yet (nothing written to this run)")
        out = write_report(store, output, rank)
    except StoreError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{output}: cannot write ({exc.strerror or exc})")
    print(f"wrote {out}")
    return 0
