"""``modscope run [OPTIONS] (script.py | -m module) [ARGS...]``: the training script runs in a child process
(``probes.launch.autorun``, started by :mod:`.children`: this process never imports torch), SIGINT and SIGTERM
are passed on, and with ``--serve`` the dashboard runs as a second child that stays up after the training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from probes.schema import every_option, overhead_option

from ..web.token_source import add_token_options, run_token, token_env
from .args import ABOUT, COMMANDS, Parser, check_port, check_serve_args, fail
from .children import new_run_dir, python_command

__all__ = ["check_module", "run_main", "split_run_argv"]


_RUN_VALUE_OPTIONS = frozenset({"--run-dir", "--every", "--overhead", "--port", "--token", "--token-file"})


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
    """``modscope run``: the script runs in a child process (``probes.launch.autorun``: commands/children.py), so
    that this process never imports torch and the dashboard (``--serve``) never enters the training."""
    ours, target = split_run_argv(argv)
    p = Parser(prog=f"{prog} run", usage=f"{prog} run {COMMANDS['run']}", description=ABOUT["run"],
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
    add_token_options(p, "the dashboard's access token with --serve (default: none on 127.0.0.1)")
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
    token = run_token(args)
    port = 8050 if args.port is None else args.port
    if args.serve:
        host, _ = check_serve_args("127.0.0.1", port, None)
        check_port(host, port)
    run_dir = Path(args.run_dir or "runs")
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not args.run_dir:
            run_dir, created = new_run_dir(run_dir), True
    except OSError as exc:
        fail(f"--run-dir {run_dir}: cannot create ({exc.strerror or exc})")
    rate_args = ["--every", str(args.every)] if args.every else ["--overhead", repr(args.overhead)]
    cmd = python_command("probes.launch.autorun", ["--run-dir", str(run_dir), *rate_args, "--", *target])
    status = _supervise(cmd, run_dir, port if args.serve else None, token)
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


def _supervise(cmd: list[str], run_dir: Path, serve_port: int | None, token: str | None = None) -> int:
    """Run the training child; forward SIGINT/SIGTERM to it; with ``serve_port``, run the
    dashboard as a second child that stays up after the training until Ctrl-C (or SIGTERM), its token (if any)
    in its environment (children.py: the environment is this one's, nothing added to the path)."""
    server = None
    if serve_port is not None:
        from ..demo import die_with_parent

        # its own session: a Ctrl-C that stops the training leaves the dashboard up
        server = subprocess.Popen(
            python_command("dashboard.cli", ["serve", "--run", str(run_dir), "--host", "127.0.0.1",
                                             "--port", str(serve_port)]),
            env=token_env(os.environ, token), stdout=sys.stderr, start_new_session=True,
            # no thread runs yet in this process: preexec_fn is safe here
            preexec_fn=die_with_parent())  # noqa: PLW1509  (see demo.start_demo)
    child = subprocess.Popen(cmd)

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
        from ..demo import stop_demo
        stop_demo(server)
