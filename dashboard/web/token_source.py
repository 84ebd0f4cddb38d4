"""Where the dashboard's access token comes from, so that it need not be on a command line.

A command line is readable by every user of the machine (``ps``, ``/proc/<pid>/cmdline``); a process's environment
and a file of mode 600 are readable by its own user only. So the token is taken, in this order, from ``--token``
(works, but is visible to everyone: docs/security.md), ``--token-file FILE`` (its first line) or the environment
variable ``MODSCOPE_TOKEN``; the processes modscope starts (``modscope run --serve``'s dashboard, ``w.show()``'s)
get it in ``MODSCOPE_TOKEN``, never as an argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
import sys
from collections.abc import Mapping
from typing import NoReturn

TOKEN_ENV = "MODSCOPE_TOKEN"
MAX_TOKEN_FILE_BYTES = 4096          # a token is one short line: a larger file is not a token file


class TokenError(ValueError):
    """A token that cannot be used: one line naming where it came from (never the token)."""


@dataclasses.dataclass(frozen=True)
class TokenChoice:
    """The token to require (None: none) and where it came from (``--token``, ``--token-file F``, the variable)."""

    token: str | None
    source: str = ""


def read_token_file(path: str) -> str:
    """The first line of ``path`` (surrounding blanks removed); TokenError naming the file otherwise."""
    where = f"--token-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise TokenError(f"{where}: cannot open ({exc.strerror or exc})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TokenError(f"{where}: not a regular file; expected a file holding the token on its first line")
        raw = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise TokenError(f"{where}: larger than {MAX_TOKEN_FILE_BYTES} bytes; expected the token on its first line")
    try:
        lines = raw.decode("utf-8").strip().splitlines()
    except UnicodeDecodeError:
        raise TokenError(f"{where}: not text; expected the token on its first line") from None
    if not lines or not lines[0].strip():
        raise TokenError(f"{where}: empty; expected the token on its first line")
    return lines[0].strip()


def _warn_if_readable(path: str) -> None:
    """A token file other users can read: the token is only as private as the file."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        print(f"modscope: warning: {path} can be read by other users (mode {mode:o}); chmod 600 {path}",
              file=sys.stderr, flush=True)


def choose_token(token: str | None, token_file: str | None, environ: Mapping[str, str] = os.environ) -> TokenChoice:
    """``--token``, else ``--token-file``, else ``MODSCOPE_TOKEN`` (an empty value counts as unset); checked as
    security.check_token checks a token, the message naming its source. Both options at once: TokenError."""
    from .security import check_token  # deferred: it imports Dash

    if token is not None and token_file is not None:
        raise TokenError("--token and --token-file: give one of them (or MODSCOPE_TOKEN in the environment)")
    if token is not None:
        choice = TokenChoice(token, "--token")
    elif token_file is not None:
        choice = TokenChoice(read_token_file(token_file), f"--token-file {token_file}")
    elif environ.get(TOKEN_ENV):
        choice = TokenChoice(environ[TOKEN_ENV], TOKEN_ENV)
    else:
        return TokenChoice(None)
    try:
        check_token(str(choice.token))
    except ValueError as exc:
        raise TokenError(str(exc).replace("--token", choice.source, 1)) from None
    if token_file is not None:
        _warn_if_readable(token_file)
    return choice


def token_env(environ: Mapping[str, str], token: str | None) -> dict[str, str]:
    """``environ`` for a dashboard process: ``MODSCOPE_TOKEN`` set to ``token``, or removed when there is none."""
    env = dict(environ)
    env.pop(TOKEN_ENV, None)
    if token:
        env[TOKEN_ENV] = token
    return env


# ---------------------------------------------------------------------------------- the command line
def add_token_options(p: argparse.ArgumentParser, about: str) -> None:
    p.add_argument("--token-file", metavar="FILE", help=f"{about}: the first line of FILE (or {TOKEN_ENV})")
    p.add_argument("--token", help="the token itself: visible to every user of this machine in the process list; "
                                   f"prefer --token-file or {TOKEN_ENV}")


def chosen_token(args: argparse.Namespace) -> str | None:
    """The token of a command line's ``--token`` / ``--token-file`` or ``MODSCOPE_TOKEN``, or exit 2 with one line
    (as dashboard/cli.py's errors)."""
    try:
        return choose_token(args.token, args.token_file).token
    except TokenError as exc:
        _fail(str(exc))


def run_token(args: argparse.Namespace) -> str | None:
    """``modscope run``'s token: its dashboard's (``--serve``), else none; a token option without it: exit 2."""
    if not args.serve and (args.token is not None or args.token_file is not None):
        _fail(f"{'--token' if args.token is not None else '--token-file'}: only with --serve (the dashboard's token)")
    return chosen_token(args) if args.serve else None


def _fail(msg: str) -> NoReturn:
    print(f"modscope: error: {msg}", file=sys.stderr)
    raise SystemExit(2)
