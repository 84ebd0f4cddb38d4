"""What every subcommand shares: the command table, the parser with the project's error form (exit 2, one line
naming the value), and the checks of the arguments that name a host, a port, a token or a store. A check that
fails exits with status 2 and one line; nothing has started yet."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path
from typing import Any, NoReturn

from probes.schema import printable

__all__ = ["ABOUT", "COMMANDS", "Parser", "check_poll_ms", "check_port", "check_port_number", "check_run_path",
           "check_serve_args", "check_store_target", "checked_host", "fail"]


def fail(msg: str) -> NoReturn:
    # paths and names as typed: escaped, line by line (a list of run folders keeps its lines)
    print("\n".join(printable(line) for line in f"modscope: error: {msg}".split("\n")), file=sys.stderr)
    raise SystemExit(2)


def checked_host(host: str) -> str:
    """``--host`` validated and normalised (security.check_host), or exit 2 naming the value."""
    from ..web import security  # deferred, like Dash (which it imports): --help stays fast

    try:
        return security.check_host(host)
    except ValueError as exc:
        fail(str(exc))


def check_serve_args(host: str, port: int, token: str | None) -> tuple[str, str | None]:
    """Check ``--host``, ``--port`` and ``--token`` before anything starts (the demo, the
    server); returns the normalised host and the token."""
    from ..web import security

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
    from ..read.store import SQLITE_HEADER, Store, StoreError, writer_present

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
    from ..read.run_folders import run_folders, run_folders_text, waiting_text

    if not os.path.lexists(run):
        print(waiting_text(run), file=sys.stderr, flush=True)
        return
    folders = run_folders(run)
    if folders:
        fail(run_folders_text("--run", run, folders, command))


COMMANDS = {
    "serve": "(--run DIR | --snapshot FILE | --compare A B) [--host H] [--port P] [--token-file F]",
    "demo": "[--host H] [--port P] [--token-file F] [--runs-dir DIR] [--demo-arg ARG ...]",
    "export": "(--run DIR | --snapshot FILE) -o report.html [--rank R]",
    "findings": "(--run DIR | --snapshot FILE) [--rank R] [--json] [--fail-on error|warning|info]",
    "snapshot": "(--run DIR | --snapshot FILE) -o FILE [--rank R] [--timeout S]",
    "series": "(--run DIR | --snapshot FILE) --metric NAME [--rank R] [-o FILE]",
    "checkpoint": "FILE (--run DIR | --snapshot FILE) [--rank R]",
    "run": "[--run-dir DIR] [--every N | --overhead F] [--serve [--port P] [--token-file F]] "
           "(script.py | -m package.module) [ARGS...]",
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


class Parser(argparse.ArgumentParser):
    """argparse with the project's error form: exit 2 and one line naming the value. Options are
    never abbreviated: ``demo --run DIR`` would otherwise be taken for ``--runs-dir DIR``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(printable(f"{self.prog}: error: {message}"), file=sys.stderr)
        raise SystemExit(2)
