"""Pure record builders: Python values in, (sql, rows) operations out. No I/O.

Every SQL statement the probes write is built here."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload

from ..schema import EVENT_CODES, HIST_EDGES, SCHEMA_VERSION, TABLES

if TYPE_CHECKING:
    from ..findings.finding import Finding
    from ..model.structure import ModuleNode, TensorNode
    from .errors import ErrorEntry

Row = tuple[Any, ...]
Op = tuple[str, Sequence[Row]]      # one executemany: (sql, rows): a list of tuples, or ColumnRows


class ColumnRows(Sequence[Row]):
    """Rows kept as columns (one list per field, all of one length) until the store's writer thread binds them,
    making each row as it writes it: a sampled step of a model of 15,000 modules then makes no 15,000 row tuples
    in the training thread, nor leaves them to Python's collector there."""

    def __init__(self, columns: Sequence[Sequence[Any]]) -> None:
        lengths = sorted({len(c) for c in columns})
        if len(lengths) > 1:
            raise ValueError(f"columns of lengths {lengths}: expected columns of one length")
        self.columns = columns
        self._n = lengths[0] if lengths else 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Row]:
        return zip(*self.columns, strict=True)

    @overload
    def __getitem__(self, index: int) -> Row: ...
    @overload
    def __getitem__(self, index: slice) -> list[Row]: ...

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        if isinstance(index, slice):
            return list(zip(*(c[index] for c in self.columns), strict=True))
        return tuple(c[index] for c in self.columns)


class TrackedFindingLike(Protocol):
    @property
    def finding(self) -> Finding: ...
    @property
    def module_id(self) -> int | None: ...
    @property
    def first_step(self) -> int: ...


def upsert_sql(table: str, columns: Iterable[str], key: Iterable[str], keep: Iterable[str] = ()) -> str:
    """INSERT ... ON CONFLICT(key) DO UPDATE of every column but the key and ``keep``."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {TABLES}")
    cols = list(columns)
    key = list(key)
    fixed = set(key) | set(keep)
    updates = ", ".join(f"{c}=excluded.{c}" for c in cols if c not in fixed)
    placeholders = ", ".join("?" for _ in cols)
    conflict = (f"ON CONFLICT({', '.join(key)}) DO UPDATE SET {updates}" if updates
                else f"ON CONFLICT({', '.join(key)}) DO NOTHING")
    return f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({placeholders}) {conflict}"

MODULE_COLS = ("rank", "module_id", "path", "parent_id", "name", "type", "type_module", "kind", "depth",
               "n_children", "params_total", "params_trainable", "params_in_optimizer", "first_step", "removed_step")
PARAM_COLS = ("rank", "param_id", "path", "module_id", "name", "shape", "numel", "dtype", "device", "kind",
              "requires_grad", "registered", "is_parameter", "in_state_dict", "in_optimizer", "opt_index",
              "opt_group", "lr", "aliases", "removed_step")
STEP_COLS = ("rank", "step", "wall_time", "step_ms", "probe_ms", "sampled", "compute_ms")
MSTAT_COLS = ("rank", "module_id", "step", "calls", "numel", "mean", "std", "absmax", "zero_frac",
              "dead_frac", "sat_frac", "nonfinite", "out_grad_norm", "training", "grad_enabled", "hist")
PSTAT_COLS = ("rank", "param_id", "step", "grad_norm", "data_norm", "update_norm", "update_ratio",
              "local_grad_norm", "fingerprint", "lr")
SERIES_COLS = ("rank", "param_id", "step", "grad_norm", "data_norm")
FINDING_COLS = ("rank", "code", "path", "severity", "module_id", "message", "fix", "evidence",
                "first_step", "last_step", "active", "count", "cause_code", "cause_path")
RANK_COLS = ("rank", "world_size", "hostname", "pid", "model_class", "torch_version", "python_version",
             "device", "sampling", "started_at", "updated_at", "status", "step")


def _json(value: Any) -> str | None:
    return json.dumps(value, default=str, allow_nan=False) if value is not None else None


def finite_or_none(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(x)


def meta_ops(run_name: str, created_at: float, extra: dict[str, Any] | None = None) -> list[Op]:
    items = {"schema_version": SCHEMA_VERSION, "run_name": run_name, "created_at": created_at,
             "created_by": "modscope probes", "hist_edges": HIST_EDGES}
    items.update(extra or {})
    sql = "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value"
    return [(sql, [(k, json.dumps(v, default=str)) for k, v in items.items()])]


def rank_ops(info: dict[str, Any]) -> list[Op]:
    row = tuple(info.get(c) if c != "sampling" else _json(info.get(c)) for c in RANK_COLS)
    return [(upsert_sql("ranks", RANK_COLS, ("rank",)), [row])]


@dataclasses.dataclass(frozen=True)
class RankCounters:
    """A rank's row of counters as of one moment: its step, the writer's counts, the probe errors, the overhead
    measured, and its status."""

    step: int
    now: float
    written: int
    dropped: int
    probe_errors: int
    overhead: float | None
    status: str
    closed_at: float | None
    write_errors: int
    last_error: str | None


def rank_counters_op(rank: int, c: RankCounters) -> Op:
    sql = ("UPDATE ranks SET step=?, updated_at=?, samples_written=?, samples_dropped=?, probe_errors=?, "
           "overhead=COALESCE(?, overhead), status=?, closed_at=COALESCE(?, closed_at), write_errors=?, "
           "last_error=COALESCE(?, last_error) WHERE rank=?")
    return (sql, [(c.step, c.now, c.written, c.dropped, c.probe_errors, finite_or_none(c.overhead), str(c.status),
                   c.closed_at, c.write_errors, c.last_error, rank)])


def structure_ops(rank: int, modules: Iterable[ModuleNode], tensors: Iterable[TensorNode],
                  first_step: int | None) -> list[Op]:
    """The rows of modules and tensors that are part of the model now (``removed_step`` NULL: one that had left
    it and is back is current again)."""
    mrows = [(rank, m.module_id, m.path, m.parent_id, m.name, m.type, m.type_module, m.kind, m.depth,
              m.n_children, m.params_total, m.params_trainable, m.params_in_optimizer, first_step, None)
             for m in modules]
    prows = [(rank, t.param_id, t.path, t.module_id, t.name, _json(t.shape), t.numel, t.dtype, t.device,
              t.kind, int(t.requires_grad), int(t.registered), int(t.is_parameter), int(t.in_state_dict),
              int(t.in_optimizer), t.opt_index, t.opt_group, finite_or_none(t.lr), _json(t.aliases), None)
             for t in tensors]
    module_sql = upsert_sql("modules", MODULE_COLS, ("rank", "module_id"), keep=("first_step",))
    ops: list[Op] = [(module_sql, mrows), (upsert_sql("params", PARAM_COLS, ("rank", "param_id")), prows)]
    return ops


def removal_ops(rank: int, modules: Mapping[int, int], tensors: Mapping[int, int]) -> list[Op]:
    """Modules and tensors (id -> step) that are no longer part of the model: their rows, statistics and findings
    stay, marked with the step they left it at."""
    ops: list[Op] = []
    if modules:
        ops.append(("UPDATE modules SET removed_step=? WHERE rank=? AND module_id=?",
                    [(step, rank, mid) for mid, step in modules.items()]))
    if tensors:
        ops.append(("UPDATE params SET removed_step=? WHERE rank=? AND param_id=?",
                    [(step, rank, tid) for tid, step in tensors.items()]))
    return ops


_STEP_SQL = upsert_sql("steps", STEP_COLS, ("rank", "step"))


def step_op(rank: int, step: int, wall_time: float, step_ms: float | None, probe_ms: float | None,
            sampled: bool, compute_ms: float | None = None) -> Op:
    return (_STEP_SQL, [(rank, step, wall_time, finite_or_none(step_ms), finite_or_none(probe_ms), int(sampled),
                         finite_or_none(compute_ms))])


def close_values_op(rank: int, values: Mapping[int, tuple[float | None, float | None]]) -> Op:
    """What replicas must agree on, taken when the watcher closed: param id -> (fingerprint, data norm)."""
    return ("UPDATE params SET close_fingerprint = ?, close_data_norm = ? WHERE rank = ? AND param_id = ?",
            [(finite_or_none(fp), finite_or_none(dn), rank, pid) for pid, (fp, dn) in values.items()])


def loss_op(rank: int, step: int, wall_time: float, loss: float | None) -> Op:
    sql = ("INSERT INTO steps(rank, step, wall_time, loss, sampled) VALUES (?, ?, ?, ?, 0) "
           "ON CONFLICT(rank, step) DO UPDATE SET loss=excluded.loss")
    return (sql, [(rank, step, wall_time, finite_or_none(loss))])


def module_stats_op(rows: Sequence[Row]) -> Op:
    return (upsert_sql("module_stats", MSTAT_COLS, ("rank", "module_id", "step")), rows)


def param_stats_op(rows: Sequence[Row]) -> Op:
    return (upsert_sql("param_stats", PSTAT_COLS, ("rank", "param_id", "step")), rows)


def param_series_op(rows: Sequence[Row]) -> Op:
    """Rows of ``param_series`` (SERIES_COLS): the dense tier's norms of steps that are no full samples."""
    return (upsert_sql("param_series", SERIES_COLS, ("rank", "param_id", "step")), rows)


def next_sample_op(rank: int, step: int | None) -> Op:
    """The step of the rank's next full sample as the schedule stands (None: none is coming, the run closed)."""
    return ("UPDATE ranks SET next_sample=? WHERE rank=?", [(step, rank)])


def moved_op(rank: int, moved: Mapping[int, int]) -> Op:
    return ("UPDATE params SET moved=? WHERE rank=? AND param_id=?",
            [(v, rank, pid) for pid, v in moved.items()])


_FINDING_SQL = (f"INSERT INTO findings ({', '.join(FINDING_COLS)}) VALUES ({', '.join('?' * len(FINDING_COLS))}) "
                "ON CONFLICT(rank, code, path) DO UPDATE SET severity=excluded.severity, "
                "module_id=excluded.module_id, message=excluded.message, fix=excluded.fix, "
                "evidence=excluded.evidence, last_step=excluded.last_step, active=1, count=excluded.count, "
                "cause_code=excluded.cause_code, cause_path=excluded.cause_path")
_EVENT_CODES_SQL = ", ".join(f"'{c}'" for c in sorted(EVENT_CODES))


def findings_ops(rank: int, changed: Iterable[TrackedFindingLike], resolved: Iterable[tuple[str, str]],
                 step: int, count_states: bool) -> list[Op]:
    """Upsert the new or changed findings (first_step stays that of the first sighting), mark the resolved
    ones inactive and, for the evaluation of a sampled step (``count_states``), move the last step and the
    count of every active finding about a state (an event's are its own)."""
    rows = []
    for t in changed:
        f = t.finding
        cause = f.cause or (None, None)
        rows.append((rank, f.code, f.path, f.severity, t.module_id, f.message, f.fix, _json(_clean(f.evidence)),
                     t.first_step, f.step if f.step is not None else step, 1, f.count, cause[0], cause[1]))
    ops: list[Op] = [(_FINDING_SQL, rows)] if rows else []
    res = [(step, rank, code, path) for code, path in resolved]
    if res:
        ops.append(("UPDATE findings SET active=0, last_step=? WHERE rank=? AND code=? AND path=?", res))
    if count_states:
        # rows written just now already say this step
        sql = (f"UPDATE findings SET last_step=?, count=count+1 WHERE rank=? AND active=1 "
               f"AND code NOT IN ({_EVENT_CODES_SQL}) AND last_step<?")
        ops.append((sql, [(step, rank, step)]))
    return ops


def errors_op(rank: int, errors: Mapping[tuple[str, str], ErrorEntry]) -> Op:
    sql = ("INSERT INTO probe_errors(rank, location, error_type, message, count, first_step, last_step) "
           "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(rank, location, error_type) DO UPDATE SET "
           "message=excluded.message, count=excluded.count, last_step=excluded.last_step")
    return (sql, [(rank, loc, etype, e.message, e.count, e.first_step, e.last_step)
                  for (loc, etype), e in errors.items()])


def _clean(value: Any) -> Any:
    """Evidence must be strict JSON: NaN/Inf become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def thin_ops(rank: int, cutoff: int, bucket: int) -> list[Op]:
    """Thin samples older than ``cutoff`` to the first sampled step of every ``bucket`` steps;
    unsampled step rows (the loss curve) likewise keep the first step of every bucket."""
    kept = ("SELECT MIN(step) FROM steps WHERE rank=? AND sampled=1 AND step<? GROUP BY step / ?")
    ops: list[Op] = []
    for table in ("module_stats", "param_stats"):
        ops.append((f"DELETE FROM {table} WHERE rank=? AND step<? AND step NOT IN ({kept})",
                    [(rank, cutoff, rank, cutoff, bucket)]))
    ops.append(("DELETE FROM steps WHERE rank=? AND step<? AND sampled=1 AND step NOT IN (" + kept + ")",
                [(rank, cutoff, rank, cutoff, bucket)]))
    ops.append(("DELETE FROM steps WHERE rank=? AND step<? AND sampled=0 AND step NOT IN "
                "(SELECT MIN(step) FROM steps WHERE rank=? AND sampled=0 AND step<? GROUP BY step / ?)",
                [(rank, cutoff, rank, cutoff, bucket)]))
    return ops


def thin_series_ops(rank: int, cutoff: int, bucket: int) -> list[Op]:
    """Thin the dense tier's rows older than ``cutoff`` to the first dense step of every ``bucket`` steps, as
    :func:`thin_ops` does the unsampled step rows."""
    return [("DELETE FROM param_series WHERE rank=? AND step<? AND step NOT IN "
             "(SELECT MIN(step) FROM param_series WHERE rank=? AND step<? GROUP BY step / ?)",
             [(rank, cutoff, rank, cutoff, bucket)])]
