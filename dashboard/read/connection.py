"""One store file opened for reading: its connections (one per thread, read-only, bounded by
:mod:`dashboard.read.store_guard`), its validation (file type, schema version, tables) and the parameterised,
row- and time-limited query every read goes through. The queries themselves are in the classes built on it
(:mod:`.module_queries`, :mod:`.finding_queries`, :mod:`.run_queries`, :mod:`.series_queries`);
:class:`dashboard.read.store.Store` is all of them."""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from probes.schema import (
    ADDED_COLUMNS,
    ADDED_TABLES,
    LEGACY_STORE_FILENAME,
    MIN_READ_VERSION,
    SCHEMA_VERSION,
    SEVERITY_ORDER,
    TABLES,
    Severity,
    WriterState,
    read_status,
)

from .errors import QueryTimeoutError, StoreError, StoreNotReadyError, one_line
from .files import _describe_db_error, _sqlite_uri, check_header, resolve_store_path, writer_present
from .liveness import (
    ChangeSignature,
    Heartbeat,
    Liveness,
    StoreInfo,
    WriteTrouble,
    liveness,
    process_alive,
    snapshot_liveness,
)
from .store_guard import UntrustedStoreError, checked_meta, fetch_bounded, loads_json, prepare

REMOVED = "removed"          # what a module (or tensor) no longer part of the model is shown as (modules.removed_step)


# Row limits (each query says how many rows it may return).
MAX_CHILDREN = 500          # children of one expanded node


MAX_SEARCH = 200            # search / filter results


MAX_DEPTH = 2048            # levels walked up the module tree (in SQL; torch itself nests about 1,000 at most)


MAX_FINDINGS = 2000


MAX_PARAMS = 1000           # parameter table of one module


MAX_POINTS = 1500           # points of one time series (downsampled above that)


MAX_HEAT_COLUMNS = 240      # columns of the histogram heat map


MAX_COMPARE_MODULES = 20000


MAX_KEYS = 50000


RECENT_STEPS = 32           # steps whose median duration sets the stall threshold


MAX_TENSORS = 50000         # tensors compared across ranks at one step


MAX_STEP_LIST = 5000        # sampled steps (or step times) listed per rank


Row = dict[str, Any]










def severity_rank(severity: object) -> int:
    """0 for an error, 1 for a warning, 2 for info; 9 for a severity this version does not know."""
    try:
        return SEVERITY_ORDER[Severity(str(severity))]
    except ValueError:
        return 9


def _severity_order_sql(column: str) -> str:
    whens = " ".join(f"WHEN '{s}' THEN {i}" for s, i in SEVERITY_ORDER.items())
    return f"CASE {column} {whens} ELSE 9 END"


def _loads(text: Any, default: Any = None) -> Any:
    return loads_json(text, default)         # bounded (store_guard.MAX_JSON_DEPTH)


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _int(x: Any, default: int = 0) -> int:
    return int(x) if isinstance(x, (int, float)) else default


_S = TypeVar("_S", bound="StoreBase")


class StoreBase:
    """Read access to one store file (a live run's rank, or a snapshot).

    ``live=True``: the file may not exist yet and is being written (WAL): opened read-only. With
    ``run_dir`` the file is looked for in that directory (again on every check) until one exists.
    ``live=False``: a snapshot, opened immutable; it must exist and be valid at once.
    """

    _RANK_COLS = ("world_size", "hostname", "pid", "model_class", "torch_version", "python_version", "device",
                  "sampling", "started_at", "updated_at", "closed_at", "status", "step", "samples_written",
                  "samples_dropped", "probe_errors", "overhead", "write_errors", "last_error")

    def __init__(self, path: str | os.PathLike[str], *, live: bool, timeout_s: float = 5.0,
                 run_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.live = live
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._ready = False
        self._columns: dict[str, frozenset[str]] = {}
        self.schema_note: str | None = None      # the foreign schema objects ignored (store_guard.prepare), one line
        if not live:
            self.validate()

    @property
    def where(self) -> Path:
        """What the user pointed at: the run directory that is followed, else the store file."""
        return self.run_dir if self.run_dir is not None else self.path

    # -- opening -----------------------------------------------------------------------
    @classmethod
    def open_run(cls: type[_S], run: str | os.PathLike[str], *, timeout_s: float = 5.0) -> _S:
        """Follow a run directory (or one store file) while it is written."""
        p = Path(run)
        if p.is_dir() or (not p.exists() and p.suffix != ".sqlite"):
            if p.parent.exists() and not p.parent.is_dir():
                raise StoreError(f"{p.parent}: not a directory")
            store = cls(resolve_store_path(p) or p / LEGACY_STORE_FILENAME, live=True, timeout_s=timeout_s,
                        run_dir=p)
        else:
            if p.parent.exists() and not p.parent.is_dir():
                raise StoreError(f"{p.parent}: not a directory")
            store = cls(p, live=True, timeout_s=timeout_s)
        store.ready()
        return store

    @classmethod
    def open_snapshot(cls: type[_S], path: str | os.PathLike[str], *, timeout_s: float = 5.0) -> _S:
        p = Path(path)
        run_dir = None
        if p.is_dir():
            found = resolve_store_path(p)
            if found is None:
                raise StoreError(f"{p}: no store in this directory")
            p, run_dir = found, p
        if writer_present(p):
            # a run's own file that a writer may still be writing (a -wal, a -journal or its .lock):
            # immutable=1 would ignore the -wal and read half-written pages, so read it like a live run
            store = cls(p, live=True, timeout_s=timeout_s)
            store.validate()
        else:
            store = cls(p, live=False, timeout_s=timeout_s)
        store.run_dir = run_dir          # a directory of runs (dashboard.read.run.RunDir reads all of it)
        return store

    @classmethod
    def open_any(cls: type[_S], target: str | os.PathLike[str], *, timeout_s: float = 5.0) -> _S:
        """A run directory (followed live) or a snapshot file."""
        p = Path(target)
        if p.is_dir():
            return cls.open_run(p, timeout_s=timeout_s)
        if not p.exists():
            raise StoreError(f"{p}: no such file or directory")
        # A store file: live while a writer may be at it (writer_present), else a snapshot.
        if writer_present(p):
            return cls.open_run(p, timeout_s=timeout_s)
        return cls.open_snapshot(p, timeout_s=timeout_s)

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(_sqlite_uri(self.path, immutable=not self.live), uri=True,
                                   check_same_thread=True, timeout=self.timeout_s)
            if self.live:
                conn.execute("PRAGMA user_version").fetchone()
        except sqlite3.OperationalError as exc:
            # A finished run (no -wal file) in a place we cannot write: a WAL-mode file then cannot
            # be opened read-only (SQLite needs to create the -shm file), but nothing writes it
            # any more, so it can be read as immutable.
            if self.live and ("unable to open" in str(exc) or "readonly" in str(exc)) and self.path.exists() \
                    and not writer_present(self.path):
                try:
                    conn = sqlite3.connect(_sqlite_uri(self.path, immutable=True), uri=True,
                                           check_same_thread=True, timeout=self.timeout_s)
                except sqlite3.Error as exc2:
                    raise StoreError(_describe_db_error(self.path, exc2)) from None
            else:
                raise StoreError(_describe_db_error(self.path, exc)) from None
        except sqlite3.Error as exc:
            raise StoreError(_describe_db_error(self.path, exc)) from None
        try:
            note = prepare(conn, self.path)   # bounded, audited, read through checked views (store_guard)
        except UntrustedStoreError as exc:
            conn.close()
            raise StoreError(str(exc)) from None
        except sqlite3.Error as exc:
            conn.close()
            raise StoreError(_describe_db_error(self.path, exc)) from None
        if note is not None and note != self.schema_note:
            self.schema_note = note
            logging.getLogger("modscope.store").warning(note)
        conn.row_factory = sqlite3.Row
        return conn

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
        return conn

    def validate(self, allow_missing: bool = False) -> StoreInfo | None:
        """Check file type, schema version and tables. Raise StoreError (one line);
        return None when ``allow_missing`` and the live store is not created yet."""
        if not check_header(self.path, allow_missing=allow_missing):
            return None
        try:
            conn = self._connect()
            try:
                version = int(conn.execute("PRAGMA user_version").fetchone()[0])
                tables = tuple(str(r[0]) for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type='table' LIMIT 1000"))
                columns = {t: frozenset(str(r[1]) for r in conn.execute(f"PRAGMA table_info({t})"))
                           for t in ADDED_COLUMNS if t in tables}
                if not self.live:
                    row = conn.execute("PRAGMA quick_check(1)").fetchone()
                    if row and row[0] != "ok":
                        raise StoreError(f"{self.path}: corrupt SQLite file ({row[0]})")
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreError(_describe_db_error(self.path, exc)) from None
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path}: written by schema version {version}, "
                             f"this dashboard reads up to {SCHEMA_VERSION}")
        missing = [t for t in TABLES if t not in tables and ADDED_TABLES.get(t, 0) <= max(version, 1)]
        if version == 0 or missing:
            first_tables = [t for t in TABLES if t not in ADDED_TABLES]
            if allow_missing and self.live and (version == 0 or len(missing) == len(first_tables)):
                return None  # the writer is still creating it
            if version == 0 and not missing:
                raise StoreError(f"{self.path}: not a modscope store (schema version not set)")
            raise StoreError(f"{self.path}: not a modscope store (missing tables: "
                             f"{', '.join(missing)})")
        if version < MIN_READ_VERSION:
            raise StoreError(f"{self.path}: written by schema version {version}, "
                             f"this dashboard reads {MIN_READ_VERSION} to {SCHEMA_VERSION}")
        self._columns = columns
        self._ready = True
        return StoreInfo(self.path, version, tables)

    def ready(self) -> bool:
        """True once the store exists with the schema. While a live store is not created yet this
        is False and checked again on every call (a followed run directory is searched again); a
        file that is there but cannot be read raises StoreError (one line), in every mode."""
        if self._ready:
            return True
        with self._lock:
            if self._ready:
                return True
            if self.run_dir is not None:
                found = resolve_store_path(self.run_dir)
                if found is not None:
                    self.path = found
            return self.validate(allow_missing=True) is not None

    def _select(self, table: str, columns: Sequence[str], alias: str = "") -> str:
        """``columns`` of ``table`` as a SELECT list; a column added after this store's schema
        version (``ADDED_COLUMNS``) that the file lacks reads as its default."""
        present = self._columns.get(table)
        defaults = dict(ADDED_COLUMNS.get(table, ()))
        out = []
        for c in columns:
            if present is not None and c in defaults and c not in present:
                out.append(f"{defaults[c]} AS {c}")
            else:
                out.append(f"{alias}.{c} AS {c}" if alias else c)
        return ", ".join(out)

    def _column(self, table: str, column: str, alias: str = "") -> str:
        """One column of ``table`` (as ``alias.column`` with an alias) as an expression (its default where this
        store's version lacks it)."""
        present = self._columns.get(table)
        defaults = dict(ADDED_COLUMNS.get(table, ()))
        if present is not None and column in defaults and column not in present:
            return defaults[column]
        return f"{alias}.{column}" if alias else column

    # -- the one query helper --------------------------------------------------------------
    def _query(self, sql: str, params: Sequence[Any] = (), *, limit: int | None = None) -> list[sqlite3.Row]:
        """Run one parameterised read. ``limit`` rows at most; aborted after timeout_s."""
        if not self.ready():
            raise StoreNotReadyError(f"{self.where}: waiting for the first sample")
        conn = self._conn()
        deadline = time.monotonic() + self.timeout_s
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 2000)
        cur = None
        try:
            cur = conn.execute(sql, tuple(params))
            rows = fetch_bounded(cur, limit, self.path)
        except UntrustedStoreError as exc:
            raise StoreError(str(exc)) from None
        except OverflowError:                 # a number of the request that SQLite cannot hold (an id from a URL)
            raise StoreError(f"{self.path}: a number in the request is out of range") from None
        except sqlite3.OperationalError as exc:
            if "interrupted" in str(exc):
                raise QueryTimeoutError(f"{self.path}: query took longer than {self.timeout_s:g} s") from None
            raise StoreError(_describe_db_error(self.path, exc)) from None
        except sqlite3.DatabaseError as exc:
            raise StoreError(_describe_db_error(self.path, exc)) from None
        finally:
            if cur is not None:
                # resets the statement, which ends its read transaction now: a reader holding one would keep the
                # writer's WAL checkpoint at close waiting (rows fetchmany left unread keep it open otherwise)
                cur.close()
            conn.set_progress_handler(None, 0)
        return rows

    def _one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        rows = self._query(sql, params, limit=1)
        return rows[0] if rows else None

    # -- run level -----------------------------------------------------------------------
    def meta(self) -> Row:
        rows = self._query("SELECT key, value FROM meta ORDER BY key LIMIT 500", limit=500)
        return checked_meta({r["key"]: _loads(r["value"], r["value"]) for r in rows})

    def ranks(self) -> list[int]:
        rows = self._query("SELECT rank FROM ranks ORDER BY rank LIMIT 4096", limit=4096)
        ranks = [int(r["rank"]) for r in rows]
        return ranks or [0]

    def last_step(self, rank: int = 0) -> int | None:
        row = self._one("SELECT MAX(step) AS s FROM steps WHERE rank = ?", (rank,))
        return None if row is None or row["s"] is None else int(row["s"])

    def _rank_row(self, rank: int) -> Row:
        row = self._one(f"SELECT {self._select('ranks', self._RANK_COLS)} FROM ranks WHERE rank = ?", (rank,))
        return dict(row) if row else {}

    def change_signature(self, rank: int = 0) -> ChangeSignature:
        """Cheap change detector for live polling (index-only queries)."""
        stats_step = self._one("SELECT MAX(step) AS s FROM module_stats WHERE rank = ?", (rank,))
        removed = self._column("modules", "removed_step")
        # a module that leaves the model changes no count of rows: what left it (and when) is counted too
        mods = self._one(f"SELECT COUNT(*) AS n, COUNT({removed}) AS r, SUM({removed}) AS rs, "
                         f"SUM(CASE WHEN {removed} IS NOT NULL THEN module_id + 1 END) AS ri "
                         "FROM modules WHERE rank = ?", (rank,))
        # not last_step: it moves with every sample; the tree's badges change only with these
        fnd = self._one("SELECT COUNT(*) AS n, SUM(active) AS a, SUM(LENGTH(code) * active) AS c, "
                        "SUM(LENGTH(path) * active) AS p, SUM(LENGTH(severity) * active) AS s "
                        "FROM findings WHERE rank = ?", (rank,))
        rk = self._one(f"SELECT status, samples_dropped, probe_errors, "
                       f"{self._select('ranks', ('write_errors',))} FROM ranks WHERE rank = ?", (rank,))
        return ChangeSignature(
            last_step=self.last_step(rank),
            stats_step=None if stats_step is None or stats_step["s"] is None else int(stats_step["s"]),
            structure=(*(_int(v) for v in (tuple(mods) if mods else (0,) * 4)),
                       *(_int(v) for v in (tuple(fnd) if fnd else (0,) * 5))),
            status=rk["status"] if rk else None,
            samples_dropped=_int(rk["samples_dropped"] if rk else 0),
            probe_errors=_int(rk["probe_errors"] if rk else 0),
            write_errors=_int(rk["write_errors"] if rk else 0),
        )

    def heartbeat(self, rank: int = 0) -> Heartbeat:
        rk = self._one("SELECT status, updated_at, pid, hostname FROM ranks WHERE rank = ?", (rank,))
        recent = [float(r["step_ms"]) for r in self._query(
            "SELECT step_ms FROM steps WHERE rank = ? AND step_ms IS NOT NULL ORDER BY step DESC LIMIT ?",
            (rank, RECENT_STEPS), limit=RECENT_STEPS)]
        return Heartbeat(status=rk["status"] if rk else None,
                         updated_at=float(rk["updated_at"]) if rk and rk["updated_at"] is not None else None,
                         pid=int(rk["pid"]) if rk and rk["pid"] is not None else None,
                         hostname=rk["hostname"] if rk else None,
                         median_step_s=statistics.median(recent) / 1000.0 if recent else None)

    def liveness(self, rank: int = 0, now: float | None = None) -> Liveness:
        """Running, closed, stalled (no heartbeat for max(2 min, 5 median steps)) or ended without
        close (its process is gone, known on this host only). A snapshot says what it recorded."""
        beat = self.heartbeat(rank)
        if not self.live:
            return snapshot_liveness(beat)
        return liveness(beat, now=time.time() if now is None else now, alive=process_alive(beat.pid, beat.hostname))

    def write_trouble(self, rank: int = 0) -> WriteTrouble | None:
        """Failed commits of this store: from the writer's status file (while it is failing, or
        after) and the store's own count (``ranks.write_errors``). None when there were none."""
        status = read_status(self.path) if self.live else None
        rk = self._one(f"SELECT samples_dropped, {self._select('ranks', ('write_errors', 'last_error'))} "
                       "FROM ranks WHERE rank = ?", (rank,))
        stored = _int(rk["write_errors"]) if rk else 0
        last_error = rk["last_error"] if rk else None
        if status is not None and status.state == WriterState.FAILING:
            return WriteTrouble(True, status.failing_since, status.error or last_error,
                                max(status.failed_commits, stored), status.dropped_samples)
        failed = max(stored, status.failed_commits if status is not None else 0)
        if not failed:
            return None
        dropped = status.dropped_samples if status is not None else _int(rk["samples_dropped"]) if rk else 0
        error = (status.error if status is not None else None) or last_error
        return WriteTrouble(False, None, one_line(error) if error else None, failed, dropped)
