"""The run store: one SQLite file per (run, rank), written by one background thread.

Training threads only enqueue ready-made SQL operations; they never touch the disk. A full queue drops
samples (counted). Structure, findings and errors go through a separate unbounded control lane so they
are never dropped by a full queue.

A commit that fails (disk full, I/O error) is counted (``write_errors``, ``last_error``; the samples in it
as dropped) and reported in ``<store>.status``, which is overwritten in place so that it can still be
written on a full disk. The writer keeps retrying; once a commit succeeds again it bumps ``recoveries``,
and the watcher writes the structure and the current findings again (what the failed commits held).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ..schema import ADDED_COLUMNS, DDL, SCHEMA_VERSION, WriterState, WriterStatus, encode_status, status_path
from . import run_files
from .records import Op

FLUSH_INTERVAL = 0.5      # seconds: the most a sample waits before its commit
ROWS_PER_STATEMENT = 32   # rows of one INSERT statement, for the thousands of rows of a sample (see _execute)
WAKE_AT = 64              # queued items that wake the writer early
RETRY_INTERVAL = 1.0      # seconds between commit attempts while commits fail
CHECKPOINT_WAIT_S = 10.0  # at close: how long the WAL checkpoint waits for readers to finish their reads
STATUS_INTERVAL = 5.0     # seconds between status reports while commits fail


class StoreError(RuntimeError):
    """A store that cannot be opened or written, with the path and the reason (one line)."""


@dataclasses.dataclass
class _Batch:
    """One commit: the items of several submits; ``samples`` of them were droppable."""

    items: list[list[Op]] = dataclasses.field(default_factory=list)
    samples: int = 0


@functools.lru_cache(maxsize=64)
def _multi_row(sql: str, rows: int) -> str | None:
    """``INSERT ... VALUES (?, ...) [ON CONFLICT ...]`` with ``rows`` rows of placeholders (None: another form)."""
    head, sep, rest = sql.partition(" VALUES (")
    if not sep:
        return None
    placeholders, sep, tail = rest.partition(")")
    if not sep or set(placeholders.replace(" ", "").split(",")) != {"?"}:
        return None
    one = f"({placeholders})"
    return f"{head} VALUES {', '.join([one] * rows)}{tail}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def connect_writer(path: str | os.PathLike[str], journal: str = "wal") -> sqlite3.Connection:
    """Open (creating if needed) a store for writing: journal mode, schema, version check. A store that
    cannot be created (a full disk) leaves no file behind."""
    path = Path(path)
    try:
        fd, created = run_files.claim(path)      # never through a link planted at the store's name
    except OSError as exc:
        raise StoreError(str(exc) if isinstance(exc, run_files.UnsafeRunFileError)
                         else f"{path}: cannot create ({exc.strerror or exc})") from None
    existed = not created
    try:
        conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
    except sqlite3.DatabaseError as exc:
        os.close(fd)
        if created:
            run_files.remove_own(path)
        raise StoreError(f"{path}: cannot open ({_one_line(exc)})") from None
    try:
        run_files.check_sqlite_opened(conn, path, fd)
    except run_files.UnsafeRunFileError as exc:
        conn.close()
        raise StoreError(str(exc)) from None
    finally:
        os.close(fd)
    # A reader that opened the file while it was being created (a dashboard started before the training)
    # makes the journal-mode switch fail with SQLITE_BUSY at once instead of waiting: retry for a while.
    deadline = time.monotonic() + 60
    try:
        conn.execute("PRAGMA busy_timeout=30000")
        while True:
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise StoreError(f"{path}: written by store schema version {version}; this probes library "
                                     f"writes version {SCHEMA_VERSION}. Upgrade modscope or use a new run_dir.")
                conn.execute(f"PRAGMA journal_mode={'WAL' if journal == 'wal' else 'DELETE'}")
                conn.execute("PRAGMA synchronous=NORMAL")   # durable against a killed process; commits are atomic
                upgrade = "".join(f"ALTER TABLE {table} ADD COLUMN {column} {decl};"
                                  for table, column, decl in _missing_columns(conn)) if version > 0 else ""
                conn.executescript(f"BEGIN IMMEDIATE; {DDL}; {upgrade} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
                return conn
            except sqlite3.OperationalError as exc:
                text = str(exc)
                if not ("locked" in text or "busy" in text) or time.monotonic() > deadline:
                    raise
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                time.sleep(0.05)
    except StoreError:
        conn.close()
        raise
    except sqlite3.DatabaseError as exc:
        conn.close()
        if not existed:
            _remove_store_files(path)
        text = _one_line(exc)
        if isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text):
            raise StoreError(f"{path}: is locked by another process") from None
        if "not a database" in text or "malformed" in text or "encrypted" in text:
            raise StoreError(f"{path}: not a modscope store ({text})") from None
        raise StoreError(f"{path}: cannot create the store ({_with_free_space(path, text)})") from None


LOW_SPACE_BYTES = 1 << 20


def _with_free_space(path: Path, sqlite_says: str) -> str:
    """SQLite reports a full disk as "database or disk is full" or, when the write-ahead log cannot grow,
    as a "disk I/O error": say which it is."""
    try:
        st = os.statvfs(path.parent)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return sqlite_says
    if free < LOW_SPACE_BYTES:
        return f"the disk is full: {free:,} bytes free; SQLite says: {sqlite_says}"
    return sqlite_says


def _missing_columns(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
    """Columns added since an older store was written: (table, column, declaration) to add."""
    out = []
    for table, added in ADDED_COLUMNS.items():
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        if not have:
            continue                   # the table itself is new: the DDL creates it whole
        decl = _declarations(table)
        out += [(table, column, decl[column]) for column, _ in added if column not in have]
    return out


def _declarations(table: str) -> dict[str, str]:
    """Column declarations of ``table`` as the DDL writes them (type and default, no comment)."""
    body = DDL.split(f"CREATE TABLE IF NOT EXISTS {table} (", 1)[1].split("\n);", 1)[0]
    out = {}
    for line in body.splitlines():
        words = line.split("--", 1)[0].strip().rstrip(",").split()
        if len(words) >= 2 and words[0].isidentifier() and words[0].upper() != "PRIMARY":
            out[words[0]] = " ".join(words[1:])
    return out


def checkpoint_wal(conn: sqlite3.Connection, wait_s: float = CHECKPOINT_WAIT_S) -> bool:
    """Copy the write-ahead log into the main file and truncate it to zero bytes, so that the main file alone
    holds the run once the writer has gone (the last connection to close does this itself, but a dashboard's
    open connection makes the writer's close not the last one). A reader in a read transaction makes the
    checkpoint wait (SQLite's busy handler); readers keep their reads short, so it waits at most ``wait_s``,
    trying again until then. True when the log was emptied."""
    deadline = time.monotonic() + wait_s
    try:
        conn.execute(f"PRAGMA busy_timeout={int(wait_s * 1000)}")
        while True:
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            if not busy:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except sqlite3.Error:
        return False


def _remove_store_files(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        run_files.remove_own(str(path) + suffix)


class StatusFile:
    """``<store>.status``: the writer's health, written at full size once and then overwritten in place
    (no new disk blocks), so that it can report a full disk."""

    def __init__(self, store_path: Path) -> None:
        self.path = status_path(store_path)
        self._fd: int | None = None
        try:
            self._fd, _ = run_files.claim(self.path)     # never through a planted link (run_files.py)
        except run_files.UnsafeRunFileError:
            raise
        except OSError:
            self._fd = None

    def write(self, status: WriterStatus) -> bool:
        if self._fd is None:
            return False
        try:
            os.pwrite(self._fd, encode_status(status), 0)
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class StoreWriter:
    """One writer thread with a bounded queue, a sentinel shutdown and an idempotent close()."""

    def __init__(self, path: str | os.PathLike[str], max_queue: int = 512, journal: str = "wal") -> None:
        self.path = Path(path)
        self.journal = journal
        self._queue: queue.Queue[list[Op]] = queue.Queue(maxsize=max_queue)
        self._control: collections.deque[list[Op] | threading.Event | object] = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self.dropped = 0              # samples lost: queue full, or their commit failed
        self.written = 0              # submits committed
        self.write_errors = 0         # commits that failed
        self.last_error: str | None = None
        self.recoveries = 0           # times commits succeeded again after failing
        self.failing_since: float | None = None
        self._status: StatusFile | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="modscope-store-writer", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=60)
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

    # -- producer side (training thread) ----------------------------------------------------
    def submit(self, ops: list[Op], droppable: bool = True) -> bool:
        """Queue ops for one transaction. Returns False when dropped (queue full, counted) or closed."""
        if self._closed:
            return False
        if not droppable:
            self._control.append(ops)
            self._wake.set()
            return True
        try:
            self._queue.put_nowait(ops)
        except queue.Full:
            self.dropped += 1
            return False
        if self._queue.qsize() >= WAKE_AT:      # otherwise the writer's timer (FLUSH_INTERVAL) picks it up:
            self._wake.set()                    # fewer, larger transactions and no wake-up per step
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is committed or has failed (bounded wait, never hangs)."""
        if self._closed or not self._thread.is_alive():
            return False
        done = threading.Event()
        self._control.append(done)
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._control.append(_SENTINEL)
        self._wake.set()
        self._thread.join(timeout)

    # -- writer thread -------------------------------------------------------------------------
    def _start(self) -> sqlite3.Connection | None:
        """The status file, then the store (a refused status leaves no store behind); None after a failure, which
        is reported to the constructor, which raises it."""
        try:
            try:
                self._status = StatusFile(self.path)
            except run_files.UnsafeRunFileError as exc:
                raise StoreError(str(exc)) from None
            return connect_writer(self.path, self.journal)
        except BaseException as exc:
            if self._status is not None:
                self._status.close()
            self._startup_error = exc
            self._ready.set()
            return None

    def _run(self) -> None:
        conn = self._start()
        if conn is None:
            return
        self._report()
        self._ready.set()
        stop = False
        try:
            while not stop:
                self._wake.wait(timeout=RETRY_INTERVAL if self.failing else FLUSH_INTERVAL)
                self._wake.clear()
                if self.failing and not stop:
                    time.sleep(0.05)            # do not spin on a failing disk
                batch = _Batch()
                events: list[threading.Event] = []
                while self._control:
                    item = self._control.popleft()
                    if item is _SENTINEL:
                        stop = True
                    elif isinstance(item, threading.Event):
                        # everything queued before the flush request must be committed with it
                        self._drain_into(batch)
                        events.append(item)
                    else:
                        batch.items.append(item)  # type: ignore[arg-type]
                self._drain_into(batch)
                if batch.items:
                    self._commit(conn, batch)
                for ev in events:
                    ev.set()
        finally:
            batch = _Batch()
            self._drain_into(batch)
            while self._control:
                item = self._control.popleft()
                if isinstance(item, threading.Event):
                    item.set()
                elif item is not _SENTINEL:
                    batch.items.append(item)  # type: ignore[arg-type]
            if batch.items:
                self._commit(conn, batch)
            if self.journal == "wal":
                checkpoint_wal(conn)
            conn.close()
            self._report()
            if self._status is not None:
                self._status.close()

    def _drain_into(self, batch: _Batch) -> None:
        while True:
            try:
                batch.items.append(self._queue.get_nowait())
                batch.samples += 1
            except queue.Empty:
                return

    def _commit(self, conn: sqlite3.Connection, batch: _Batch) -> None:
        try:
            conn.execute("BEGIN IMMEDIATE")
            for ops in batch.items:
                for sql, rows in ops:
                    self._execute(conn, sql, rows)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self.write_errors += 1
            self.dropped += batch.samples
            self.last_error = f"{type(exc).__name__}: {_with_free_space(self.path, _one_line(exc))}"
            first = self.failing_since is None
            if first:
                self.failing_since = time.time()
            if first or time.time() - self._last_report >= STATUS_INTERVAL:
                self._report()
            return
        self.written += len(batch.items)
        if self.failing_since is not None:
            self.failing_since = None
            self.recoveries += 1
            self._report()

    def _execute(self, conn: sqlite3.Connection, sql: str, rows: Sequence[tuple[object, ...]]) -> None:
        """executemany, with the rows of a large INSERT ROWS_PER_STATEMENT at a time. sqlite3 releases the GIL
        for each statement's step and takes it back to bind the next: a statement per row made thousands of
        GIL hand-overs per sample, each a wait for the training thread (a bare step of a 3,000-module model
        ran 1.8x slower while the writer wrote 5,000 rows in the same process; 1.3x with 32 rows a statement,
        and the writer took half the time)."""
        k = ROWS_PER_STATEMENT
        full = len(rows) - len(rows) % k
        if full >= k and sql.startswith("INSERT "):
            many = _multi_row(sql, k)
            if many is not None:
                # rows are read in order, once (a ColumnRows makes each row here, as it is bound)
                it = iter(rows)
                conn.executemany(many, (tuple(itertools.chain.from_iterable(itertools.islice(it, k)))
                                        for _ in range(full // k)))
                rows = list(it)
        if rows:
            conn.executemany(sql, rows)

    _last_report = 0.0

    def _report(self) -> None:
        if self._status is None:
            return
        self._last_report = time.time()
        self._status.write(WriterStatus(
            state=WriterState.FAILING if self.failing else WriterState.OK, updated_at=self._last_report,
            failing_since=self.failing_since, error=self.last_error, failed_commits=self.write_errors,
            dropped_samples=self.dropped))


_SENTINEL = object()
