"""Data access: every SQL statement of the dashboard lives in this module.

A :class:`Store` owns the connections to one run store. Live stores (a run being
written, SQLite in WAL mode) are opened ``file:...?mode=ro``; snapshots are opened
``?immutable=1``. Every query is parameterised, row-limited (``LIMIT``) and
time-limited (a progress handler aborts it after ``timeout_s``).

The page modules only call the plain-data methods below (``overview()``,
``children()``, ``module_series()`` ...) which return dicts and lists, so they are
testable without a browser.
"""

from __future__ import annotations

from types import MappingProxyType

import json
import math
import os
import re
import sqlite3
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

SUPPORTED_SCHEMA_VERSION = 1
STORE_FILENAME = "modscope.sqlite"
REQUIRED_TABLES = ("meta", "ranks", "modules", "params", "steps", "module_stats",
                   "param_stats", "findings", "probe_errors")
SQLITE_HEADER = b"SQLite format 3\x00"

SEVERITIES = ("error", "warning", "info")
SEVERITY_ORDER = MappingProxyType({s: i for i, s in enumerate(SEVERITIES)})

# Row limits (each query says how many rows it may return).
MAX_CHILDREN = 500          # children of one expanded node
MAX_SEARCH = 200            # search / filter results
MAX_FINDINGS = 2000
MAX_PARAMS = 1000           # parameter table of one module
MAX_POINTS = 1500           # points of one time series (downsampled above that)
MAX_HEAT_COLUMNS = 240      # columns of the histogram heat map
MAX_COMPARE_MODULES = 20000
MAX_KEYS = 50000


class StoreError(Exception):
    """A store cannot be read; ``str()`` is one line naming the path and the problem."""


class StoreNotReady(StoreError):
    """A live store that does not exist yet (or is still being created)."""


class QueryTimeout(StoreError):
    """A query ran past the store's time limit and was aborted."""


def resolve_store_path(target: str | os.PathLike) -> Path:
    """Return the store file for a run directory or a store file path."""
    p = Path(target)
    if p.is_dir() or (not p.exists() and p.suffix != ".sqlite"):
        return p / STORE_FILENAME
    return p


def _sqlite_uri(path: Path, immutable: bool) -> str:
    quoted = urllib.parse.quote(str(path.resolve()))
    return f"file:{quoted}?immutable=1" if immutable else f"file:{quoted}?mode=ro"


def _describe_db_error(path: Path, exc: Exception) -> str:
    text = str(exc)
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


def normalize_path(path: str) -> str:
    """Map a Python attribute path to the registered spelling so that a run before a fix
    (``encoder.blocks[0]``) lines up with the run after it (``encoder.blocks.0``)."""
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]*)['\"]\]", r".\1", path)
    return path


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


@dataclass(frozen=True)
class StoreInfo:
    path: Path
    schema_version: int
    tables: tuple


class Store:
    """Read access to one run store (a live run or a snapshot).

    ``live=True``: the file may not exist yet and is being written (WAL): opened read-only.
    ``live=False``: a snapshot, opened immutable; it must exist and be valid at once.
    """

    def __init__(self, path: str | os.PathLike, *, live: bool, timeout_s: float = 5.0):
        self.path = Path(path)
        self.live = live
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._ready = False
        if not live:
            self.validate()

    # -- opening -----------------------------------------------------------------------
    @classmethod
    def open_run(cls, run: str | os.PathLike, **kw) -> "Store":
        store = cls(resolve_store_path(run), live=True, **kw)
        if store.path.parent.exists() and not store.path.parent.is_dir():
            raise StoreError(f"{store.path.parent}: not a directory")
        store.validate(allow_missing=True)
        return store

    @classmethod
    def open_snapshot(cls, path: str | os.PathLike, **kw) -> "Store":
        p = Path(path)
        if p.is_dir():
            p = p / STORE_FILENAME
        if Path(str(p) + "-wal").exists():
            # a store still in WAL mode (a run's own file, not a snapshot): immutable=1 would
            # ignore what is in the -wal file, so read it like a live run
            store = cls(p, live=True, **kw)
            store.validate()
            return store
        return cls(p, live=False, **kw)

    @classmethod
    def open_any(cls, target: str | os.PathLike, **kw) -> "Store":
        """A run directory (followed live) or a snapshot file."""
        p = Path(target)
        if p.is_dir():
            return cls.open_run(p, **kw)
        if not p.exists():
            raise StoreError(f"{p}: no such file or directory")
        # A store file: live if a WAL sidecar is present, else a snapshot.
        if Path(str(p) + "-wal").exists():
            return cls.open_run(p, **kw)
        return cls.open_snapshot(p, **kw)

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
                    and not Path(str(self.path) + "-wal").exists():
                conn = sqlite3.connect(_sqlite_uri(self.path, immutable=True), uri=True,
                                       check_same_thread=True, timeout=self.timeout_s)
            else:
                raise StoreError(_describe_db_error(self.path, exc)) from None
        except sqlite3.Error as exc:
            raise StoreError(_describe_db_error(self.path, exc)) from None
        conn.row_factory = sqlite3.Row
        return conn

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def validate(self, allow_missing: bool = False) -> StoreInfo | None:
        """Check file type, schema version and tables. Raise StoreError (one line);
        return None when ``allow_missing`` and the live store is not created yet."""
        if not check_header(self.path, allow_missing=allow_missing):
            return None
        try:
            conn = self._connect()
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                tables = tuple(r[0] for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type='table' LIMIT 1000"))
                if not self.live:
                    row = conn.execute("PRAGMA quick_check(1)").fetchone()
                    if row and row[0] != "ok":
                        raise StoreError(f"{self.path}: corrupt SQLite file ({row[0]})")
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreError(_describe_db_error(self.path, exc)) from None
        if version > SUPPORTED_SCHEMA_VERSION:
            raise StoreError(f"{self.path}: written by schema version {version}, "
                             f"this dashboard reads up to {SUPPORTED_SCHEMA_VERSION}")
        missing = [t for t in REQUIRED_TABLES if t not in tables]
        if version == 0 or missing:
            if allow_missing and self.live and (version == 0 or len(missing) == len(REQUIRED_TABLES)):
                return None  # the writer is still creating it
            if version == 0 and not missing:
                raise StoreError(f"{self.path}: not a modscope store (schema version not set)")
            raise StoreError(f"{self.path}: not a modscope store (missing tables: "
                             f"{', '.join(missing)})")
        self._ready = True
        return StoreInfo(self.path, version, tables)

    def ready(self) -> bool:
        """True once the store exists with the schema (checked again until it does)."""
        if self._ready:
            return True
        with self._lock:
            if self._ready:
                return True
            try:
                info = self.validate(allow_missing=True)
            except StoreError:
                if self.live:
                    return False
                raise
            return info is not None

    # -- the one query helper --------------------------------------------------------------
    def _query(self, sql: str, params: Sequence[Any] = (), *, limit: int | None = None
               ) -> list[sqlite3.Row]:
        """Run one parameterised read. ``limit`` rows at most; aborted after timeout_s."""
        if not self.ready():
            raise StoreNotReady(f"{self.path}: waiting for the first sample")
        conn = self._conn()
        deadline = time.monotonic() + self.timeout_s
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 2000)
        try:
            cur = conn.execute(sql, tuple(params))
            rows = cur.fetchmany(limit) if limit is not None else cur.fetchall()
        except sqlite3.OperationalError as exc:
            if "interrupted" in str(exc):
                raise QueryTimeout(f"{self.path}: query took longer than {self.timeout_s:g} s") from None
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
    def meta(self) -> dict:
        rows = self._query("SELECT key, value FROM meta ORDER BY key LIMIT 500", limit=500)
        return {r["key"]: _loads(r["value"], r["value"]) for r in rows}

    def ranks(self) -> list[int]:
        rows = self._query("SELECT rank FROM ranks ORDER BY rank LIMIT 4096", limit=4096)
        ranks = [r["rank"] for r in rows]
        return ranks or [0]

    def last_step(self, rank: int = 0) -> int | None:
        row = self._one("SELECT MAX(step) AS s FROM steps WHERE rank = ?", (rank,))
        return row["s"] if row else None

    def version(self, rank: int = 0) -> dict:
        """Cheap change detector for live polling: the last step, and a signature of the
        structure (modules, findings) that changes when the tree's badges must change."""
        step = self.last_step(rank)
        stats_step = self._one("SELECT MAX(step) AS s FROM module_stats WHERE rank = ?", (rank,))
        mods = self._one("SELECT COUNT(*) AS n FROM modules WHERE rank = ?", (rank,))
        # not last_step: it moves with every sample; the tree's badges change only with these
        fnd = self._one("SELECT COUNT(*) AS n, SUM(active) AS a, SUM(LENGTH(code) * active) AS c, "
                        "SUM(LENGTH(path) * active) AS p FROM findings WHERE rank = ?", (rank,))
        rk = self._one("SELECT status, samples_dropped, probe_errors FROM ranks WHERE rank = ?",
                       (rank,))
        return {
            "step": step,
            "stats_step": stats_step["s"] if stats_step else None,
            "struct": [mods["n"] if mods else 0,
                       list(fnd) if fnd else None,
                       list(rk) if rk else None],
        }

    def overview(self, rank: int = 0) -> dict:
        meta = self.meta()
        rk = self._one("SELECT * FROM ranks WHERE rank = ?", (rank,))
        rkd = dict(rk) if rk else {}
        steps = self._one("SELECT COUNT(*) AS n, MAX(step) AS last, SUM(sampled) AS sampled, "
                          "SUM(probe_ms) AS probe_ms, SUM(step_ms) AS step_ms "
                          "FROM steps WHERE rank = ?", (rank,))
        sev = {s: 0 for s in SEVERITIES}
        for r in self._query("SELECT severity, COUNT(*) AS n FROM findings "
                             "WHERE rank = ? AND active = 1 GROUP BY severity LIMIT 10",
                             (rank,), limit=10):
            sev[r["severity"]] = r["n"]
        mods = {r["kind"]: r["n"] for r in self._query(
            "SELECT kind, COUNT(*) AS n FROM modules WHERE rank = ? GROUP BY kind LIMIT 10",
            (rank,), limit=10)}
        params = self._one(
            "SELECT COALESCE(SUM(CASE WHEN kind = 'parameter' THEN numel END), 0) AS total, "
            "COALESCE(SUM(CASE WHEN kind = 'parameter' AND requires_grad = 1 THEN numel END), 0) "
            "AS trainable, "
            "COALESCE(SUM(CASE WHEN in_optimizer = 1 THEN numel END), 0) AS in_optimizer, "
            "COALESCE(SUM(CASE WHEN kind = 'tensor' THEN numel END), 0) AS unregistered, "
            "COALESCE(SUM(in_state_dict), 0) AS state_dict_tensors "
            "FROM params WHERE rank = ?", (rank,))
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
            "step": rkd.get("step") if rkd.get("step") is not None else (steps["last"] if steps else None),
            "steps_recorded": steps["n"] if steps else 0,
            "samples_stored": samples_stored,
            "samples_written": rkd.get("samples_written", 0),
            "samples_dropped": rkd.get("samples_dropped", 0),
            "probe_errors": rkd.get("probe_errors", 0),
            "overhead": _finite(overhead),
            "findings": sev,
            "modules": {k: mods.get(k, 0) for k in ("registered", "unregistered", "runtime")},
            "params": dict(params) if params else {},
            "started_at": rkd.get("started_at"),
            "updated_at": rkd.get("updated_at"),
        }

    def loss_series(self, rank: int = 0, since_step: int | None = None,
                    max_points: int = MAX_POINTS) -> dict:
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

    def probe_errors(self, rank: int = 0, limit: int = 200) -> list[dict]:
        return [dict(r) for r in self._query(
            "SELECT location, error_type, message, count, first_step, last_step FROM probe_errors "
            "WHERE rank = ? ORDER BY count DESC LIMIT ?", (rank, limit), limit=limit)]

    # -- module tree ---------------------------------------------------------------------
    _MODULE_COLS = ("module_id, parent_id, path, name, type, type_module, kind, depth, n_children, "
                    "params_total, params_trainable, params_in_optimizer, first_step")

    def root(self, rank: int = 0) -> dict | None:
        row = self._one(f"SELECT {self._MODULE_COLS} FROM modules WHERE rank = ? "
                        "AND parent_id IS NULL ORDER BY module_id LIMIT 1", (rank,))
        return dict(row) if row else None

    def module(self, rank: int, module_id: int) -> dict | None:
        row = self._one(f"SELECT {self._MODULE_COLS} FROM modules WHERE rank = ? AND module_id = ?",
                        (rank, module_id))
        return dict(row) if row else None

    def module_by_path(self, rank: int, path: str) -> dict | None:
        row = self._one(f"SELECT {self._MODULE_COLS} FROM modules WHERE rank = ? AND path = ? "
                        "LIMIT 1", (rank, path))
        return dict(row) if row else None

    def module_for_path(self, rank: int, path: str) -> dict | None:
        """The module a finding path belongs to: the path itself or its longest module prefix."""
        p = path
        for _ in range(64):
            m = self.module_by_path(rank, p)
            if m is not None:
                return m
            if not p:
                return None
            cut = max(p.rfind("."), p.rfind("["))
            p = p[:cut] if cut > 0 else ""
        return None

    def children(self, rank: int, parent_id: int, limit: int = MAX_CHILDREN) -> dict:
        """Children of one node (registered first, in id order); ``more`` counts the rest."""
        rows = self._query(f"SELECT {self._MODULE_COLS} FROM modules WHERE rank = ? "
                           "AND parent_id = ? ORDER BY module_id LIMIT ?",
                           (rank, parent_id, limit + 1), limit=limit + 1)
        items = [dict(r) for r in rows[:limit]]
        more = 0
        if len(rows) > limit:
            n = self._one("SELECT COUNT(*) AS n FROM modules WHERE rank = ? AND parent_id = ?",
                          (rank, parent_id))
            more = (n["n"] if n else len(rows)) - limit
        return {"items": items, "more": more}

    def ancestors(self, rank: int, module_id: int) -> list[int]:
        """Ids from the root down to the parent of ``module_id``."""
        rows = self._query(
            "WITH RECURSIVE up(id, parent, lvl) AS ("
            " SELECT module_id, parent_id, 0 FROM modules WHERE rank = ? AND module_id = ?"
            " UNION ALL SELECT m.module_id, m.parent_id, up.lvl + 1 FROM modules m"
            " JOIN up ON m.rank = ? AND m.module_id = up.parent WHERE up.lvl < 256)"
            " SELECT id, lvl FROM up WHERE lvl > 0 ORDER BY lvl DESC LIMIT 300",
            (rank, module_id, rank), limit=300)
        return [r["id"] for r in rows]

    def search_modules(self, rank: int = 0, text: str = "", code: str | None = None,
                       limit: int = MAX_SEARCH) -> dict:
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
        rows = self._query(f"SELECT {', '.join('m.' + c.strip() for c in self._MODULE_COLS.split(','))} "
                           f"FROM modules m WHERE {' AND '.join(where)} "
                           "ORDER BY m.depth, m.module_id LIMIT ?", (*params, limit + 1),
                           limit=limit + 1)
        return {"items": [dict(r) for r in rows[:limit]], "truncated": len(rows) > limit}

    def findings_for_modules(self, rank: int, module_ids: Iterable[int]) -> dict[int, list[dict]]:
        """Active findings drawn on each of ``module_ids`` (code, severity)."""
        ids = sorted({int(i) for i in module_ids})
        out: dict[int, list[dict]] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            for r in self._query(f"SELECT module_id, code, severity, path FROM findings "
                                 f"WHERE rank = ? AND active = 1 AND module_id IN ({marks}) "
                                 "LIMIT 20000", (rank, *chunk), limit=20000):
                out.setdefault(r["module_id"], []).append(
                    {"code": r["code"], "severity": r["severity"], "path": r["path"]})
        for v in out.values():
            v.sort(key=lambda f: (SEVERITY_ORDER.get(f["severity"], 9), f["code"]))
        return out

    def subtree_finding_counts(self, rank: int = 0) -> dict[int, dict[str, int]]:
        """For every module on the way up from a finding: active findings below it (itself
        included) by severity. Lets a collapsed node say "2 errors inside"."""
        rows = self._query(
            "WITH RECURSIVE up(id, sev, lvl) AS ("
            " SELECT module_id, severity, 0 FROM findings"
            "  WHERE rank = ? AND active = 1 AND module_id IS NOT NULL"
            " UNION ALL SELECT m.parent_id, up.sev, up.lvl + 1 FROM up JOIN modules m"
            "  ON m.rank = ? AND m.module_id = up.id WHERE m.parent_id IS NOT NULL AND up.lvl < 256)"
            " SELECT id, sev, COUNT(*) AS n FROM up GROUP BY id, sev LIMIT 100000",
            (rank, rank), limit=100000)
        out: dict[int, dict[str, int]] = {}
        for r in rows:
            out.setdefault(r["id"], {})[r["sev"]] = r["n"]
        return out

    def default_expanded(self, rank: int = 0, findings: int = 3) -> list[int]:
        """Nodes to open on first view: the root and the ancestors of the first few
        error (then warning) findings, so the worst problems are visible at once."""
        root = self.root(rank)
        if root is None:
            return []
        ids = [root["module_id"]]
        rows = self._query("SELECT module_id FROM findings WHERE rank = ? AND active = 1 "
                           "AND severity IN ('error', 'warning') AND module_id IS NOT NULL "
                           "GROUP BY module_id ORDER BY MIN(CASE severity WHEN 'error' THEN 0 ELSE 1 END), "
                           "module_id LIMIT ?", (rank, findings), limit=findings)
        for r in rows:
            for a in self.ancestors(rank, r["module_id"]):
                if a not in ids:
                    ids.append(a)
        return ids

    # -- findings ------------------------------------------------------------------------
    def findings(self, rank: int = 0, *, active: bool | None = True, module_id: int | None = None,
                 limit: int = MAX_FINDINGS) -> list[dict]:
        """Findings sorted by severity (error, warning, info), then path."""
        sql = ("SELECT f.code, f.path, f.severity, f.module_id, f.message, f.fix, f.evidence, "
               "f.first_step, f.last_step, f.active, m.path AS module_path "
               "FROM findings f LEFT JOIN modules m ON m.rank = f.rank AND m.module_id = f.module_id "
               "WHERE f.rank = ?")
        params: list[Any] = [rank]
        if active is not None:
            sql += " AND f.active = ?"
            params.append(1 if active else 0)
        if module_id is not None:
            sql += " AND f.module_id = ?"
            params.append(module_id)
        sql += (" ORDER BY CASE f.severity WHEN 'error' THEN 0 WHEN 'warning' THEN 1 "
                "WHEN 'info' THEN 2 ELSE 3 END, f.active DESC, f.path, f.code LIMIT ?")
        params.append(limit)
        out = []
        for r in self._query(sql, params, limit=limit):
            d = dict(r)
            d["evidence"] = _loads(d["evidence"], d["evidence"])
            out.append(d)
        return out

    def finding_codes(self, rank: int = 0) -> list[str]:
        return [r["code"] for r in self._query(
            "SELECT DISTINCT code FROM findings WHERE rank = ? AND active = 1 ORDER BY code LIMIT 100",
            (rank,), limit=100)]

    # -- module detail --------------------------------------------------------------------
    _SERIES_COLS = ("mean", "std", "absmax", "zero_frac", "dead_frac", "sat_frac", "nonfinite",
                    "out_grad_norm", "calls")

    def module_series(self, rank: int, module_id: int, since_step: int | None = None,
                      max_points: int = MAX_POINTS) -> dict:
        """Per-step statistics of one module. ``since_step``: only newer rows (raw);
        otherwise the whole run downsampled to ``max_points`` buckets (bucket means)."""
        cols = self._SERIES_COLS
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
        out: dict[str, list] = {"step": [r["step"] for r in rows]}
        for c in cols:
            out[c] = [_finite(r[c]) for r in rows]
        out["last"] = rows[-1]["step"] if rows else since_step
        return out

    def module_hist(self, rank: int, module_id: int, max_cols: int = MAX_HEAT_COLUMNS) -> dict:
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
            h = _loads(r["hist"])
            if isinstance(h, list):
                steps.append(r["step"])
                counts.append([float(x or 0) for x in h])
        return {"step": steps, "counts": counts, "edges": edges}

    def module_params(self, rank: int, module_id: int, limit: int = MAX_PARAMS) -> list[dict]:
        """The parameters/buffers/tensors owned by a module, with their latest statistics."""
        rows = self._query(
            "SELECT p.param_id, p.path, p.name, p.shape, p.numel, p.dtype, p.device, p.kind, "
            "p.requires_grad, p.registered, p.is_parameter, p.in_state_dict, p.in_optimizer, "
            "p.opt_index, p.opt_group, p.lr, p.aliases, p.moved, "
            "s.step AS stat_step, s.grad_norm, s.data_norm, s.update_norm, s.update_ratio "
            "FROM params p LEFT JOIN param_stats s ON s.rank = p.rank AND s.param_id = p.param_id "
            "AND s.step = (SELECT MAX(step) FROM param_stats WHERE rank = p.rank "
            "AND param_id = p.param_id) "
            "WHERE p.rank = ? AND p.module_id = ? ORDER BY p.param_id LIMIT ?",
            (rank, module_id, limit), limit=limit)
        out = []
        for r in rows:
            d = dict(r)
            d["shape"] = _loads(d["shape"])
            d["aliases"] = _loads(d["aliases"], []) or []
            for k in ("grad_norm", "data_norm", "update_norm", "update_ratio", "lr"):
                d[k] = _finite(d[k])
            out.append(d)
        return out

    def param_series(self, rank: int, param_id: int, max_points: int = MAX_POINTS) -> dict:
        rows = self._query("SELECT step, grad_norm, update_ratio FROM param_stats WHERE rank = ? "
                           "AND param_id = ? ORDER BY step DESC LIMIT ?",
                           (rank, param_id, max_points), limit=max_points)
        rows = rows[::-1]
        return {"step": [r["step"] for r in rows],
                "grad_norm": [_finite(r["grad_norm"]) for r in rows],
                "update_ratio": [_finite(r["update_ratio"]) for r in rows]}

    # -- whole-store views (compare, report) -------------------------------------------------
    def state_dict_keys(self, rank: int = 0, limit: int = MAX_KEYS) -> list[str]:
        """The keys a checkpoint (``model.state_dict()``) of this model would hold."""
        keys: set[str] = set()
        for r in self._query("SELECT path, aliases FROM params WHERE rank = ? AND in_state_dict = 1 "
                             "ORDER BY param_id LIMIT ?", (rank, limit), limit=limit):
            keys.add(r["path"])
            for a in _loads(r["aliases"], []) or []:
                if isinstance(a, str):
                    keys.add(a)
        return sorted(keys)

    def all_modules(self, rank: int = 0, limit: int = MAX_COMPARE_MODULES) -> list[dict]:
        return [dict(r) for r in self._query(
            f"SELECT {self._MODULE_COLS} FROM modules WHERE rank = ? ORDER BY module_id LIMIT ?",
            (rank, limit), limit=limit)]

    def latest_module_stats(self, rank: int = 0, limit: int = MAX_COMPARE_MODULES) -> dict[int, dict]:
        """Each module's most recent statistics row (one index seek per module)."""
        rows = self._query(
            "SELECT s.module_id, s.step, s.mean, s.std, s.dead_frac, s.sat_frac, s.nonfinite, "
            "s.out_grad_norm FROM modules m JOIN module_stats s ON s.rank = m.rank "
            "AND s.module_id = m.module_id AND s.step = (SELECT MAX(step) FROM module_stats "
            "WHERE rank = m.rank AND module_id = m.module_id) WHERE m.rank = ? LIMIT ?",
            (rank, limit), limit=limit)
        return {r["module_id"]: {k: _finite(r[k]) for k in r.keys()} for r in rows}

    def final_loss(self, rank: int = 0) -> float | None:
        row = self._one("SELECT loss FROM steps WHERE rank = ? AND loss IS NOT NULL "
                        "ORDER BY step DESC LIMIT 1", (rank,))
        return _finite(row["loss"]) if row else None

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot_to(self, dest: str | os.PathLike) -> Path:
        """Write a consistent single-file copy (SQLite backup API, journal_mode=DELETE)."""
        if not self.ready():
            raise StoreNotReady(f"{self.path}: waiting for the first sample")
        dest = Path(dest)
        tmp = dest.with_name(dest.name + ".part")
        if tmp.exists():
            tmp.unlink()
        src = self._connect()
        try:
            dst = sqlite3.connect(str(tmp))
            try:
                src.backup(dst)
                dst.execute("PRAGMA journal_mode=DELETE")
                dst.commit()
            finally:
                dst.close()
        except sqlite3.Error as exc:
            raise StoreError(_describe_db_error(self.path, exc)) from None
        finally:
            src.close()
        os.replace(tmp, dest)
        return dest

    def snapshot_bytes(self) -> bytes:
        with tempfile.TemporaryDirectory(prefix="modscope-snap-") as d:
            p = self.snapshot_to(Path(d) / "snapshot.sqlite")
            return p.read_bytes()


# -- compare ---------------------------------------------------------------------------------
_STAT_KEYS = ("mean", "std", "dead_frac", "sat_frac", "out_grad_norm")


def _codes(findings: list[dict]) -> list[dict]:
    """Distinct finding codes of one module, worst severity first: [{"code", "severity"}]."""
    seen: dict[str, str] = {}
    for f in findings:
        seen.setdefault(f["code"], f["severity"])
    return sorted(({"code": c, "severity": v} for c, v in seen.items()),
                  key=lambda d: (SEVERITY_ORDER.get(d["severity"], 9), d["code"]))


def compare_stores(a: Store, b: Store, rank: int = 0, limit: int = MAX_COMPARE_MODULES) -> dict:
    """The "before / after" table of two stores: summary, findings appeared/resolved,
    checkpoint keys added/removed, and per-module statistics then (a) and now (b).
    Modules are matched by normalised path (``blocks[0]`` ~ ``blocks.0``)."""
    ova, ovb = a.overview(rank), b.overview(rank)

    def summary_row(label, va, vb):
        return {"metric": label, "a": va, "b": vb, "changed": va != vb}

    keys_a, keys_b = set(a.state_dict_keys(rank)), set(b.state_dict_keys(rank))
    summary = [
        summary_row("model class", ova["model_class"], ovb["model_class"]),
        summary_row("registered modules", ova["modules"]["registered"], ovb["modules"]["registered"]),
        summary_row("unregistered modules", ova["modules"]["unregistered"] + ova["modules"]["runtime"],
                    ovb["modules"]["unregistered"] + ovb["modules"]["runtime"]),
        summary_row("parameters (registered)", ova["params"].get("total", 0), ovb["params"].get("total", 0)),
        summary_row("trainable", ova["params"].get("trainable", 0), ovb["params"].get("trainable", 0)),
        summary_row("held by optimizer", ova["params"].get("in_optimizer", 0),
                    ovb["params"].get("in_optimizer", 0)),
        summary_row("checkpoint keys", len(keys_a), len(keys_b)),
        summary_row("errors", ova["findings"]["error"], ovb["findings"]["error"]),
        summary_row("warnings", ova["findings"]["warning"], ovb["findings"]["warning"]),
        summary_row("last step", ova["step"], ovb["step"]),
        summary_row("final loss", a.final_loss(rank), b.final_loss(rank)),
    ]

    fa = {(f["code"], normalize_path(f["path"])): f for f in a.findings(rank, active=True)}
    fb = {(f["code"], normalize_path(f["path"])): f for f in b.findings(rank, active=True)}
    appeared = [fb[k] for k in fb if k not in fa]
    resolved = [fa[k] for k in fa if k not in fb]
    persisting = [fb[k] for k in fb if k in fa]
    sort_key = lambda f: (SEVERITY_ORDER.get(f["severity"], 9), f["path"], f["code"])  # noqa: E731

    mods_a = {normalize_path(m["path"]): m for m in a.all_modules(rank, limit)}
    mods_b = {normalize_path(m["path"]): m for m in b.all_modules(rank, limit)}
    stats_a, stats_b = a.latest_module_stats(rank, limit), b.latest_module_stats(rank, limit)
    codes_a = a.findings_for_modules(rank, [m["module_id"] for m in mods_a.values()])
    codes_b = b.findings_for_modules(rank, [m["module_id"] for m in mods_b.values()])

    order = list(mods_b.keys()) + [k for k in mods_a if k not in mods_b]
    modules = []
    for key in order:
        ma, mb = mods_a.get(key), mods_b.get(key)
        sa = stats_a.get(ma["module_id"], {}) if ma else {}
        sb = stats_b.get(mb["module_id"], {}) if mb else {}
        ca = _codes(codes_a.get(ma["module_id"], [])) if ma else []
        cb = _codes(codes_b.get(mb["module_id"], [])) if mb else []
        row = {
            "key": key,
            "path_a": ma["path"] if ma else None, "path_b": mb["path"] if mb else None,
            "type": (mb or ma)["type"],
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
        "findings_appeared": sorted(appeared, key=sort_key),
        "findings_resolved": sorted(resolved, key=sort_key),
        "findings_persisting": sorted(persisting, key=sort_key),
        "keys_added": sorted(keys_b - keys_a),
        "keys_removed": sorted(keys_a - keys_b),
        "keys_common": len(keys_a & keys_b),
        "modules": modules,
    }
