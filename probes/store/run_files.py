"""Opening the files modscope writes in a run directory that other users may be able to write to.

A shared job folder, a scratch directory with the sticky bit, a run directory on a cluster filesystem: the store's
name is predictable (``MODSCOPE_RUN_ID``, torchrun's rendezvous id), so another user can plant a symbolic link at
``<store>``, ``<store>.status`` or ``<store>.lock`` before the training starts, pointing at a file of the training's
user. Following it would overwrite that file. So every file modscope writes there is

- created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a name that exists already (a link included) is never opened as a
  new file, and a link is never followed;
- or, when it exists (a store or status a previous writer of the same run left, a stale lock), opened with
  ``O_NOFOLLOW`` and used only when it is a regular file of this user with one link (a hard link to another of the
  user's files would make a write land there);
- never removed unless it is such a file.

SQLite itself opens the store's ``-wal``, ``-shm`` and ``-journal`` with ``O_NOFOLLOW``; the store is claimed here
first, and :func:`check_sqlite_opened` makes sure the connection's file is the one claimed (SQLite resolves a link in
the store's name and says which file it opened).
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

__all__ = ["UnsafeRunFileError", "check_sqlite_opened", "claim", "read_own", "remove_own"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)      # a planted named pipe must not block the open


class UnsafeRunFileError(OSError):
    """A name in the run directory that modscope did not create (a link, a pipe, another user's file): one line
    naming the path and what is there."""


def _refusal(path: Path, what: str) -> UnsafeRunFileError:
    return UnsafeRunFileError(f"{path}: {what}; modscope writes only files it created itself and never follows a link "
                         "(another user of a shared run directory may have put it there): remove it, or use "
                         "another run_dir")


def _problem(st: os.stat_result) -> str | None:
    """Why an existing file may not be written to, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"a file of another user (uid {st.st_uid})"
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} hard links"
    return None


def _open_existing(path: Path, flags: int) -> int:
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        try:
            st = os.lstat(path)
        except OSError:
            raise exc from None
        problem = _problem(st)
        if problem is not None:
            raise _refusal(path, problem) from None
        raise
    try:
        problem = _problem(os.fstat(fd))
        if problem is not None:
            raise _refusal(path, problem)
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def claim(path: str | os.PathLike[str], *, mode: int = 0o644) -> tuple[int, bool]:
    """A read-write descriptor of ``path`` and whether this call created it: a new file exclusively, else an
    existing regular file of this user with one link (:class:`UnsafeRunFileError` for anything else)."""
    path = Path(path)
    for _ in range(3):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode), True
        except FileExistsError:
            pass
        try:
            return _open_existing(path, os.O_RDWR), False
        except FileNotFoundError:        # removed between the two opens: create it again
            continue
    raise _refusal(path, "keeps appearing and disappearing")


def read_own(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit`` bytes of an existing file of this user (never through a link, never blocking on a pipe)."""
    fd = _open_existing(Path(path), os.O_RDONLY)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def remove_own(path: str | os.PathLike[str]) -> bool:
    """Remove ``path`` when it is a file this user could have created there; leave anything else. True if removed."""
    try:
        if _problem(os.lstat(path)) is not None:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def check_sqlite_opened(conn: sqlite3.Connection, path: str | os.PathLike[str], fd: int) -> None:
    """Raise :class:`UnsafeRunFileError` unless ``conn``'s main database is the file behind ``fd`` (claimed at
    ``path``): a link swapped in between the claim and SQLite's open would make SQLite open its target (SQLite
    resolves links in a database's name, and ``PRAGMA database_list`` names the file it opened)."""
    path = Path(path)
    row = conn.execute("PRAGMA database_list").fetchone()
    opened = row[2] if row is not None else ""
    try:
        here, claimed = os.lstat(path), os.fstat(fd)
        same = (os.path.realpath(path) == opened and not stat.S_ISLNK(here.st_mode)
                and (here.st_dev, here.st_ino) == (claimed.st_dev, claimed.st_ino))
    except OSError:
        same = False
    if not same:
        raise _refusal(path, f"was replaced while it was opened (SQLite opened {opened or 'another file'})")
