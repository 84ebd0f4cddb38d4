"""modscope dashboard entry point.

    python app.py                               demo training + live dashboard on http://127.0.0.1:8050
    python app.py --run DIR                     follow a run a training script is writing
    python app.py --snapshot FILE               review a snapshot (read-only, no polling)
    python app.py --compare A B                 two runs or snapshots side by side
    python app.py export (--run DIR | --snapshot FILE) -o report.html
    options: --host H --port P --token T

Any unusable argument exits with status 2 and one line naming the path and the problem.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
import threading
from pathlib import Path


DEMO_ARGS = ("--steps", "0", "--delay", "0.1")


def fail(msg: str) -> "NoReturn":  # noqa: F821
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


def parse_serve(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python app.py", description="modscope dashboard")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", metavar="DIR", help="follow the run store in DIR (live)")
    src.add_argument("--snapshot", metavar="FILE", help="open a snapshot read-only (review mode)")
    src.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two runs or snapshots")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="port (default 8050)")
    p.add_argument("--token", help="access token (required, or generated, for a non-loopback host)")
    p.add_argument("--poll-ms", type=int, default=1000, help="live polling interval in ms (default 1000)")
    p.add_argument("--runs-dir", default="runs", help="where the demo writes its run (default ./runs)")
    p.add_argument("--demo-arg", action="append", default=None, metavar="ARG",
                   help="argument passed to examples/demo_train.py, repeatable "
                        f"(default: {' '.join(DEMO_ARGS)}: train until stopped, sampling every step)")
    return p.parse_args(argv)


def parse_export(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python app.py export", description="write a standalone HTML report")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR")
    src.add_argument("--snapshot", metavar="FILE")
    p.add_argument("-o", "--output", required=True, metavar="report.html")
    p.add_argument("--rank", type=int, default=0)
    return p.parse_args(argv)


def export_main(argv: list[str]) -> int:
    from dashboard.data import Store, StoreError
    from dashboard.report import write_report

    args = parse_export(argv)
    try:
        store = Store.open_run(args.run) if args.run else Store.open_snapshot(args.snapshot)
        if not store.ready():
            fail(f"{store.path}: no store yet (nothing written to this run)")
        out = write_report(store, args.output, args.rank)
    except StoreError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{args.output}: cannot write ({exc.strerror or exc})")
    print(f"wrote {out}")
    return 0


def serve_main(argv: list[str]) -> int:
    from dashboard.data import Store, StoreError
    from dashboard.server import AppConfig, create_app, is_loopback

    args = parse_serve(argv)
    if not (0 < args.port < 65536):
        fail(f"--port {args.port}: not a port number")
    demo_proc = None
    try:
        if args.compare:
            a, b = (Store.open_any(x) for x in args.compare)
            for s in (a, b):
                if not s.ready():
                    fail(f"{s.path}: no store yet (nothing written to this run)")
            config = AppConfig(mode="compare", store=a, store_b=b, title="modscope: compare")
        elif args.snapshot:
            config = AppConfig(mode="review", store=Store.open_snapshot(args.snapshot), title="modscope: snapshot")
        elif args.run:
            config = AppConfig(mode="live", store=Store.open_run(args.run), poll_ms=args.poll_ms)
        else:
            from dashboard.demo import fresh_run_dir, start_demo
            check_port(args.host, args.port)
            run_dir = fresh_run_dir(Path(args.runs_dir))
            try:
                demo_proc = start_demo(run_dir, list(DEMO_ARGS) if args.demo_arg is None else args.demo_arg)
            except FileNotFoundError as exc:
                fail(str(exc))
            print(f"demo training started (pid {demo_proc.pid}), writing to {run_dir}", flush=True)
            config = AppConfig(mode="live", store=Store.open_run(run_dir), poll_ms=args.poll_ms)
    except StoreError as exc:
        fail(str(exc))

    if demo_proc is None:
        check_port(args.host, args.port)
    token = args.token
    if not is_loopback(args.host) and not token:
        token = secrets.token_urlsafe(18)
    config.token = token
    app = create_app(config)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)

    all_interfaces = args.host in ("0.0.0.0", "::", "")
    if all_interfaces:
        import socket
        shown_host = socket.gethostname()
    else:
        shown_host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown_host}:{args.port}/" + (f"?token={token}" if token else "")
    print(f"modscope dashboard: {url}" + ("  (listening on all interfaces)" if all_interfaces else ""),
          flush=True)

    def on_term(signum, frame):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, on_term)

    if demo_proc is not None:
        def watch_demo(proc=demo_proc):
            code = proc.wait()
            if code not in (0, -signal.SIGTERM, -signal.SIGKILL):
                print(f"modscope: demo training exited with code {code} (log: {config.store.path.parent}/demo.log)",
                      file=sys.stderr, flush=True)
        threading.Thread(target=watch_demo, daemon=True).start()
    try:
        app.run(host=args.host, port=args.port, debug=False)
    except OSError as exc:
        fail(f"{args.host}:{args.port}: cannot listen ({exc.strerror or exc})")
    except KeyboardInterrupt:
        pass
    finally:
        if demo_proc is not None:
            from dashboard.demo import stop_demo
            stop_demo(demo_proc)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "export":
        return export_main(argv[1:])
    return serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
