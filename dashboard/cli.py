"""The ``modscope`` command line (``python app.py`` in a checkout, ``python -m dashboard.cli``): the dispatch of
its subcommands (each in dashboard/commands/: ``export``, ``findings``, ``snapshot``, ``series``, ``checkpoint``,
``run``) and ``serve`` / ``demo`` itself: open the stores, start the demo, serve the app (port check, token, URL,
SIGTERM, demo watcher and shutdown).

Any unusable argument exits with status 2 and one line naming the path and the problem.
The heavy imports (Dash, the store) are deferred so that ``--help`` stays fast."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from probes.schema import printable

from .commands.args import (
    ABOUT,
    COMMANDS,
    Parser,
    check_poll_ms,
    check_port,
    check_run_path,
    check_serve_args,
    check_store_target,
    fail,
)
from .web.token_source import add_token_options, chosen_token

if TYPE_CHECKING:
    from .web.server import AppConfig




















def open_config(*, run: str | None = None, snapshot: str | None = None,
                compare: list[str] | None = None, poll_ms: int = 1000) -> AppConfig:
    """The AppConfig for a run (live), a snapshot (review) or two stores (compare)."""
    from .read.store import Store, StoreError
    from .web.server import AppConfig

    for option, value in (("--run", run), ("--snapshot", snapshot), *(("--compare", c) for c in compare or ())):
        if value is not None:
            check_store_target(option, value)
    try:
        if compare:
            a, b = (Store.open_any(x) for x in compare)
            for s in (a, b):
                if not s.ready():
                    fail(f"{s.where}: no store yet (nothing written to this run)")
            return AppConfig(mode="compare", store=a, store_b=b, title="modscope: compare")
        if snapshot:
            return AppConfig(mode="review", store=Store.open_snapshot(snapshot), title="modscope: snapshot")
        if run is None:
            fail("nothing to open: expected --run DIR, --snapshot FILE or --compare A B")
        check_run_path(run)
        return AppConfig(mode="live", store=Store.open_run(run), poll_ms=poll_ms)
    except StoreError as exc:
        fail(str(exc))


def start_demo_config(host: str, port: int, runs_dir: str | Path, demo_args: list[str],
                      poll_ms: int = 1000) -> tuple[AppConfig, subprocess.Popen[Any]]:
    """Check the address, start examples/demo_train.py writing to a fresh run directory under
    ``runs_dir`` (relative to this process's folder, for the child as for the dashboard); returns
    ``(config, demo_proc)``."""
    from .commands.demo import fresh_run_dir, start_demo, stop_demo
    from .read.store import Store, StoreError
    from .web.server import AppConfig

    check_port(host, port)
    try:
        run_dir = fresh_run_dir(Path(runs_dir).absolute())
    except OSError as exc:
        fail(f"--runs-dir {runs_dir}: cannot create a run directory in it ({exc.strerror or exc})")
    try:
        demo_proc = start_demo(run_dir, demo_args)
    except FileNotFoundError as exc:
        fail(str(exc))
    print(printable(f"demo training started (pid {demo_proc.pid}), writing to {run_dir}"), flush=True)
    try:
        return AppConfig(mode="live", store=Store.open_run(run_dir), poll_ms=poll_ms), demo_proc
    except StoreError as exc:
        stop_demo(demo_proc)
        fail(str(exc))


def _url(host: str, port: int, token: str | None) -> tuple[str, bool]:
    all_interfaces = host in ("0.0.0.0", "::")
    if all_interfaces:
        import socket
        shown_host = socket.gethostname()
    else:
        shown_host = f"[{host}]" if ":" in host else host
    return f"http://{shown_host}:{port}/" + (f"?token={token}" if token else ""), all_interfaces


def _watch_demo(proc: subprocess.Popen[Any], log_dir: Path) -> None:
    def watch() -> None:
        code = proc.wait()
        if code not in (0, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL):     # stop_demo's signals
            print(printable(f"modscope: demo training exited with code {code} (log: {log_dir}/demo.log)"),
                  file=sys.stderr, flush=True)
    threading.Thread(target=watch, daemon=True).start()


def _log_to_stderr() -> None:
    """The ``modscope.*`` loggers (security refusals: one line each) print to stderr."""
    log = logging.getLogger("modscope")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def serve(config: AppConfig, host: str, port: int, token: str | None = None,
          demo_proc: subprocess.Popen[Any] | None = None) -> int:
    """Serve ``config`` on host:port until Ctrl-C or SIGTERM; a non-loopback host without a
    token gets a generated one. Prints the URL. ``demo_proc`` (if any) is stopped however this
    ends, also on a Ctrl-C or SIGTERM while the app is still being built (seconds), so that the
    demo closes its run."""
    from .web import security
    from .web.config import ServedAt
    from .web.server import create_app

    def on_term(signum: int, frame: FrameType | None) -> NoReturn:
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, on_term)

    try:
        host, token = check_serve_args(host, port, token)
        if demo_proc is None:
            check_port(host, port)
        if not security.is_loopback(host) and not token:
            token = security.generate_token()
        config.served = ServedAt(host, port, token)
        app = create_app(config)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        _log_to_stderr()

        url, all_interfaces = _url(host, port, token)
        print(f"modscope dashboard: {url}" + ("  (listening on all interfaces)" if all_interfaces else ""),
              flush=True)
        if demo_proc is not None and config.store is not None:
            _watch_demo(demo_proc, config.store.path.parent)
        try:
            app.run(host=host, port=port, debug=False)
        except OSError as exc:
            fail(f"{host}:{port}: cannot listen ({exc.strerror or exc})")
    except KeyboardInterrupt:
        pass
    finally:
        if demo_proc is not None:
            from .commands.demo import stop_demo
            stop_demo(demo_proc)
    return 0








# ================================================================================ the command line
# ``modscope COMMAND ...`` (the console script) and ``python app.py COMMAND ...`` (app.py calls
# main()). Today's flags without a command (``python app.py --run DIR``) still serve, or start
# the demo when they name no store.
_SOURCE_FLAGS = ("--run", "--snapshot", "--compare")




def usage(prog: str = "modscope") -> str:
    width = max(len(c) for c in COMMANDS)
    lines = [f"usage: {prog} COMMAND [OPTIONS]", "", "commands:"]
    for cmd, about in ABOUT.items():
        lines.append(f"  {cmd:<{width}}  {about}")
        lines.append(f"  {'':<{width}}    {prog} {cmd} {COMMANDS[cmd]}")
    lines += ["", f"'{prog} COMMAND --help' describes a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "modscope") -> int:
    """The command line: ``modscope COMMAND [OPTIONS]``; returns the exit status."""
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv), prog)
    except BrokenPipeError:
        # ``modscope findings | head``: the reader left; no traceback (Python's own advice)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _dispatch(argv: list[str], prog: str) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog))
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        return serve_main(rest, prog, source="required")
    if cmd == "demo":
        return serve_main(rest, prog, source="none")
    if cmd == "export":
        from .commands.export import export_main
        return export_main(rest, prog)
    if cmd == "findings":
        from .commands.findings import findings_main
        return findings_main(rest, prog)
    if cmd == "snapshot":
        from .commands.snapshot import snapshot_main
        return snapshot_main(rest, prog, Parser)
    if cmd == "series":
        from .commands.series import series_main
        return series_main(rest, prog, Parser, fail)
    if cmd == "checkpoint":
        from .commands.checkpoint import main as checkpoint_main
        return checkpoint_main(rest, Parser(prog=f"{prog} checkpoint", description=ABOUT["checkpoint"]), fail)
    if cmd == "run":
        from .commands.run import run_main
        return run_main(rest, prog)
    if cmd.startswith("-"):
        # today's flags without a command: a store to serve, else the demo
        return serve_main(argv, prog, source="optional")
    fail(f"{cmd!r}: not a command; expected one of {', '.join(COMMANDS)} ({prog} --help)")


def serve_parser(prog: str, source: str) -> argparse.ArgumentParser:
    """``source``: "required" (serve), "none" (demo) or "optional" (no command: either)."""
    from .commands.demo import DEMO_ARGS

    name = {"required": f"{prog} serve", "none": f"{prog} demo"}.get(source, prog)
    p = Parser(prog=name, description=ABOUT["serve" if source == "required" else "demo"])
    if source != "none":
        src = p.add_mutually_exclusive_group(required=source == "required")
        src.add_argument("--run", metavar="DIR", help="follow the run store in DIR (live)")
        src.add_argument("--snapshot", metavar="FILE", help="open a snapshot read-only (review mode)")
        src.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two runs or snapshots")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="port (default 8050)")
    add_token_options(p, "access token (required, or generated, for a non-loopback host)")
    p.add_argument("--poll-ms", type=int, default=1000, help="live polling interval in ms (default 1000)")
    if source != "required":
        p.add_argument("--runs-dir", default="runs", help="where the demo writes its run (default ./runs)")
        p.add_argument("--demo-arg", action="append", default=None, metavar="ARG",
                       help="argument passed to the demo training script, repeatable "
                            f"(default: {' '.join(DEMO_ARGS)}: train until stopped, sampling every step)")
    return p


def serve_main(argv: Sequence[str], prog: str = "modscope", source: str = "required") -> int:
    from .commands.demo import DEMO_ARGS

    args = serve_parser(prog, source).parse_args(list(argv))
    args.token = chosen_token(args)
    args.host, args.token = check_serve_args(args.host, args.port, args.token)  # before the demo starts
    check_poll_ms(args.poll_ms)
    demo_proc = None
    run, snapshot, compare = (getattr(args, a, None) for a in ("run", "snapshot", "compare"))
    if compare or snapshot or run:
        config = open_config(run=run, snapshot=snapshot, compare=compare, poll_ms=args.poll_ms)
    else:
        config, demo_proc = start_demo_config(args.host, args.port, args.runs_dir,
                                              list(DEMO_ARGS) if args.demo_arg is None else args.demo_arg,
                                              args.poll_ms)
    return serve(config, args.host, args.port, token=args.token, demo_proc=demo_proc)




# -------------------------------------------------------------------------------- findings


# -------------------------------------------------------------------------------- run
















if __name__ == "__main__":
    sys.exit(main())
