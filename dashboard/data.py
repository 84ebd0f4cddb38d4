"""Data access: every SQL statement of the dashboard lives in this module.

A :class:`Store` reads one store file (one rank's, a version-1 run's, or a snapshot);
:class:`dashboard.run.Run` reads the rank files of one run as one, on top of it. A store that a
writer may still be writing (a followed run; a file next to a ``-wal``, a ``-journal`` or the
writer's ``.lock``) is opened ``file:...?mode=ro``, whatever its journal mode; a snapshot that
nothing writes ``?immutable=1``. Every query is parameterised, row-limited (``LIMIT``) and
time-limited (a progress handler aborts it after ``timeout_s``).

What the store looks like (DDL, versions, file names, tables, finding codes and severities, path
grammar, snapshots, the writer's health sidecar) comes from :mod:`probes.schema`, the only thing
the dashboard imports from ``probes``. Stores of every version from ``MIN_READ_VERSION`` to
``SCHEMA_VERSION`` are read: a column added after a store's version (``schema.ADDED_COLUMNS``)
reads as its default.

The page modules only call the plain-data methods below (``overview()``, ``children()``,
``module_series()`` ...) which return dicts, lists and small frozen dataclasses, so they are
testable without a browser.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import statistics
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes.schema import (
    ADDED_COLUMNS,
    ADDED_TABLES,
    LEGACY_STORE_FILENAME,
    LOCK_SUFFIX,
    MIN_READ_VERSION,
    SCHEMA_VERSION,
    SEVERITY_ORDER,
    TABLES,
    ModuleKind,
    RunStatus,
    Severity,
    StrEnum,
    TensorKind,
    WriterState,
    decode_hist,
    module_path_candidates,
    normalize_path,
    parse_store_filename,
    read_status,
    snapshot,
)

SQLITE_HEADER = b"SQLite format 3\x00"
REMOVED = "removed"          # what a module (or tensor) no longer part of the model is shown as (modules.removed_step)

# Row limits (each query says how many rows it may return).
MAX_CHILDREN = 500          # children of one expanded node
MAX_SEARCH = 200            # search / filter results
MAX_FINDINGS = 2000
MAX_PARAMS = 1000           # parameter table of one module
MAX_POINTS = 1500           # points of one time series (downsampled above that)
MAX_HEAT_COLUMNS = 240      # columns of the histogram heat map
MAX_COMPARE_MODULES = 20000
MAX_KEYS = 50000
RECENT_STEPS = 32           # steps whose median duration sets the stall threshold
MAX_TENSORS = 50000         # tensors compared across ranks at one step
MAX_STEP_LIST = 5000        # sampled steps (or step times) listed per rank

# A running process whose heartbeat (ranks.updated_at) is older than this is "stalled".
STALL_MIN_S = 120.0
STALL_STEP_FACTOR = 5.0     # ... or than this many median step times, when steps are slow
STALL_BEHIND_MIN_S = 30.0   # a rank this far behind the other ranks' heartbeats is stalled (writers beat every 5 s)

Row = dict[str, Any]


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


class StoreError(Exception):
    """A store cannot be read; ``str()`` is one line naming the path and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class StoreNotReadyError(StoreError):
    """A live store that does not exist yet (or is still being created)."""


class QueryTimeoutError(StoreError):
    """A query ran past the store's time limit and was aborted."""


def severity_rank(severity: object) -> int:
    """0 for an error, 1 for a warning, 2 for info; 9 for a severity this version does not know."""
    try:
        return SEVERITY_ORDER[Severity(str(severity))]
    except ValueError:
        return 9


def _severity_order_sql(column: str) -> str:
    whens = " ".join(f"WHEN '{s}' THEN {i}" for s, i in SEVERITY_ORDER.items())
    return f"CASE {column} {whens} ELSE 9 END"


# -- which file -------------------------------------------------------------------------------------
def resolve_store_path(run_dir: str | os.PathLike[str]) -> Path | None:
    """The store a run directory holds: the legacy ``modscope.sqlite`` (schema version 1), else the
    newest run's (largest modification time of its files; a tie goes to the lexically largest run
    id) rank-0 file, or its lowest rank. None while the directory holds no store."""
    d = Path(run_dir)
    legacy = d / LEGACY_STORE_FILENAME
    if legacy.is_file():
        return legacy
    runs: dict[str, list[tuple[int, Path, float]]] = {}
    try:
        entries = list(os.scandir(d))
    except OSError:
        return None
    for entry in entries:
        name = parse_store_filename(entry.name)
        if name is None:
            continue
        try:
            if not entry.is_file():
                continue
        except OSError:
            continue
        runs.setdefault(name.run_id, []).append((name.rank, Path(entry.path), last_modified(entry.path)))
    if not runs:
        return None
    newest = max(runs, key=lambda run_id: (max(m for _, _, m in runs[run_id]), run_id))
    return min(runs[newest])[1]


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


def _loads(text: Any, default: Any = None) -> Any:
    if text is None:
        return default
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return default


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _int(x: Any, default: int = 0) -> int:
    return int(x) if isinstance(x, (int, float)) else default


# -- plain results ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreInfo:
    path: Path
    schema_version: int
    tables: tuple[str, ...]


@dataclass(frozen=True)
class ChangeSignature:
    """What live polling compares between two looks at a store: a page reads again only when
    this changed. ``structure`` changes only when the tree's rows or badges must change."""

    last_step: int | None
    stats_step: int | None
    structure: tuple[int, ...]     # modules, then active findings: count, code, path, severity sums
    status: str | None
    samples_dropped: int
    probe_errors: int
    write_errors: int


class RunState(StrEnum):
    """What the header says about the process writing a store."""

    RUNNING = "running"
    CLOSED = "closed"
    STALLED = "stalled"                          # alive (or elsewhere), but no heartbeat for a while
    ENDED = "ended without close"                # the process is gone and never closed the store
    COPIED_RUNNING = "running when copied"       # a snapshot taken while the run was running
    UNKNOWN = "unknown"                          # no rank row yet


@dataclass(frozen=True)
class Heartbeat:
    """What a store says about its writer's process (``ranks``)."""

    status: str | None
    updated_at: float | None
    pid: int | None
    hostname: str | None
    median_step_s: float | None

    def stall_after_s(self) -> float:
        """Silence longer than this is a stall: 2 min, or 5 median steps when steps are slower."""
        return max(STALL_MIN_S, STALL_STEP_FACTOR * (self.median_step_s or 0.0))


@dataclass(frozen=True)
class Liveness:
    state: RunState
    silent_s: float | None = None        # seconds since the last heartbeat (STALLED)


def process_alive(pid: int | None, hostname: str | None) -> bool | None:
    """Whether process ``pid`` lives, when it ran on this host; None when that cannot be known
    here (another host, no pid)."""
    if pid is None or pid <= 0 or not hostname or hostname != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                      # it exists, owned by someone else
    except OSError:
        return None
    return True


def liveness(beat: Heartbeat, *, now: float, alive: bool | None, behind_s: float | None = None) -> Liveness:
    """The state of a live store's writer from its heartbeat and (on this host) its process.

    ``behind_s``: how much older this writer's heartbeat is than the newest one of the other ranks
    of its run. A rank silent for max(``STALL_BEHIND_MIN_S``, 5 median steps) while the others go on
    is stalled at once (the 2-minute rule is for a run that is silent as a whole)."""
    if beat.status == RunStatus.CLOSED:
        return Liveness(RunState.CLOSED)
    if beat.status is None:
        return Liveness(RunState.UNKNOWN)
    if alive is False:
        return Liveness(RunState.ENDED)
    silent = None if beat.updated_at is None else max(0.0, now - beat.updated_at)
    if silent is not None and silent > beat.stall_after_s():
        return Liveness(RunState.STALLED, silent)
    behind_limit = max(STALL_BEHIND_MIN_S, STALL_STEP_FACTOR * (beat.median_step_s or 0.0))
    if silent is not None and behind_s is not None and behind_s > behind_limit:
        return Liveness(RunState.STALLED, silent)
    return Liveness(RunState.RUNNING)


def snapshot_liveness(beat: Heartbeat) -> Liveness:
    """What a snapshot (a store nothing writes any more) says of its writer: closed, or running when copied."""
    if beat.status is None:
        return Liveness(RunState.UNKNOWN)
    return Liveness(RunState.CLOSED if beat.status == RunStatus.CLOSED else RunState.COPIED_RUNNING)


def duration_text(seconds: float) -> str:
    """Seconds under a minute, else whole minutes (hours and days when longer): '40 s', '2 min',
    '1 h 5 min', '3 d 4 h'."""
    if seconds < 60:
        return f"{int(seconds)} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def status_text(life: Liveness) -> str:
    """What the header (and the per-rank table) says about a writer: 'running', 'closed',
    'stalled: no update for 3 min', 'ended without close (process gone)' ..."""
    if life.state is RunState.STALLED:
        return f"stalled: no update for {duration_text(life.silent_s or 0.0)}"
    if life.state is RunState.ENDED:
        return "ended without close (process gone)"
    if life.state is RunState.UNKNOWN:
        return "starting"
    return str(life.state)


@dataclass(frozen=True)
class WriteTrouble:
    """Commits of the store that failed (disk full, I/O error): now (``failing``) or earlier."""

    failing: bool
    failing_since: float | None
    error: str | None
    failed_commits: int
    dropped_samples: int


# -- the store --------------------------------------------------------------------------------------
class Store:
    """Read access to one store file (a live run's rank, or a snapshot).

    ``live=True``: the file may not exist yet and is being written (WAL): opened read-only. With
    ``run_dir`` the file is looked for in that directory (again on every check) until one exists.
    ``live=False``: a snapshot, opened immutable; it must exist and be valid at once.
    """

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
        if not live:
            self.validate()

    @property
    def where(self) -> Path:
        """What the user pointed at: the run directory that is followed, else the store file."""
        return self.run_dir if self.run_dir is not None else self.path

    # -- opening -----------------------------------------------------------------------
    @classmethod
    def open_run(cls, run: str | os.PathLike[str], *, timeout_s: float = 5.0) -> Store:
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
    def open_snapshot(cls, path: str | os.PathLike[str], *, timeout_s: float = 5.0) -> Store:
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
        store.run_dir = run_dir          # a directory of runs (dashboard.run.RunDir reads all of it)
        return store

    @classmethod
    def open_any(cls, target: str | os.PathLike[str], *, timeout_s: float = 5.0) -> Store:
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
            if allow_missing and self.live and (version == 0 or len(missing) == len([t for t in TABLES if t not in ADDED_TABLES])):
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
        try:
            cur = conn.execute(sql, tuple(params))
            rows = cur.fetchmany(limit) if limit is not None else cur.fetchall()
        except sqlite3.OperationalError as exc:
            if "interrupted" in str(exc):
                raise QueryTimeoutError(f"{self.path}: query took longer than {self.timeout_s:g} s") from None
            raise StoreError(_describe_db_error(self.path, exc)) from None
        except sqlite3.DatabaseError as exc:
            raise StoreError(_describe_db_error(self.path, exc)) from None
        finally:
            conn.set_progress_handler(None, 0)
        return rows

    def _one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        rows = self._query(sql, params, limit=1)
        return rows[0] if rows else None

    # -- run level -----------------------------------------------------------------------
    def meta(self) -> Row:
        rows = self._query("SELECT key, value FROM meta ORDER BY key LIMIT 500", limit=500)
        return {r["key"]: _loads(r["value"], r["value"]) for r in rows}

    def ranks(self) -> list[int]:
        rows = self._query("SELECT rank FROM ranks ORDER BY rank LIMIT 4096", limit=4096)
        ranks = [int(r["rank"]) for r in rows]
        return ranks or [0]

    def last_step(self, rank: int = 0) -> int | None:
        row = self._one("SELECT MAX(step) AS s FROM steps WHERE rank = ?", (rank,))
        return None if row is None or row["s"] is None else int(row["s"])

    _RANK_COLS = ("world_size", "hostname", "pid", "model_class", "torch_version", "python_version", "device",
                  "sampling", "started_at", "updated_at", "closed_at", "status", "step", "samples_written",
                  "samples_dropped", "probe_errors", "overhead", "write_errors", "last_error")

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

    def overview(self, rank: int = 0) -> Row:
        meta = self.meta()
        rkd = self._rank_row(rank)
        steps = self._one("SELECT COUNT(*) AS n, MAX(step) AS last, SUM(sampled) AS sampled, "
                          "SUM(probe_ms) AS probe_ms, SUM(step_ms) AS step_ms "
                          "FROM steps WHERE rank = ?", (rank,))
        sev = {str(s): 0 for s in Severity}
        for r in self._query("SELECT severity, COUNT(*) AS n FROM findings "
                             "WHERE rank = ? AND active = 1 GROUP BY severity LIMIT 10",
                             (rank,), limit=10):
            sev[r["severity"]] = r["n"]
        # the model as it is now: modules and tensors that left it are counted apart
        mods = {r["kind"]: r["n"] for r in self._query(
            f"SELECT CASE WHEN {self._current('modules')} THEN kind ELSE '{REMOVED}' END AS kind, COUNT(*) AS n "
            "FROM modules WHERE rank = ? GROUP BY 1 LIMIT 10", (rank,), limit=10)}
        params = self._one(
            f"SELECT COALESCE(SUM(CASE WHEN kind = '{TensorKind.PARAMETER}' THEN numel END), 0) AS total, "
            f"COALESCE(SUM(CASE WHEN kind = '{TensorKind.PARAMETER}' AND requires_grad = 1 THEN numel END), 0) "
            "AS trainable, "
            "COALESCE(SUM(CASE WHEN in_optimizer = 1 THEN numel END), 0) AS in_optimizer, "
            f"COALESCE(SUM(CASE WHEN kind = '{TensorKind.TENSOR}' THEN numel END), 0) AS unregistered, "
            "COALESCE(SUM(in_state_dict), 0) AS state_dict_tensors "
            f"FROM params WHERE rank = ? AND {self._current('params')}", (rank,))
        root = self._one("SELECT type FROM modules WHERE rank = ? AND parent_id IS NULL "
                         "ORDER BY module_id LIMIT 1", (rank,))
        overhead = rkd.get("overhead")
        if overhead is None and steps and steps["step_ms"]:
            overhead = (steps["probe_ms"] or 0.0) / steps["step_ms"]
        samples_stored = steps["sampled"] if steps and steps["sampled"] is not None else 0
        return {
            "path": str(self.path),
            "rank": rank,
            "live": self.live,
            "run_name": meta.get("run_name") or self.path.parent.name,
            "created_at": meta.get("created_at"),
            "model_class": rkd.get("model_class") or (root["type"] if root else None),
            "torch_version": rkd.get("torch_version"),
            "device": rkd.get("device"),
            "sampling": _loads(rkd.get("sampling"), rkd.get("sampling")),
            "status": rkd.get("status"),
            "world_size": rkd.get("world_size") or 1,
            # the newest step row (what the header says); the writer's counter before the first one
            "step": steps["last"] if steps and steps["last"] is not None else rkd.get("step"),
            "steps_recorded": steps["n"] if steps else 0,
            "samples_stored": samples_stored,
            "samples_written": rkd.get("samples_written", 0),
            "samples_dropped": rkd.get("samples_dropped", 0),
            "probe_errors": rkd.get("probe_errors", 0),
            "write_errors": rkd.get("write_errors", 0),
            "last_error": rkd.get("last_error"),
            "overhead": _finite(overhead),
            "findings": sev,
            "modules": {str(k): mods.get(str(k), 0) for k in ModuleKind},
            "modules_removed": mods.get(REMOVED, 0),       # no longer part of the model (removed or replaced)
            "params": dict(params) if params else {},
            "started_at": rkd.get("started_at"),
            "updated_at": rkd.get("updated_at"),
            "closed_at": rkd.get("closed_at"),
            "pid": rkd.get("pid"),
            "hostname": rkd.get("hostname"),
        }

    def loss_series(self, rank: int = 0, since_step: int | None = None, max_points: int = MAX_POINTS) -> Row:
        """Loss per step. With ``since_step``: only newer steps (live polling), raw.
        Otherwise downsampled to ``max_points`` buckets (mean loss per bucket)."""
        if since_step is not None:
            rows = self._query("SELECT step, loss FROM steps WHERE rank = ? AND step > ? "
                               "AND loss IS NOT NULL ORDER BY step LIMIT ?",
                               (rank, since_step, max_points), limit=max_points)
            return {"step": [r["step"] for r in rows], "loss": [_finite(r["loss"]) for r in rows],
                    "last": rows[-1]["step"] if rows else since_step}
        rng = self._one("SELECT COUNT(*) AS n, MIN(step) AS lo, MAX(step) AS hi FROM steps "
                        "WHERE rank = ? AND loss IS NOT NULL", (rank,))
        if not rng or not rng["n"]:
            return {"step": [], "loss": [], "last": self.last_step(rank)}
        bucket = max(1, math.ceil((rng["hi"] - rng["lo"] + 1) / max_points))
        rows = self._query("SELECT MAX(step) AS step, AVG(loss) AS loss FROM steps "
                           "WHERE rank = ? AND loss IS NOT NULL GROUP BY step / ? "
                           "ORDER BY step LIMIT ?", (rank, bucket, max_points + 1),
                           limit=max_points + 1)
        return {"step": [r["step"] for r in rows], "loss": [_finite(r["loss"]) for r in rows],
                "last": rng["hi"]}

    def probe_errors(self, rank: int = 0, limit: int = 200) -> list[Row]:
        return [dict(r) for r in self._query(
            "SELECT location, error_type, message, count, first_step, last_step FROM probe_errors "
            "WHERE rank = ? ORDER BY count DESC LIMIT ?", (rank, limit), limit=limit)]

    # -- module tree ---------------------------------------------------------------------
    # removed_step (v4; NULL in an older store): the step at which a module was found no longer part of the model.
    # Such a module keeps its row, statistics and findings; the tree, the counts and the totals are the model's now.
    _MODULE_COLS = ("module_id", "parent_id", "path", "name", "type", "type_module", "kind", "depth", "n_children",
                    "params_total", "params_trainable", "params_in_optimizer", "first_step", "removed_step")

    def _current(self, table: str, alias: str = "") -> str:
        """SQL: a row of ``table`` (modules, params) that is part of the model now."""
        return f"{self._column(table, 'removed_step', alias)} IS NULL"

    def _current_first(self, alias: str = "") -> str:
        """ORDER BY of modules that share a path: the module there now, then the latest removed from it."""
        removed = self._column("modules", "removed_step", alias)
        return f"({removed} IS NULL) DESC, {removed} DESC, {alias + '.' if alias else ''}module_id DESC"

    def _modules_where(self, where: str, params: Sequence[Any], order: str = "module_id", limit: int = 1
                       ) -> list[Row]:
        return [dict(r) for r in self._query(
            f"SELECT {self._select('modules', self._MODULE_COLS)} FROM modules WHERE {where} ORDER BY {order} "
            "LIMIT ?", (*params, limit), limit=limit)]

    def root(self, rank: int = 0) -> Row | None:
        rows = self._modules_where(f"rank = ? AND parent_id IS NULL AND {self._current('modules')}", (rank,))
        return rows[0] if rows else None

    def module(self, rank: int, module_id: int) -> Row | None:
        """One module, also one no longer part of the model (``removed_step`` says since when)."""
        rows = self._modules_where("rank = ? AND module_id = ?", (rank, module_id))
        return rows[0] if rows else None

    def module_by_path(self, rank: int, path: str) -> Row | None:
        """The module at ``path``: the one there now, else the one removed from it last."""
        rows = self._modules_where("rank = ? AND path = ?", (rank, path), order=self._current_first())
        return rows[0] if rows else None

    def module_like(self, rank: int, path: str, removed_step: int | None) -> Row | None:
        """Another rank's module at ``path`` in the same state: removed at ``removed_step`` too (ranks rebuild their
        index at the same sampled steps), else :meth:`module_by_path`'s."""
        if removed_step is not None:
            rows = self._modules_where(f"rank = ? AND path = ? AND {self._column('modules', 'removed_step')} = ?",
                                       (rank, path, removed_step), order="module_id DESC")
            if rows:
                return rows[0]
        return self.module_by_path(rank, path)

    def module_for_path(self, rank: int, path: str) -> Row | None:
        """The module a finding path belongs to: the path itself or its longest module prefix."""
        for candidate in module_path_candidates(path):
            m = self.module_by_path(rank, candidate)
            if m is not None:
                return m
        return None

    def children(self, rank: int, parent_id: int, limit: int = MAX_CHILDREN, *,
                 also: int | Iterable[int] | None = None) -> Row:
        """Children of one node that are part of the model now (registered first, in id order), and ``also``
        (a module id, or several: the one selected and its ancestors) when it is a child no longer part of it (the
        one selected, drawn where it was, under its parent removed with it); ``more`` counts the rest."""
        extra = [] if also is None else [also] if isinstance(also, int) else sorted({int(i) for i in also})[:256]
        marks = ", ".join(["?"] * len(extra)) or "-1"
        where = f"rank = ? AND parent_id = ? AND ({self._current('modules')} OR module_id IN ({marks}))"
        args = (rank, parent_id, *extra)
        rows = self._modules_where(where, args, order=f"{self._current('modules')} DESC, module_id", limit=limit + 1)
        more = 0
        if len(rows) > limit:
            n = self._one(f"SELECT COUNT(*) AS n FROM modules WHERE {where}", args)
            more = (n["n"] if n else len(rows)) - limit
        return {"items": rows[:limit], "more": more}

    def ancestors(self, rank: int, module_id: int) -> list[int]:
        """Ids from the root down to the parent of ``module_id``."""
        rows = self._query(
            "WITH RECURSIVE up(id, parent, lvl) AS ("
            " SELECT module_id, parent_id, 0 FROM modules WHERE rank = ? AND module_id = ?"
            " UNION ALL SELECT m.module_id, m.parent_id, up.lvl + 1 FROM modules m"
            " JOIN up ON m.rank = ? AND m.module_id = up.parent WHERE up.lvl < 256)"
            " SELECT id, lvl FROM up WHERE lvl > 0 ORDER BY lvl DESC LIMIT 300",
            (rank, module_id, rank), limit=300)
        return [int(r["id"]) for r in rows]

    def search_modules(self, rank: int = 0, text: str = "", code: str | None = None,
                       limit: int = MAX_SEARCH) -> Row:
        """Modules whose path or type contains ``text`` (case-insensitive) and, when ``code``
        is given, that carry an active finding with that code."""
        where = ["m.rank = ?"]
        params: list[Any] = [rank]
        text = (text or "").strip()
        if text:
            esc = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append("(m.path LIKE ? ESCAPE '\\' OR m.type LIKE ? ESCAPE '\\')")
            params += [f"%{esc}%", f"%{esc}%"]
        if code:
            where.append("EXISTS (SELECT 1 FROM findings f WHERE f.rank = m.rank "
                         "AND f.module_id = m.module_id AND f.code = ? AND f.active = 1)")
            params.append(code)
        # modules no longer part of the model are found too (marked by their removed_step), after those that are
        rows = self._query(f"SELECT {self._select('modules', self._MODULE_COLS, 'm')} "
                           f"FROM modules m WHERE {' AND '.join(where)} "
                           f"ORDER BY {self._current('modules', 'm')} DESC, m.depth, m.module_id LIMIT ?",
                           (*params, limit + 1),
                           limit=limit + 1)
        return {"items": [dict(r) for r in rows[:limit]], "truncated": len(rows) > limit}

    def findings_for_modules(self, rank: int, module_ids: Iterable[int]) -> dict[int, list[Row]]:
        """Active findings drawn on each of ``module_ids`` (code, severity, path), worst first."""
        ids = sorted({int(i) for i in module_ids})
        out: dict[int, list[Row]] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            for r in self._query(f"SELECT module_id, code, severity, path FROM findings "
                                 f"WHERE rank = ? AND active = 1 AND module_id IN ({marks}) "
                                 "LIMIT 20000", (rank, *chunk), limit=20000):
                out.setdefault(int(r["module_id"]), []).append(
                    {"code": r["code"], "severity": r["severity"], "path": r["path"]})
        for v in out.values():
            v.sort(key=lambda f: (severity_rank(f["severity"]), f["code"]))
        return out

    def subtree_finding_counts(self, rank: int = 0) -> dict[int, dict[str, int]]:
        """For every module on the way up from a finding: active findings below it (itself
        included) by severity. Lets a collapsed node say "2 errors inside" (not those drawn on a module no
        longer part of the model: the tree does not show it)."""
        rows = self._query(
            "WITH RECURSIVE up(id, sev, lvl) AS ("
            " SELECT f.module_id, f.severity, 0 FROM findings f JOIN modules m0"
            "  ON m0.rank = f.rank AND m0.module_id = f.module_id"
            f"  WHERE f.rank = ? AND f.active = 1 AND {self._current('modules', 'm0')}"
            " UNION ALL SELECT m.parent_id, up.sev, up.lvl + 1 FROM up JOIN modules m"
            "  ON m.rank = ? AND m.module_id = up.id WHERE m.parent_id IS NOT NULL AND up.lvl < 256)"
            " SELECT id, sev, COUNT(*) AS n FROM up GROUP BY id, sev LIMIT 100000",
            (rank, rank), limit=100000)
        out: dict[int, dict[str, int]] = {}
        for r in rows:
            out.setdefault(int(r["id"]), {})[str(r["sev"])] = int(r["n"])
        return out

    def default_expanded(self, rank: int = 0, findings: int = 3) -> list[int]:
        """Nodes to open on first view: the root and the ancestors of the first few
        error (then warning) findings, so the worst problems are visible at once."""
        root = self.root(rank)
        if root is None:
            return []
        ids = [int(root["module_id"])]
        rows = self._query("SELECT module_id FROM findings WHERE rank = ? AND active = 1 "
                           "AND severity IN (?, ?) AND module_id IS NOT NULL "
                           f"GROUP BY module_id ORDER BY MIN({_severity_order_sql('severity')}), "
                           "module_id LIMIT ?", (rank, Severity.ERROR, Severity.WARNING, findings), limit=findings)
        for r in rows:
            for a in self.ancestors(rank, r["module_id"]):
                if a not in ids:
                    ids.append(a)
        return ids

    # -- findings ------------------------------------------------------------------------
    _FINDING_COLS = ("code", "path", "severity", "module_id", "message", "fix", "evidence", "first_step",
                     "last_step", "active", "count", "cause_code", "cause_path")

    def findings(self, rank: int = 0, *, active: bool | None = True, module_id: int | None = None,
                 limit: int = MAX_FINDINGS) -> list[Row]:
        """Findings sorted by severity (error, warning, info), then path. Each has the columns of
        ``findings`` (``count``, ``cause_code``, ``cause_path`` read as 1, NULL, NULL in a version-1
        store), ``evidence`` decoded, the path of the module it is drawn on and, when that module is no longer part
        of the model, the step it left at (``module_removed_step``, else None)."""
        sql = (f"SELECT {self._select('findings', self._FINDING_COLS, 'f')}, m.path AS module_path, "
               f"{self._column('modules', 'removed_step', 'm')} AS module_removed_step "
               "FROM findings f LEFT JOIN modules m ON m.rank = f.rank AND m.module_id = f.module_id "
               "WHERE f.rank = ?")
        params: list[Any] = [rank]
        if active is not None:
            sql += " AND f.active = ?"
            params.append(1 if active else 0)
        if module_id is not None:
            sql += " AND f.module_id = ?"
            params.append(module_id)
        sql += f" ORDER BY {_severity_order_sql('f.severity')}, f.active DESC, f.path, f.code LIMIT ?"
        params.append(limit)
        out = []
        for r in self._query(sql, params, limit=limit):
            d = dict(r)
            d["evidence"] = _loads(d["evidence"], d["evidence"])
            out.append(d)
        return out

    def finding_codes(self, rank: int = 0) -> list[str]:
        return [str(r["code"]) for r in self._query(
            "SELECT DISTINCT code FROM findings WHERE rank = ? AND active = 1 ORDER BY code LIMIT 100",
            (rank,), limit=100)]

    # -- module detail --------------------------------------------------------------------
    _SERIES_COLS = ("mean", "std", "absmax", "zero_frac", "dead_frac", "sat_frac", "nonfinite",
                    "out_grad_norm", "calls")

    def module_series(self, rank: int, module_id: int, since_step: int | None = None,
                      max_points: int = MAX_POINTS) -> Row:
        """Per-step statistics of one module. ``since_step``: only newer rows (raw);
        otherwise the whole run downsampled to ``max_points`` buckets (bucket means)."""
        cols = self._SERIES_COLS
        rows: list[sqlite3.Row]
        if since_step is not None:
            rows = self._query(f"SELECT step, {', '.join(cols)} FROM module_stats WHERE rank = ? "
                               "AND module_id = ? AND step > ? ORDER BY step LIMIT ?",
                               (rank, module_id, since_step, max_points), limit=max_points)
        else:
            rng = self._one("SELECT COUNT(*) AS n, MIN(step) AS lo, MAX(step) AS hi "
                            "FROM module_stats WHERE rank = ? AND module_id = ?", (rank, module_id))
            if not rng or not rng["n"]:
                rows = []
            elif rng["n"] <= max_points:
                rows = self._query(f"SELECT step, {', '.join(cols)} FROM module_stats "
                                   "WHERE rank = ? AND module_id = ? ORDER BY step LIMIT ?",
                                   (rank, module_id, max_points), limit=max_points)
            else:
                bucket = max(1, math.ceil((rng["hi"] - rng["lo"] + 1) / max_points))
                agg = ", ".join(f"MAX({c}) AS {c}" if c in ("absmax", "nonfinite", "calls")
                                else f"AVG({c}) AS {c}" for c in cols)
                rows = self._query(f"SELECT MAX(step) AS step, {agg} FROM module_stats "
                                   "WHERE rank = ? AND module_id = ? GROUP BY step / ? "
                                   "ORDER BY step LIMIT ?",
                                   (rank, module_id, bucket, max_points + 1), limit=max_points + 1)
        out: Row = {"step": [r["step"] for r in rows]}
        for c in cols:
            out[c] = [_finite(r[c]) for r in rows]
        out["last"] = rows[-1]["step"] if rows else since_step
        return out

    def module_hist(self, rank: int, module_id: int, max_cols: int = MAX_HEAT_COLUMNS) -> Row:
        """Activation histograms over time: ``steps`` x ``HIST_BINS`` counts (columns thinned
        to ``max_cols``), with the bin edges from meta 'hist_edges'."""
        rng = self._one("SELECT COUNT(*) AS n, MIN(step) AS lo, MAX(step) AS hi FROM module_stats "
                        "WHERE rank = ? AND module_id = ? AND hist IS NOT NULL", (rank, module_id))
        edges_row = self._one("SELECT value FROM meta WHERE key = 'hist_edges'")
        edges = _loads(edges_row["value"], []) if edges_row else []
        if not rng or not rng["n"]:
            return {"step": [], "counts": [], "edges": edges}
        bucket = max(1, math.ceil((rng["hi"] - rng["lo"] + 1) / max_cols))
        rows = self._query("SELECT MAX(step) AS step, hist FROM module_stats WHERE rank = ? "
                           "AND module_id = ? AND hist IS NOT NULL GROUP BY step / ? ORDER BY step "
                           "LIMIT ?", (rank, module_id, bucket, max_cols + 1), limit=max_cols + 1)
        steps, counts = [], []
        for r in rows:
            h = decode_hist(r["hist"])          # schema 2 on: a uint16 blob; schema 1: a JSON list
            if h is not None:
                steps.append(r["step"])
                counts.append([float(x) for x in h])
        return {"step": steps, "counts": counts, "edges": edges}

    _PARAM_COLS = ("param_id", "path", "name", "shape", "numel", "dtype", "device", "kind", "requires_grad",
                   "registered", "is_parameter", "in_state_dict", "in_optimizer", "opt_index", "opt_group", "lr",
                   "aliases", "moved")
    _PARAM_STAT_COLS = ("grad_norm", "data_norm", "update_norm", "update_ratio", "local_grad_norm", "fingerprint")

    def module_params(self, rank: int, module_id: int, limit: int = MAX_PARAMS) -> list[Row]:
        """The parameters/buffers/tensors owned by a module, with their latest statistics: those stored
        under it (``p.module_id``) and those it owns by another name (a tied weight, stored once under
        its first path with the others in ``aliases``). Each row has ``shared_with``: the tensor's other
        paths (its primary ``path`` first for one owned by an alias, whose ``name`` is then the alias's)
        and ``primary``: whether this module is the one the tensor is stored (and counted) under."""
        m = self.module(rank, module_id)
        prefix = f"{m['path']}." if m is not None and m["path"] else ""
        # a candidate for an alias owned here: its JSON list holds a string starting with the module's path
        encoded = json.dumps(prefix)[1:-1]         # as the writer encodes it (probes.records: json.dumps)
        like = '%"' + encoded.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._query(
            f"SELECT {', '.join('p.' + c for c in self._PARAM_COLS)}, p.module_id AS owner_id, "
            "s.step AS stat_step, "
            f"{self._select('param_stats', self._PARAM_STAT_COLS, 's')}, "
            f"{self._column('param_stats', 'lr', 's')} AS step_lr "
            "FROM params p LEFT JOIN param_stats s ON s.rank = p.rank AND s.param_id = p.param_id "
            "AND s.step = (SELECT MAX(step) FROM param_stats WHERE rank = p.rank "
            "AND param_id = p.param_id) "
            "WHERE p.rank = ? AND (p.module_id = ? OR (p.aliases LIKE ? ESCAPE '\\' AND ? = 1)) "
            # a module of the model now: its tensors now; one removed: those it had (removed with it)
            f"AND ({self._current('params', 'p')} OR ? = 1) "
            "ORDER BY p.param_id LIMIT ?",
            (rank, module_id, like, int(m is not None), int(m is not None and m["removed_step"] is not None), limit),
            limit=limit)
        out = []
        for r in rows:
            d = dict(r)
            d["aliases"] = _loads(d["aliases"], []) or []
            owner = d.pop("owner_id")
            if owner == module_id:
                d["primary"] = True
                d["shared_with"] = [str(a) for a in d["aliases"]]
            else:
                # owned here by an alias naming a direct attribute of this module
                mine = [str(a) for a in d["aliases"]
                        if str(a).startswith(prefix) and "." not in str(a)[len(prefix):]]
                if not mine:
                    continue
                d["primary"] = False
                d["shared_with"] = [d["path"], *(str(a) for a in d["aliases"] if str(a) != mine[0])]
                d["path"], d["name"] = mine[0], mine[0][len(prefix):]
            d["shape"] = _loads(d["shape"])
            # the lr of the latest sampled step (a scheduler changes it); params.lr is the one at the index's
            # build, all an older store has
            step_lr = _finite(d.pop("step_lr"))
            d["lr"] = step_lr if step_lr is not None else _finite(d["lr"])
            for k in self._PARAM_STAT_COLS:
                d[k] = _finite(d[k])
            out.append(d)
        return out

    def optimizer_count(self, rank: int = 0) -> int:
        """How many optimizers hold parameters of this rank (distinct ``params.opt_index``)."""
        row = self._one("SELECT COUNT(DISTINCT opt_index) AS n FROM params WHERE rank = ? "
                        f"AND opt_index IS NOT NULL AND {self._current('params')}", (rank,))
        return _int(row["n"]) if row else 0

    def modules_for_paths(self, rank: int, paths: Iterable[str]) -> dict[str, Row]:
        """The module each finding path belongs to (the path itself or its longest module prefix), for
        many paths at once: one query per 500 candidate paths."""
        wanted = {p: module_path_candidates(p) for p in {str(x) for x in paths}}
        candidates = sorted({c for cs in wanted.values() for c in cs})
        found: dict[str, Row] = {}
        for start in range(0, len(candidates), 500):
            chunk = candidates[start:start + 500]
            marks = ",".join("?" * len(chunk))
            # the module at a path now first, else the one removed from it last
            for m in self._modules_where(f"rank = ? AND path IN ({marks})", (rank, *chunk),
                                         order=self._current_first(), limit=len(chunk) * 4):
                found.setdefault(m["path"], m)
        out = {}
        for p, cs in wanted.items():
            hit: Row | None = next((found[c] for c in cs if c in found), None)
            if hit is not None:
                out[p] = hit
        return out

    # -- across ranks (dashboard.run, dashboard.crossrank) ------------------------------------
    def rank_summary(self, rank: int) -> Row:
        """One rank's line of the Overview's per-rank table: the writer's row (host, pid, counters,
        heartbeat) and what its steps say (last step, samples stored, median of the recent step times,
        measured overhead)."""
        rkd = self._rank_row(rank)
        steps = self._one("SELECT COUNT(*) AS n, MAX(step) AS last, SUM(sampled) AS sampled, "
                          "SUM(probe_ms) AS probe_ms, SUM(step_ms) AS step_ms FROM steps WHERE rank = ?", (rank,))
        recent = [float(r["step_ms"]) for r in self._query(
            "SELECT step_ms FROM steps WHERE rank = ? AND step_ms IS NOT NULL ORDER BY step DESC LIMIT ?",
            (rank, RECENT_STEPS), limit=RECENT_STEPS)]
        overhead = rkd.get("overhead")
        if overhead is None and steps and steps["step_ms"]:
            overhead = (steps["probe_ms"] or 0.0) / steps["step_ms"]
        return {
            "rank": rank,
            "hostname": rkd.get("hostname"), "pid": rkd.get("pid"), "device": rkd.get("device"),
            "world_size": rkd.get("world_size") or 1, "status": rkd.get("status"),
            "step": steps["last"] if steps and steps["last"] is not None else rkd.get("step"),
            "median_step_ms": _finite(statistics.median(recent)) if recent else None,
            "overhead": _finite(overhead),
            "samples_stored": _int(steps["sampled"]) if steps else 0,
            "samples_dropped": _int(rkd.get("samples_dropped")),
            "probe_errors": _int(rkd.get("probe_errors")),
            "write_errors": _int(rkd.get("write_errors")),
            "updated_at": rkd.get("updated_at"),
        }

    def findings_signature(self, rank: int) -> tuple[int, ...]:
        """Changes whenever a finding of ``rank`` is added, resolved, seen again or changes severity
        or cause (one index-free pass over that rank's findings, a few thousand rows at most)."""
        row = self._one(f"SELECT COUNT(*) AS n, SUM(active) AS a, SUM({self._column('findings', 'count')}) "
                        "AS c, SUM(COALESCE(last_step, 0)) AS l, SUM(LENGTH(severity) * active) AS s, "
                        f"SUM(LENGTH(COALESCE({self._column('findings', 'cause_code')}, ''))) AS k "
                        "FROM findings WHERE rank = ?", (rank,))
        return tuple(_int(v) for v in (tuple(row) if row else (0,) * 6))

    def sampled_steps(self, rank: int, limit: int = MAX_STEP_LIST) -> list[int]:
        """The newest ``limit`` sampled steps of ``rank``, newest first."""
        return [int(r["step"]) for r in self._query(
            "SELECT step FROM steps WHERE rank = ? AND sampled = 1 ORDER BY step DESC LIMIT ?",
            (rank, limit), limit=limit)]

    def step_times(self, rank: int, limit: int = MAX_STEP_LIST) -> list[tuple[int, float]]:
        """(step, step_ms) of the newest ``limit`` steps of ``rank`` that have a duration, newest first."""
        return [(int(r["step"]), float(r["step_ms"])) for r in self._query(
            "SELECT step, step_ms FROM steps WHERE rank = ? AND step_ms IS NOT NULL ORDER BY step DESC LIMIT ?",
            (rank, limit), limit=limit)]

    def tensor_values(self, rank: int, step: int, limit: int = MAX_TENSORS) -> dict[str, tuple[Any, Any]]:
        """What replicas must agree on, for every tensor of ``rank`` with statistics at ``step``:
        path -> (fingerprint, data_norm) (NULL fingerprints in a version-1 store)."""
        rows = self._query(
            f"SELECT p.path AS path, {self._select('param_stats', ('fingerprint', 'data_norm'), 's')} "
            "FROM param_stats s JOIN params p ON p.rank = s.rank AND p.param_id = s.param_id "
            "WHERE s.rank = ? AND s.step = ? LIMIT ?", (rank, step, limit), limit=limit)
        return {str(r["path"]): (r["fingerprint"], r["data_norm"]) for r in rows}

    def tensor_history(self, rank: int, paths: Iterable[str], since_step: int,
                       limit: int = MAX_TENSORS) -> dict[str, list[tuple[int, Any, Any]]]:
        """(step, fingerprint, data_norm) of the tensors at ``paths`` from ``since_step`` on, oldest
        first (index seeks on (rank, param_id, step))."""
        names = sorted({str(x) for x in paths})[:500]
        if not names:
            return {}
        marks = ",".join("?" * len(names))
        ids = {int(r["param_id"]): str(r["path"]) for r in self._query(
            f"SELECT param_id, path FROM params WHERE rank = ? AND path IN ({marks}) LIMIT ?",
            (rank, *names, len(names) * 4), limit=len(names) * 4)}
        if not ids:
            return {}
        id_marks = ",".join("?" * len(ids))
        out: dict[str, list[tuple[int, Any, Any]]] = {}
        for r in self._query(
                f"SELECT param_id, step, {self._select('param_stats', ('fingerprint', 'data_norm'))} FROM param_stats "
                f"WHERE rank = ? AND param_id IN ({id_marks}) AND step >= ? ORDER BY step DESC LIMIT ?",
                (rank, *ids, since_step, limit), limit=limit):
            out.setdefault(ids[int(r["param_id"])], []).append((int(r["step"]), r["fingerprint"], r["data_norm"]))
        for rows in out.values():
            rows.reverse()
        return out

    # -- whole-store views (compare, report) -------------------------------------------------
    def state_dict_keys(self, rank: int = 0, limit: int = MAX_KEYS) -> list[str]:
        """The keys a checkpoint (``model.state_dict()``) of this model (as it is now) would hold."""
        keys: set[str] = set()
        for r in self._query("SELECT path, aliases FROM params WHERE rank = ? AND in_state_dict = 1 "
                             f"AND {self._current('params')} ORDER BY param_id LIMIT ?", (rank, limit), limit=limit):
            keys.add(r["path"])
            for a in _loads(r["aliases"], []) or []:
                if isinstance(a, str):
                    keys.add(a)
        return sorted(keys)

    def checkpoint_tensors(self, rank: int = 0, limit: int = MAX_KEYS) -> list[Row]:
        """The model's tensors as a checkpoint sees them (``modscope checkpoint``): every current ``params`` row
        (registered ones with ``in_state_dict`` and ``aliases``, and the unregistered ones no state_dict holds),
        with the path and kind of the module that holds it."""
        return [dict(r) for r in self._query(
            "SELECT p.path, p.aliases, p.shape, p.numel, p.dtype, p.kind, p.requires_grad, p.registered, "
            "p.is_parameter, p.in_state_dict, m.path AS module_path, m.kind AS module_kind, m.type AS module_type "
            "FROM params p LEFT JOIN modules m ON m.rank = p.rank AND m.module_id = p.module_id "
            f"WHERE p.rank = ? AND {self._current('params', 'p')} ORDER BY p.param_id LIMIT ?", (rank, limit),
            limit=limit)]

    def all_modules(self, rank: int = 0, limit: int = MAX_COMPARE_MODULES, *, removed: bool = False) -> list[Row]:
        """The modules of the model as it is now (``removed``: those no longer part of it instead), by id."""
        current = self._current("modules")
        return self._modules_where(f"rank = ? AND {f'NOT ({current})' if removed else current}", (rank,), limit=limit)

    def latest_module_stats(self, rank: int = 0, limit: int = MAX_COMPARE_MODULES) -> dict[int, Row]:
        """Each module's most recent statistics row (one index seek per module)."""
        rows = self._query(
            "SELECT s.module_id, s.step, s.mean, s.std, s.dead_frac, s.sat_frac, s.nonfinite, "
            "s.out_grad_norm FROM modules m JOIN module_stats s ON s.rank = m.rank "
            "AND s.module_id = m.module_id AND s.step = (SELECT MAX(step) FROM module_stats "
            "WHERE rank = m.rank AND module_id = m.module_id) WHERE m.rank = ? LIMIT ?",
            (rank, limit), limit=limit)
        return {int(r["module_id"]): {k: _finite(r[k]) for k in r.keys()} for r in rows}  # noqa: SIM118

    def final_loss(self, rank: int = 0) -> float | None:
        row = self._one("SELECT loss FROM steps WHERE rank = ? AND loss IS NOT NULL "
                        "ORDER BY step DESC LIMIT 1", (rank,))
        return None if row is None else _finite(float(row["loss"]))

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot_bytes(self) -> bytes:
        """A consistent single-file copy of this store (``probes.schema.snapshot``), as bytes."""
        if not self.ready():
            raise StoreNotReadyError(f"{self.where}: waiting for the first sample")
        return snapshot_bytes([self.path])


def snapshot_bytes(paths: Sequence[Path]) -> bytes:
    """One consistent file of the stores at ``paths`` (the rank files of one run), as bytes:
    ``probes.schema.snapshot``, the one snapshot function (also behind ``w.snapshot(path)``)."""
    return snapshot_with_step(paths)[0]


def snapshot_with_step(paths: Sequence[Path], rank: int = 0) -> tuple[bytes, int | None]:
    """:func:`snapshot_bytes` and the newest step of ``rank`` in those very bytes (read from the copy,
    not from the store a writer may have moved on since: what a download's file name says)."""
    if not paths:
        raise StoreNotReadyError("nothing to snapshot yet: waiting for the first sample")
    with tempfile.TemporaryDirectory(prefix="modscope-snap-") as d:
        try:
            dst = snapshot(list(paths), Path(d) / "snapshot.sqlite")
            conn = sqlite3.connect(_sqlite_uri(dst, immutable=True), uri=True)
            try:
                row = conn.execute("SELECT MAX(step) FROM steps WHERE rank = ?", (rank,)).fetchone()
            finally:
                conn.close()
            return dst.read_bytes(), (int(row[0]) if row and row[0] is not None else None)
        except (sqlite3.Error, OSError, ValueError) as exc:
            raise StoreError(_describe_db_error(Path(paths[0]), exc)) from None


# -- root causes (every page counts and folds findings with these) ---------------------------
def fold_causes(items: Sequence[Mapping[str, Any]]) -> list[Row]:
    """Root causes with their consequences folded under them: a finding whose ``cause_code`` /
    ``cause_path`` names another finding of ``items`` goes into the ``consequences`` of the root
    cause at the end of that chain; the others (root causes, and consequences whose cause is not
    among ``items``) come back in their order, each with its ``consequences`` list."""
    keyed: dict[tuple[str, str], Mapping[str, Any]] = {}
    for f in items:
        keyed.setdefault((str(f["code"]), str(f["path"])), f)

    def root_of(f: Mapping[str, Any]) -> tuple[str, str] | None:
        """The root cause ``f`` folds under (None: ``f`` is shown on its own). Causes that name each
        other in a circle (a writer's mistake) fold under the smallest of them, which stays visible."""
        own = (str(f["code"]), str(f["path"]))
        chain = [own]
        cur = f
        while cur.get("cause_code"):
            nxt = (str(cur["cause_code"]), str(cur.get("cause_path") or ""))
            if nxt not in keyed:
                break
            if nxt in chain:
                rep = min(chain[chain.index(nxt):])
                return None if rep == own else rep
            chain.append(nxt)
            cur = keyed[nxt]
        return None if len(chain) == 1 else chain[-1]

    roots: list[Row] = []
    index: dict[tuple[str, str], Row] = {}
    folded: dict[tuple[str, str], list[Row]] = {}
    for f in items:
        r = root_of(f)
        if r is None:
            row = {**f, "consequences": []}
            roots.append(row)
            index.setdefault((str(f["code"]), str(f["path"])), row)
        else:
            folded.setdefault(r, []).append({**f, "consequences": []})
    for key, consequences in folded.items():
        if key in index:
            index[key]["consequences"] = consequences
    return roots


def root_counts(roots: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Root causes by severity (a severity this version does not know counts as info)."""
    out = {str(s): 0 for s in Severity}
    for f in roots:
        sev = str(f["severity"]) if str(f["severity"]) in out else Severity.INFO.value
        out[sev] += 1
    return out


# -- compare ---------------------------------------------------------------------------------
_STAT_KEYS = ("mean", "std", "dead_frac", "sat_frac", "out_grad_norm")


def _codes(findings: list[Row]) -> list[Row]:
    """Distinct finding codes of one module, worst severity first: [{"code", "severity"}]."""
    seen: dict[str, str] = {}
    for f in findings:
        seen.setdefault(f["code"], f["severity"])
    return sorted(({"code": c, "severity": v} for c, v in seen.items()),
                  key=lambda d: (severity_rank(d["severity"]), d["code"]))


def _finding_order(f: Mapping[str, Any]) -> tuple[int, str, str]:
    return severity_rank(f["severity"]), f["path"], f["code"]


def compare_stores(a: Store, b: Store, rank: int = 0, limit: int = MAX_COMPARE_MODULES, *,
                   rank_b: int | None = None, findings_a: Sequence[Row] | None = None,
                   findings_b: Sequence[Row] | None = None) -> Row:
    """The "before / after" table of two stores: summary, findings appeared/resolved,
    checkpoint keys added/removed, and per-module statistics then (a) and now (b).
    Modules are matched by normalised path (``blocks[0]`` ~ ``blocks.0``). ``rank`` of ``a`` is
    compared with ``rank_b`` (default: the same rank) of ``b``; ``findings_a``/``findings_b`` replace
    each side's own active findings (a run's findings merged over its ranks: dashboard.run)."""
    rb = rank if rank_b is None else rank_b
    ova, ovb = a.overview(rank), b.overview(rb)
    fa_list = list(findings_a) if findings_a is not None else a.findings(rank, active=True)
    fb_list = list(findings_b) if findings_b is not None else b.findings(rb, active=True)

    sev_a, sev_b = root_counts(fold_causes(fa_list)), root_counts(fold_causes(fb_list))

    def summary_row(label: str, va: Any, vb: Any) -> Row:
        return {"metric": label, "a": va, "b": vb, "changed": va != vb}

    unregistered = (ModuleKind.UNREGISTERED, ModuleKind.RUNTIME)
    keys_a, keys_b = set(a.state_dict_keys(rank)), set(b.state_dict_keys(rb))
    summary = [
        summary_row("model class", ova["model_class"], ovb["model_class"]),
        summary_row("registered modules", ova["modules"][ModuleKind.REGISTERED],
                    ovb["modules"][ModuleKind.REGISTERED]),
        summary_row("unregistered modules", sum(ova["modules"][k] for k in unregistered),
                    sum(ovb["modules"][k] for k in unregistered)),
        summary_row("parameters (registered)", ova["params"].get("total", 0), ovb["params"].get("total", 0)),
        summary_row("trainable", ova["params"].get("trainable", 0), ovb["params"].get("trainable", 0)),
        summary_row("held by optimizer", ova["params"].get("in_optimizer", 0),
                    ovb["params"].get("in_optimizer", 0)),
        summary_row("checkpoint keys", len(keys_a), len(keys_b)),
        # root causes, as the Overview, the Findings tab and the report count them
        summary_row("errors", sev_a[Severity.ERROR], sev_b[Severity.ERROR]),
        summary_row("warnings", sev_a[Severity.WARNING], sev_b[Severity.WARNING]),
        summary_row("last step", ova["step"], ovb["step"]),
        summary_row("final loss", a.final_loss(rank), b.final_loss(rb)),
    ]

    fa = {(f["code"], normalize_path(f["path"])): f for f in fa_list}
    fb = {(f["code"], normalize_path(f["path"])): f for f in fb_list}
    appeared = [fb[k] for k in fb if k not in fa]
    resolved = [fa[k] for k in fa if k not in fb]
    persisting = [fb[k] for k in fb if k in fa]

    mods_a = {normalize_path(m["path"]): m for m in a.all_modules(rank, limit)}
    mods_b = {normalize_path(m["path"]): m for m in b.all_modules(rb, limit)}
    stats_a, stats_b = a.latest_module_stats(rank, limit), b.latest_module_stats(rb, limit)
    codes_a = a.findings_for_modules(rank, [m["module_id"] for m in mods_a.values()])
    codes_b = b.findings_for_modules(rb, [m["module_id"] for m in mods_b.values()])

    order = list(mods_b.keys()) + [k for k in mods_a if k not in mods_b]
    modules = []
    for key in order:
        ma, mb = mods_a.get(key), mods_b.get(key)
        sa = stats_a.get(ma["module_id"], {}) if ma else {}
        sb = stats_b.get(mb["module_id"], {}) if mb else {}
        ca = _codes(codes_a.get(ma["module_id"], [])) if ma else []
        cb = _codes(codes_b.get(mb["module_id"], [])) if mb else []
        either = mb if mb is not None else ma
        row: Row = {
            "key": key,
            "path_a": ma["path"] if ma else None, "path_b": mb["path"] if mb else None,
            "type": either["type"] if either else None,
            "kind_a": ma["kind"] if ma else None, "kind_b": mb["kind"] if mb else None,
            "params_a": ma["params_total"] if ma else None, "params_b": mb["params_total"] if mb else None,
            "in_opt_a": ma["params_in_optimizer"] if ma else None,
            "in_opt_b": mb["params_in_optimizer"] if mb else None,
            "codes_a": ca, "codes_b": cb,
        }
        for k in _STAT_KEYS:
            row[f"{k}_a"] = sa.get(k)
            row[f"{k}_b"] = sb.get(k)
        row["changed"] = (row["kind_a"] != row["kind_b"] or row["params_a"] != row["params_b"]
                          or row["in_opt_a"] != row["in_opt_b"] or ca != cb)
        modules.append(row)

    return {
        "a": {"path": ova["path"], "run_name": ova["run_name"]},
        "b": {"path": ovb["path"], "run_name": ovb["run_name"]},
        "summary": summary,
        "findings_appeared": sorted(appeared, key=_finding_order),
        "findings_resolved": sorted(resolved, key=_finding_order),
        "findings_persisting": sorted(persisting, key=_finding_order),
        "keys_added": sorted(keys_b - keys_a),
        "keys_removed": sorted(keys_a - keys_b),
        "keys_common": len(keys_a & keys_b),
        "modules": modules,
    }
