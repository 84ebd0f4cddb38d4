"""The ``modscope`` command line (``python app.py`` in a checkout, ``python -m dashboard.cli``):
``serve``, ``demo``, ``export``, ``findings``, ``series`` and ``run``. What serving does once the arguments
are parsed: open the stores, start the demo, serve the app (port check, token, URL, SIGTERM,
demo watcher and shutdown) and export the standalone report; ``findings`` prints through
dashboard/commands/findings.py; ``run`` starts the training script in a child process
(``python -m probes.launch.autorun``: this process never imports torch) and, with ``--serve``, the
dashboard in another.

Any unusable argument exits with status 2 and one line naming the path and the problem.
The heavy imports (Dash, the store) are deferred so that ``--help`` stays fast."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from probes.schema import every_option, overhead_option

if TYPE_CHECKING:
    from .web.server import AppConfig


def fail(msg: str) -> NoReturn:
    print(f"modscope: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def checked_host(host: str) -> str:
    """``--host`` validated and normalised (security.check_host), or exit 2 naming the value."""
    from .web import security  # deferred, like Dash (which it imports): --help stays fast

    try:
        return security.check_host(host)
    except ValueError as exc:
        fail(str(exc))


def check_serve_args(host: str, port: int, token: str | None) -> tuple[str, str | None]:
    """Check ``--host``, ``--port`` and ``--token`` before anything starts (the demo, the
    server); returns the normalised host and the token."""
    from .web import security

    check_port_number(port)
    host = checked_host(host)
    if token is not None:
        try:
            security.check_token(token)
        except ValueError as exc:
            fail(str(exc))
    return host, token


def check_port(host: str, port: int) -> None:
    """Fail early (before starting a demo or printing a URL) when the address cannot be bound."""
    import socket
    host = checked_host(host)   # never "": getaddrinfo(None) would mean every interface
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        fail(f"--host {host!r}: cannot resolve ({exc.strerror})")
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


def check_poll_ms(poll_ms: int) -> None:
    if poll_ms < 1:
        fail(f"--poll-ms {poll_ms}: expected a positive number of milliseconds")


_FILE_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def check_store_target(option: str, value: str) -> None:
    """A store argument names a directory or a regular file. ``/dev/null`` or a pipe would
    otherwise be read as an empty store (a dashboard waiting forever) or block the start; for
    ``--run``, a file must be a store file (an SQLite file, or any ``*.sqlite`` path, which a run
    may not have written yet), and one that nothing writes must be a store already. Missing paths
    are left to the store's own messages."""
    from .read.store import SQLITE_HEADER, Store, StoreError, writer_present

    path = Path(value)
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        return
    expected = "expected a run directory or a store file" if option == "--run" else "expected a store file"
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        fail(f"{option} {value}: {kind}; {expected}")
    if option == "--run" and path.suffix != ".sqlite":
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(SQLITE_HEADER))
        except OSError as exc:
            fail(f"{option} {value}: cannot open ({exc.strerror or exc})")
        if head != SQLITE_HEADER:
            fail(f"{option} {value}: a file that is not an SQLite store; {expected}")
    if option == "--run" and not writer_present(path):
        # a writer takes the store's lock before it creates the file, and creates the schema in one
        # transaction: a file with no writer that is not a store (another SQLite file) never becomes one
        store = Store(path, live=True)
        try:
            if not store.ready():
                store.validate()
        except StoreError as exc:
            fail(str(exc))


def check_run_path(run: str, command: str = "modscope serve") -> None:
    """A run that does not exist yet is waited for (said once, here); a folder of run folders is no run: they
    are listed, with how to pick one (exit 2)."""
    from .read.run_folders import run_folders, run_folders_text, waiting_text

    if not os.path.lexists(run):
        print(waiting_text(run), file=sys.stderr, flush=True)
        return
    folders = run_folders(run)
    if folders:
        fail(run_folders_text("--run", run, folders, command))


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
    print(f"demo training started (pid {demo_proc.pid}), writing to {run_dir}", flush=True)
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
            print(f"modscope: demo training exited with code {code} (log: {log_dir}/demo.log)",
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
        config.token = token
        config.bind_host, config.bind_port = host, port
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


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:         # one of them does not exist (yet): compare where they would be
        return a.resolve() == b.resolve()


def check_output_not_read(output: str, target: str) -> None:
    """``-o`` must not name a file of a store the export reads (the store, its ``-wal``, ``-shm``,
    ``-journal``, lock or status file): the report written there would replace the run."""
    from probes.schema import LOCK_SUFFIX, STATUS_SUFFIX

    from .read.run import scan_runs

    out = Path(output)
    for entry in scan_runs(target, limit=sys.maxsize):
        for store in entry.files:
            for suffix in ("", "-wal", "-shm", "-journal", LOCK_SUFFIX, STATUS_SUFFIX):
                if _same_file(out, Path(f"{store}{suffix}")):
                    what = "the store" if not suffix else f"the {suffix.lstrip('-.')} file of the store"
                    fail(f"-o {output}: is {what} {store} being exported; expected a new file for the report")


def export(output: str, *, run: str | None = None, snapshot: str | None = None, rank: int | None = None) -> int:
    """Write the standalone HTML report of a run or snapshot (the newest run of a directory) to
    ``output``: the tree and charts of ``rank`` (default: the run's lowest)."""
    from .read.run import as_run_dir
    from .read.store import Store, StoreError
    from .web.report import write_report

    if run is not None:
        check_store_target("--run", run)
    if snapshot is not None:
        check_store_target("--snapshot", snapshot)
    if run is None and snapshot is None:
        fail("export: expected --run DIR or --snapshot FILE")
    option, target = ("--run", run) if run is not None else ("--snapshot", str(snapshot))
    if not Path(target).exists():
        # (a live run that does not exist yet can only be served: export needs what was written)
        fail(f"{option} {target}: no such file or directory" + (" (no store yet)" if run is not None else ""))
    check_output_not_read(output, target)
    try:
        store = Store.open_run(target) if run is not None else Store.open_snapshot(target)
        if not store.ready():
            fail(f"{option} {target}: no store yet (nothing written to this run)")
        chosen = as_run_dir(store).run()
        ranks = chosen.ranks()
        if rank is not None and rank not in ranks:
            fail(f"--rank {rank}: no such rank in this run; expected one of {', '.join(map(str, ranks))}")
        out = write_report(chosen, output, rank)
    except StoreError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{output}: cannot write ({exc.strerror or exc})")
    print(f"wrote {out}")
    return 0


# ================================================================================ the command line
# ``modscope COMMAND ...`` (the console script) and ``python app.py COMMAND ...`` (app.py calls
# main()). Today's flags without a command (``python app.py --run DIR``) still serve, or start
# the demo when they name no store.
COMMANDS = {
    "serve": "(--run DIR | --snapshot FILE | --compare A B) [--host H] [--port P] [--token T]",
    "demo": "[--host H] [--port P] [--token T] [--runs-dir DIR] [--demo-arg ARG ...]",
    "export": "(--run DIR | --snapshot FILE) -o report.html [--rank R]",
    "findings": "(--run DIR | --snapshot FILE) [--rank R] [--json] [--fail-on error|warning|info]",
    "snapshot": "(--run DIR | --snapshot FILE) -o FILE [--rank R] [--timeout S]",
    "series": "(--run DIR | --snapshot FILE) --metric NAME [--rank R] [-o FILE]",
    "checkpoint": "FILE (--run DIR | --snapshot FILE) [--rank R]",
    "run": "[--run-dir DIR] [--every N | --overhead F] [--serve [--port P]] (script.py | -m package.module) [ARGS...]",
}
ABOUT = {
    "serve": "the dashboard on a run (live), a snapshot (review) or two of them (compare)",
    "demo": "train the demo model (with its plain-list bug) and serve the dashboard on it",
    "export": "a standalone HTML report of a run or snapshot",
    "findings": "print the active findings; --fail-on LEVEL exits 1 when one at LEVEL or worse exists",
    "snapshot": "one store file of a run (every rank) or a snapshot, holding only what modscope writes",
    "series": "one metric over time (gradient norms, update ratios, activations ...) as a tidy CSV",
    "checkpoint": "does a saved state dict restore the run's model? exit 1 when keys are missing or shapes differ",
    "run": "run a training script that has no modscope code in it, watching the models it trains",
}
_SOURCE_FLAGS = ("--run", "--snapshot", "--compare")


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error form: exit 2 and one line naming the value. Options are
    never abbreviated: ``demo --run DIR`` would otherwise be taken for ``--runs-dir DIR``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


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
        return export_main(rest, prog)
    if cmd == "findings":
        return findings_main(rest, prog)
    if cmd == "snapshot":
        from .commands.snapshot import snapshot_main
        return snapshot_main(rest, prog, _Parser)
    if cmd == "series":
        from .commands.series import series_main
        return series_main(rest, prog, _Parser, fail)
    if cmd == "checkpoint":
        from .commands.checkpoint import main as checkpoint_main
        return checkpoint_main(rest, _Parser(prog=f"{prog} checkpoint", description=ABOUT["checkpoint"]), fail)
    if cmd == "run":
        return run_main(rest, prog)
    if cmd.startswith("-"):
        # today's flags without a command: a store to serve, else the demo
        return serve_main(argv, prog, source="optional")
    fail(f"{cmd!r}: not a command; expected one of {', '.join(COMMANDS)} ({prog} --help)")


def serve_parser(prog: str, source: str) -> argparse.ArgumentParser:
    """``source``: "required" (serve), "none" (demo) or "optional" (no command: either)."""
    from .commands.demo import DEMO_ARGS

    name = {"required": f"{prog} serve", "none": f"{prog} demo"}.get(source, prog)
    p = _Parser(prog=name, description=ABOUT["serve" if source == "required" else "demo"])
    if source != "none":
        src = p.add_mutually_exclusive_group(required=source == "required")
        src.add_argument("--run", metavar="DIR", help="follow the run store in DIR (live)")
        src.add_argument("--snapshot", metavar="FILE", help="open a snapshot read-only (review mode)")
        src.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two runs or snapshots")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="port (default 8050)")
    p.add_argument("--token", help="access token (required, or generated, for a non-loopback host)")
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


def export_main(argv: Sequence[str], prog: str = "modscope") -> int:
    p = _Parser(prog=f"{prog} export", description=ABOUT["export"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR")
    src.add_argument("--snapshot", metavar="FILE")
    p.add_argument("-o", "--output", required=True, metavar="report.html")
    p.add_argument("--rank", type=int, default=None, help="the rank whose tree and charts are shown "
                                                          "(default: the run's lowest)")
    args = p.parse_args(list(argv))
    return export(args.output, run=args.run, snapshot=args.snapshot, rank=args.rank)


# -------------------------------------------------------------------------------- findings
def findings_main(argv: Sequence[str], prog: str = "modscope") -> int:
    """Print the active findings; 1 when one at ``--fail-on`` or worse exists, 2 when the store
    cannot be read."""
    from .commands import findings as fc

    p = _Parser(prog=f"{prog} findings", description=ABOUT["findings"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory (every run in it) or one store file")
    src.add_argument("--snapshot", metavar="FILE", help="a snapshot file")
    p.add_argument("--rank", type=int, default=None, help="only this rank (default: every rank, merged)")
    p.add_argument("--json", action="store_true", help="a JSON list of objects (code, severity, path, message, "
                                                       "fix, ranks, steps, cause, run)")
    p.add_argument("--fail-on", choices=fc.LEVELS, default=None, metavar="LEVEL",
                   help="exit 1 when a finding at LEVEL (error, warning or info) or worse exists")
    args = p.parse_args(list(argv))
    for option, value in (("--run", args.run), ("--snapshot", args.snapshot)):
        if value is not None:
            check_store_target(option, value)
    try:
        found = fc.collect(fc.open_runs(run=args.run, snapshot=args.snapshot), rank=args.rank)
    except fc.FindingsError as exc:
        fail(str(exc))
    print(fc.format_json(found) if args.json else fc.format_text(found, str(args.run or args.snapshot)))
    return fc.exit_status(found, args.fail_on)


# -------------------------------------------------------------------------------- run
_RUN_VALUE_OPTIONS = frozenset({"--run-dir", "--every", "--overhead", "--port"})


def split_run_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(modscope's options, target): the target starts at the first argument that is not one of
    ours (the script; everything after it is the script's), or is ``["-m", module, ...]``."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[:i], argv[i + 1:]
        if a == "-m":
            return argv[:i], argv[i:]
        if a.startswith("-m") and not a.startswith("--"):     # -mpackage.module, as python accepts it
            return argv[:i], ["-m", a[2:], *argv[i + 1:]]
        if not a.startswith("-") or a == "-":
            return argv[:i], argv[i:]
        i += 2 if a in _RUN_VALUE_OPTIONS else 1
    return argv, []


def run_main(argv: Sequence[str], prog: str = "modscope") -> int:
    """``modscope run``: the script runs in a child process (``python -m probes.launch.autorun``), so that
    this process never imports torch and the dashboard (``--serve``) never enters the training."""
    ours, target = split_run_argv(argv)
    p = _Parser(prog=f"{prog} run", usage=f"{prog} run {COMMANDS['run']}", description=ABOUT["run"],
                epilog="Watching starts at an optimizer's third step: the first shows that it exists, the "
                       "second which optimizers step together. Everything after the script goes to it.")
    p.add_argument("--run-dir", metavar="DIR", help="where the stores go (default: a new ./runs/<time>)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--every", type=every_option, metavar="N", help="sample every N-th step")
    rate.add_argument("--overhead", type=overhead_option, default=0.01, metavar="F",
                      help="overhead budget when --every is not given (default 0.01 = 1%%)")
    p.add_argument("--serve", action="store_true",
                   help="also serve the dashboard on the run (127.0.0.1); it stays up after the training "
                        "ends, until Ctrl-C")
    p.add_argument("--port", type=int, default=None, help="the dashboard's port with --serve (default 8050)")
    args = p.parse_args(ours)
    if not target or (target[0] == "-m" and len(target) < 2):
        p.error("expected a script to run (script.py [ARGS...]) or -m package.module [ARGS...]")
    if target[0] == "-m":
        check_module(target[1])
    elif Path(target[0]).is_dir():
        fail(f"{target[0]}: is a directory; expected a Python script to run")
    elif not Path(target[0]).is_file():
        fail(f"{target[0]}: no such file; expected a Python script to run")
    if args.port is not None and not args.serve:
        fail(f"--port {args.port}: only with --serve (the dashboard's port)")
    port = 8050 if args.port is None else args.port
    if args.serve:
        host, _ = check_serve_args("127.0.0.1", port, None)
        check_port(host, port)
    run_dir = Path(args.run_dir) if args.run_dir else _new_run_dir(Path("runs"))
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--run-dir {run_dir}: cannot create ({exc.strerror or exc})")
    rate_args = ["--every", str(args.every)] if args.every else ["--overhead", repr(args.overhead)]
    cmd = [sys.executable, "-m", "probes.launch.autorun", "--run-dir", str(run_dir), *rate_args, "--", *target]
    status = _supervise(cmd, run_dir, port if args.serve else None)
    if created:
        try:
            run_dir.rmdir()          # only when empty: nothing was watched (the script failed before training)
        except OSError:
            pass
    return status


def check_module(name: str) -> None:
    """``-m NAME`` whose top-level package is nowhere the child would look (this folder first, then
    this interpreter's path, which the child shares): python's own words, before anything starts. A
    submodule is left to the child: looking for it here would import its package."""
    import importlib.util
    from importlib.machinery import PathFinder

    top = name.split(".", 1)[0]
    try:
        if not top or PathFinder.find_spec(top, [os.getcwd()]) or importlib.util.find_spec(top):
            return
    except (ImportError, ValueError):      # a name python itself will judge
        return
    fail(f"-m {name}: No module named {top}")


def _new_run_dir(base: Path) -> Path:
    import datetime as _dt

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    d, n = base / stamp, 1
    while d.exists():
        n += 1
        d = base / f"{stamp}-{n}"
    return d


def child_env() -> dict[str, str]:
    """This environment, with the checkout on PYTHONPATH when running from one (a child started in
    another folder must import the same probes and dashboard); an installed copy adds nothing."""
    from .paths import source_checkout

    env = dict(os.environ)
    root = source_checkout()
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _terminal_sent_it() -> bool:
    """True when this process is in the foreground group of its terminal: a Ctrl-C there reached
    the training child (same group) already, and forwarding it would interrupt it twice."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


def _status(returncode: int) -> int:
    """A child's exit status as a shell reports it (killed by signal N: 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


def _supervise(cmd: list[str], run_dir: Path, serve_port: int | None) -> int:
    """Run the training child; forward SIGINT/SIGTERM to it; with ``serve_port``, run the
    dashboard as a second child that stays up after the training until Ctrl-C (or SIGTERM)."""
    env = child_env()
    server = None
    if serve_port is not None:
        from .commands.demo import die_with_parent

        # its own session: a Ctrl-C that stops the training leaves the dashboard up
        server = subprocess.Popen(
            [sys.executable, "-m", "dashboard.cli", "serve", "--run", str(run_dir), "--host", "127.0.0.1",
             "--port", str(serve_port)], env=env, stdout=sys.stderr, start_new_session=True,
            # no thread runs yet in this process: preexec_fn is safe here
            preexec_fn=die_with_parent())  # noqa: PLW1509  (see demo.start_demo)
    child = subprocess.Popen(cmd, env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None and not (signum == signal.SIGINT and _terminal_sent_it()):
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = _status(child.wait())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if server is not None:
        _serve_until_stopped(server, status)
    return status


def _serve_until_stopped(server: subprocess.Popen[Any], status: int) -> None:
    def stop(signum: int, frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        if server.poll() is None:
            print(f"modscope: the training exited with status {status}; the dashboard stays up until Ctrl-C",
                  file=sys.stderr, flush=True)
            server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        from .commands.demo import stop_demo
        stop_demo(server)


if __name__ == "__main__":
    sys.exit(main())
