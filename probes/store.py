"""The run store: one SQLite file (WAL) written by one background thread.

Training threads only enqueue ready-made SQL operations; they never touch the disk. A full
queue drops samples (counted). Structure, findings and errors go through a separate
unbounded control lane so they are never dropped.
"""
from __future__ import annotations

import collections
import os
import queue
import sqlite3
import threading
import time
from pathlib import Path

from .records import Op
from .schema import DDL, SCHEMA_VERSION

_SENTINEL = object()
FLUSH_INTERVAL = 0.5      # seconds: the most a sample waits before its commit
WAKE_AT = 64              # queued items that wake the writer early


class StoreError(RuntimeError):
    """A store that cannot be opened or written, with the path and the reason."""


def connect_writer(path: str | os.PathLike) -> sqlite3.Connection:
    """Open (creating if needed) a store for writing: WAL, schema, version check."""
    path = Path(path)
    try:
        conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path}: cannot open (SQLite says: {exc})") from None
    conn.execute("PRAGMA busy_timeout=30000")    # several ranks may share one file
    # Ranks starting together race for the first journal-mode switch, which SQLite answers with
    # SQLITE_BUSY at once instead of waiting: retry for a while.
    deadline = time.monotonic() + 60
    while True:
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                conn.close()
                raise StoreError(f"{path}: written by store schema version {version}; this probes library "
                                 f"writes version {SCHEMA_VERSION}. Upgrade modscope or use a new run_dir.")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")   # durable against a killed process; WAL commits are atomic
            conn.executescript(f"BEGIN IMMEDIATE; {DDL}; PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
            return conn
        except sqlite3.OperationalError as exc:
            busy = "locked" in str(exc) or "busy" in str(exc)
            if not busy or time.monotonic() > deadline:
                conn.close()
                what = "is locked by another process" if busy else f"cannot be written (SQLite says: {exc})"
                raise StoreError(f"{path}: {what}") from None
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            time.sleep(0.05)
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StoreError(f"{path}: not a modscope store (SQLite says: {exc})") from None


class StoreWriter:
    """One writer thread with a bounded queue, a sentinel shutdown and an idempotent close()."""

    def __init__(self, path: str | os.PathLike, max_queue: int = 512) -> None:
        self.path = Path(path)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._control: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self.dropped = 0
        self.written = 0
        self.write_errors = 0
        self.last_error: str | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="modscope-store-writer", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=60)
        if self._startup_error is not None:
            raise self._startup_error

    # -- producer side (training thread) ----------------------------------------------------
    def submit(self, ops: list[Op], droppable: bool = True) -> bool:
        """Queue ops for one transaction. Returns False when dropped (queue full or closed)."""
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
        """Wait until everything submitted so far is committed (bounded wait, never hangs)."""
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
    def _run(self) -> None:
        try:
            conn = connect_writer(self.path)
        except BaseException as exc:      # reported to the constructor, which raises it
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        stop = False
        try:
            while not stop:
                self._wake.wait(timeout=FLUSH_INTERVAL)
                self._wake.clear()
                batch: list[list[Op]] = []
                events: list[threading.Event] = []
                while self._control:
                    item = self._control.popleft()
                    if item is _SENTINEL:
                        stop = True
                    elif isinstance(item, threading.Event):
                        # everything queued before the flush request must be committed with it
                        batch.extend(self._drain())
                        events.append(item)
                    else:
                        batch.append(item)
                batch.extend(self._drain())
                if batch:
                    self._commit(conn, batch)
                for ev in events:
                    ev.set()
        finally:
            batch = self._drain()
            while self._control:
                item = self._control.popleft()
                if isinstance(item, threading.Event):
                    item.set()
                elif item is not _SENTINEL:
                    batch.append(item)
            if batch:
                self._commit(conn, batch)
            conn.close()

    def _drain(self) -> list[list[Op]]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _commit(self, conn: sqlite3.Connection, batch: list[list[Op]]) -> None:
        try:
            conn.execute("BEGIN IMMEDIATE")
            for ops in batch:
                for sql, rows in ops:
                    conn.executemany(sql, rows)
            conn.execute("COMMIT")
            self.written += len(batch)
        except sqlite3.Error as exc:
            self.write_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass

