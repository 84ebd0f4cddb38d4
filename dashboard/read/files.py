"""A store's files on disk: where a run directory's store is, whether a writer is at it, its header, and
snapshots of a run's stores into one new file."""

from __future__ import annotations

import os
import sqlite3
import tempfile
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from probes.schema import (
    LEGACY_STORE_FILENAME,
    LOCK_SUFFIX,
    parse_store_filename,
    snapshot,
)

from .errors import StoreError, StoreNotReadyError, one_line
from .store_guard import MAX_VALUE_BYTES, UntrustedStoreError

SQLITE_HEADER = b"SQLite format 3\x00"


def resolve_store_path(run_dir: str | os.PathLike[str]) -> Path | None:
    """The store a run directory holds: the legacy ``modscope.sqlite`` (schema version 1), else the
    newest run's (largest modification time of its files; a tie goes to the lexically largest run
    id) rank-0 file, or its lowest rank. None while the directory holds no store."""
    d = Path(run_dir)
    legacy = d / LEGACY_STORE_FILENAME
    if legacy.is_file():
        return legacy
    runs = rank_files(d)
    if not runs:
        return None
    newest = max(runs, key=lambda run_id: (max(last_modified(f) for _, f in runs[run_id]), run_id))
    return min(runs[newest])[1]


def rank_files(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, Path]]]:
    """A directory's per-rank store files by run id, each run's in rank order (no file opened; {} when the
    directory cannot be listed)."""
    runs: dict[str, list[tuple[int, Path]]] = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return runs
    for entry in entries:
        name = parse_store_filename(entry.name)
        if name is None:
            continue
        try:
            if not entry.is_file():
                continue
        except OSError:
            continue
        runs.setdefault(name.run_id, []).append((name.rank, Path(entry.path)))
    for files in runs.values():
        files.sort()
    return runs


def writer_present(path: str | os.PathLike[str]) -> bool:
    """Whether a writer may be writing the store at ``path``: its ``.lock`` (held by a live writer,
    whatever the journal mode), a ``-wal`` or a ``-journal`` is next to it. Such a file is never read
    as immutable: a run in rollback-journal mode (a multi-node job, a network filesystem) has no
    ``-wal`` while it is written."""
    base = str(path)
    return any(os.path.exists(base + suffix) for suffix in (LOCK_SUFFIX, "-wal", "-journal"))


def in_wal_mode(path: str | os.PathLike[str]) -> bool | None:
    """Whether the SQLite file at ``path`` is in WAL mode (its header's format versions are 2), or
    None when that cannot be read."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(20)
    except OSError:
        return None
    if len(head) < 20 or not head.startswith(SQLITE_HEADER):
        return None
    return head[18] == 2 and head[19] == 2


def last_modified(path: str | os.PathLike[str]) -> float:
    """When a writer last changed the store at ``path``: the newest modification time of the file and
    of its ``-wal`` / ``-journal`` when they hold something (a reader opening a WAL-mode store may create
    an empty ``-wal``: reading a run must not make it the newest). 0 when the file is missing."""
    best = 0.0
    for suffix in ("", "-wal", "-journal"):
        try:
            st = os.stat(str(path) + suffix)
        except OSError:
            continue
        if suffix and st.st_size == 0:
            continue
        best = max(best, st.st_mtime)
    return best


def _sqlite_uri(path: Path, immutable: bool) -> str:
    quoted = urllib.parse.quote(str(path.resolve()))
    return f"file:{quoted}?immutable=1" if immutable else f"file:{quoted}?mode=ro"


def _describe_db_error(path: Path, exc: BaseException) -> str:
    text = one_line(str(exc))
    if "not a database" in text or "file is encrypted" in text:
        return f"{path}: not an SQLite file"
    if "malformed" in text or "corrupt" in text:
        return f"{path}: corrupt SQLite file ({text})"
    if "too big" in text:
        return f"{path}: holds a string or blob longer than {MAX_VALUE_BYTES:,} bytes; modscope writes none (refused)"
    return f"{path}: cannot read the store ({text})"


def check_header(path: Path, *, allow_missing: bool = False) -> bool:
    """Check that ``path`` looks like an SQLite file. Return False if it is missing or
    empty and ``allow_missing`` (a live store not created yet); raise StoreError otherwise."""
    if not path.exists():
        if allow_missing:
            return False
        raise StoreError(f"{path}: no such file")
    if path.is_dir():
        raise StoreError(f"{path}: is a directory, not a store file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise StoreError(f"{path}: cannot open ({exc.strerror or exc})") from None
    if not head:
        if allow_missing:
            return False
        raise StoreError(f"{path}: empty file, not an SQLite store")
    if head != SQLITE_HEADER:
        raise StoreError(f"{path}: not an SQLite file")
    return True


def snapshot_bytes(paths: Sequence[Path]) -> bytes:
    """One consistent file of the stores at ``paths`` (the rank files of one run), as bytes:
    ``probes.schema.snapshot``, the one snapshot function (also behind ``w.snapshot(path)``)."""
    return snapshot_with_step(paths)[0]


def snapshot_with_step(paths: Sequence[Path], rank: int = 0) -> tuple[bytes, int | None]:
    """:func:`snapshot_bytes` and the newest step of ``rank`` in those very bytes (read from the copy,
    not from the store a writer may have moved on since: what a download's file name says)."""
    with tempfile.TemporaryDirectory(prefix="modscope-snap-") as d:
        dst = Path(d) / "snapshot.sqlite"
        step = snapshot_to(paths, dst, rank)
        return dst.read_bytes(), step


def snapshot_to(paths: Sequence[Path], dest: Path, rank: int = 0, *, timeout_s: float | None = None) -> int | None:
    """Write one consistent file of the stores at ``paths`` to ``dest`` (``probes.schema.snapshot``: streamed, no
    foreign schema object copied, bounded in time); returns the newest step of ``rank`` in that copy (what a
    download's file name says). StoreError (one line) when it cannot be made."""
    if not paths:
        raise StoreNotReadyError("nothing to snapshot yet: waiting for the first sample")
    try:
        snapshot(list(paths), dest, timeout_s=timeout_s)
        conn = sqlite3.connect(_sqlite_uri(dest, immutable=True), uri=True)
        try:
            row = conn.execute("SELECT MAX(step) FROM steps WHERE rank = ? AND typeof(step) = 'integer'",
                               (rank,)).fetchone()
        finally:
            conn.close()
        return int(row[0]) if row and row[0] is not None else None
    except UntrustedStoreError as exc:
        raise StoreError(str(exc)) from None
    except (sqlite3.Error, OSError, ValueError) as exc:
        raise StoreError(_describe_db_error(Path(paths[0]), exc)) from None


