"""A run's numbers over time, as tidy pandas frames: ``step, rank, path, metric, value``.

:func:`read_series` is the public door (``modscope series`` prints what it returns as CSV; a notebook pivots
it to a layer x step table). Torch-free: the store is read through :class:`dashboard.run.RunDir` /
:class:`dashboard.data.Store` (read-only, parameterised, row- and time-limited); the few statements below
are the series reads that the Layers page, the module detail and the command line share.

Where the values live (``probes/schema.py``): a full sample's in ``param_stats`` and ``module_stats`` at its
step, the dense tier's (gradient and weight norms on the steps between full samples) in ``param_series``. A
tensor's series is the union of both; the loss is ``steps.loss``. Paths are the model's own: a parameter's
(``blocks.0.attn.weight``) for the per-tensor metrics, a module's for the activation metrics, ``""`` for the
loss.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pandas as pd

from probes.schema import StrEnum, TensorKind

from .data import Store, StoreError
from .run import Run, RunDir

__all__ = ["COLUMNS", "METRICS", "Level", "Metric", "MetricError", "metric_names", "read_series"]

COLUMNS = ("step", "rank", "path", "metric", "value")
MAX_ROWS = 20_000_000          # rows of one series read (a 1,000-tensor model's 20,000 steps)
SERIES_TIMEOUT_S = 120.0       # a whole-run read may take longer than a page's query
MAX_STEP_SCAN = 200_000        # distinct steps walked by one skip-scan


class Level(StrEnum):
    """What a metric's path names."""

    STEP = "step"          # the run's (loss): path ""
    TENSOR = "tensor"      # a parameter (or an unregistered tensor): its path
    MODULE = "module"      # a module's output: its path


@dataclass(frozen=True)
class Metric:
    """One metric: where it is stored, what the Layers page shows of it."""

    name: str
    label: str                   # as a page says it
    level: Level
    column: str                  # the store's column (steps / param_stats / module_stats)
    dense_column: str | None     # its column in param_series (the dense tier), if it is there too
    log: bool = False            # drawn as log10 (spans orders of magnitude between layers)
    doc: str = ""


METRICS: Mapping[str, Metric] = MappingProxyType({m.name: m for m in (
    Metric("loss", "loss", Level.STEP, "loss", None, doc="the loss passed to w.step()"),
    Metric("grad_norm", "gradient norm", Level.TENSOR, "grad_norm", "grad_norm", True,
           "L2 norm of the gradient at the optimizer step (unscaled)"),
    Metric("weight_norm", "weight norm", Level.TENSOR, "data_norm", "data_norm", True,
           "L2 norm of the weight after the optimizer step"),
    Metric("update_ratio", "update-to-data ratio", Level.TENSOR, "update_ratio", None, True,
           "||update|| / ||weight|| across the optimizer step (1e-3 is the usual guide)"),
    Metric("update_norm", "update norm", Level.TENSOR, "update_norm", None, True,
           "L2 norm of the weight's change across the optimizer step"),
    Metric("lr", "learning rate", Level.TENSOR, "lr", None, True, "its param group's learning rate"),
    Metric("act_mean", "activation mean", Level.MODULE, "mean", None, doc="mean of the module's output"),
    Metric("act_std", "activation std", Level.MODULE, "std", None, doc="standard deviation of the module's output"),
    Metric("act_absmax", "activation abs-max", Level.MODULE, "absmax", None, True, "largest |value| of the output"),
    Metric("dead_fraction", "dead fraction", Level.MODULE, "dead_frac", None,
           doc="fraction of output units never active over the window"),
    Metric("saturated_fraction", "saturated fraction", Level.MODULE, "sat_frac", None,
           doc="fraction of tanh/sigmoid-like outputs in the saturated tails"),
    Metric("zero_fraction", "zero fraction", Level.MODULE, "zero_frac", None,
           doc="fraction of (near-)zero output values"),
    Metric("out_grad_norm", "output gradient norm", Level.MODULE, "out_grad_norm", None, True,
           "L2 norm of d(loss)/d(output)"),
)})
# the columns the statements below may name (the specs above, never user text)
_TENSOR_COLUMNS = frozenset({"grad_norm", "data_norm", "update_ratio", "update_norm", "lr"})
_DENSE_COLUMNS = frozenset({"grad_norm", "data_norm"})
_MODULE_COLUMNS = frozenset({"mean", "std", "absmax", "dead_frac", "sat_frac", "zero_frac", "out_grad_norm"})


class MetricError(ValueError):
    """A metric name this version does not know; ``str()`` is one line naming the metrics."""


def metric_names() -> list[str]:
    return list(METRICS)


def metric_spec(name: str) -> Metric:
    """The metric called ``name`` (MetricError naming every metric otherwise)."""
    found = METRICS.get(str(name))
    if found is None:
        raise MetricError(f"metric {name!r} is not one of: {', '.join(METRICS)}")
    return found


# -- the reads ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tensor:
    """A tensor of a rank's model as the series name it."""

    param_id: int
    path: str
    module_id: int | None
    kind: str
    numel: int
    current: bool                # part of the model now (not removed during the run)


@dataclass(frozen=True)
class TensorValue:
    param_id: int
    step: int
    values: tuple[Any, ...]      # the columns asked for, in order
    full: bool                   # from a full sample (param_stats), else from the dense tier


def has_dense_tier(store: Store) -> bool:
    """Whether the store has the dense tier's table (schema 5 on)."""
    return bool(store._query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'param_series'",
                             limit=1))


def tensors(store: Store, rank: int, limit: int = 1_000_000) -> list[Tensor]:
    """The parameters and unregistered tensors of ``rank`` (not buffers), in id order (the model's)."""
    removed = store._column("params", "removed_step")
    return [Tensor(int(r["param_id"]), str(r["path"]), None if r["module_id"] is None else int(r["module_id"]),
                   str(r["kind"]), int(r["numel"] or 0), r["removed"] is None)
            for r in store._query(f"SELECT param_id, path, module_id, kind, numel, {removed} AS removed FROM params "
                                  "WHERE rank = ? AND kind != ? ORDER BY param_id LIMIT ?",
                                  (rank, TensorKind.BUFFER.value, limit), limit=limit)]


def _in_clause(name: str, values: Sequence[int] | None) -> tuple[str, list[int]]:
    if values is None:
        return "", []
    return f" AND {name} IN ({','.join('?' * len(values)) or 'NULL'})", [int(v) for v in values]


def tensor_values(store: Store, rank: int, columns: Sequence[str], *, dense: bool = True,
                  steps: Sequence[int] | None = None, param_ids: Sequence[int] | None = None,
                  after: int | None = None, limit: int = MAX_ROWS) -> list[TensorValue]:
    """``columns`` of the tensors of ``rank`` at every step that has them: the full samples' (``param_stats``)
    and, with ``dense`` when every column is in the dense tier too, the dense tier's (``param_series``; a step
    stored in both reads as the full sample's). ``steps`` / ``param_ids``: only those; ``after``: only later
    steps. StoreError when more than ``limit`` rows match."""
    bad = [c for c in columns if c not in _TENSOR_COLUMNS]
    if bad or not columns:
        raise ValueError(f"not tensor series columns: {bad or columns}")
    cols = ", ".join(store._column("param_stats", c) + f" AS {c}" for c in columns)
    where = " AND step > ?" if after is not None else ""
    args: list[Any] = [rank] + ([after] if after is not None else [])
    for name, values in (("step", steps), ("param_id", param_ids)):
        clause, extra = _in_clause(name, values)
        where += clause
        args += extra
    sql = f"SELECT param_id, step, 1 AS full, {cols} FROM param_stats WHERE rank = ?{where}"
    params = list(args)
    if dense and all(c in _DENSE_COLUMNS for c in columns) and has_dense_tier(store):
        sql += (f" UNION ALL SELECT param_id, step, 0 AS full, {', '.join(columns)} FROM param_series "
                f"WHERE rank = ?{where}")
        params += args
    rows = store._query(sql + " LIMIT ?", (*params, limit + 1), limit=limit + 1)
    if len(rows) > limit:
        raise StoreError(f"{store.where}: more than {limit:,} values of {', '.join(columns)} on rank {rank}")
    out: dict[tuple[int, int], TensorValue] = {}
    for r in rows:
        key = (int(r["param_id"]), int(r["step"]))
        if key in out and out[key].full:
            continue                      # a full sample's own values win over the dense tier's
        out[key] = TensorValue(key[0], key[1], tuple(r[c] for c in columns), bool(r["full"]))
    return list(out.values())


def module_values(store: Store, rank: int, column: str, *, steps: Sequence[int] | None = None,
                  module_ids: Sequence[int] | None = None, after: int | None = None,
                  limit: int = MAX_ROWS) -> list[tuple[int, int, Any]]:
    """(module_id, step, value) of ``column`` of the modules of ``rank`` at their full samples."""
    if column not in _MODULE_COLUMNS:
        raise ValueError(f"not a module series column: {column!r}")
    where = " AND step > ?" if after is not None else ""
    args: list[Any] = [rank] + ([after] if after is not None else [])
    for name, values in (("step", steps), ("module_id", module_ids)):
        clause, extra = _in_clause(name, values)
        where += clause
        args += extra
    rows = store._query(f"SELECT module_id, step, {column} AS v FROM module_stats WHERE rank = ?{where} "
                        f"AND {column} IS NOT NULL LIMIT ?", (*args, limit + 1), limit=limit + 1)
    if len(rows) > limit:
        raise StoreError(f"{store.where}: more than {limit:,} values of {column} on rank {rank}")
    return [(int(r["module_id"]), int(r["step"]), r["v"]) for r in rows]


def _distinct_steps(store: Store, table: str, rank: int, after: int | None, limit: int) -> list[int]:
    """The distinct steps of ``table`` for ``rank`` (after ``after``), oldest first: one index seek per step (a
    skip-scan over its (rank, step) index), not a walk over every row."""
    start = -1 if after is None else after
    rows = store._query(
        f"WITH RECURSIVE s(step) AS (SELECT (SELECT MIN(step) FROM {table} WHERE rank = ? AND step > ?) "
        f"UNION ALL SELECT (SELECT MIN(step) FROM {table} WHERE rank = ? AND step > s.step) FROM s "
        "WHERE s.step IS NOT NULL) SELECT step FROM s WHERE step IS NOT NULL LIMIT ?",
        (rank, start, rank, limit), limit=limit)
    return [int(r["step"]) for r in rows]


@dataclass(frozen=True)
class StepCounts:
    """How many steps of a rank have values: full samples, steps with the dense tier's series only, both."""

    full: int
    dense: int                  # steps with dense series and no full sample

    def text(self) -> str:
        """'12 full samples · 150 steps with dense series' (a full sample has the dense series too)."""
        full = f"{self.full:,} full sample{'s' if self.full != 1 else ''}"
        total = self.full + self.dense
        return f"{full} · {total:,} step{'s' if total != 1 else ''} with dense series" if self.dense else full


def series_steps(store: Store, rank: int, kind: str = "tensor", *, after: int | None = None,
                 limit: int = MAX_STEP_SCAN) -> list[int]:
    """The steps with values, oldest first: ``tensor`` (full samples and the dense tier), ``full`` (the full
    samples' tensor statistics), ``dense`` (the dense tier only), ``module`` (module statistics)."""
    if kind == "module":
        return _distinct_steps(store, "module_stats", rank, after, limit)
    full = _distinct_steps(store, "param_stats", rank, after, limit) if kind != "dense" else []
    dense = _distinct_steps(store, "param_series", rank, after, limit) \
        if kind in ("tensor", "dense") and has_dense_tier(store) else []
    return sorted(set(full) | set(dense))


def step_counts(store: Store, rank: int) -> StepCounts:
    """Full samples (``steps.sampled``) and the steps with dense series only."""
    row = store._one("SELECT COUNT(*) AS n FROM steps WHERE rank = ? AND sampled = 1", (rank,))
    full = int(row["n"]) if row else 0
    dense = 0
    if has_dense_tier(store):
        sampled = set(_distinct_steps(store, "param_stats", rank, None, MAX_STEP_SCAN))
        dense = sum(1 for s in _distinct_steps(store, "param_series", rank, None, MAX_STEP_SCAN) if s not in sampled)
    return StepCounts(full, dense)


@dataclass(frozen=True)
class Schedule:
    """When a rank samples: its next full sample (``ranks.next_sample``; None in an older store or before the
    writer knows) and its sampling settings (``ranks.sampling``)."""

    next_sample: int | None
    every: int | None
    overhead: float | None

    def budget_text(self) -> str:
        """'1 % budget', 'every 10 steps' ('' when not known)."""
        if self.every:
            return "every step" if self.every == 1 else f"every {self.every:,} steps"
        if self.overhead:
            return f"{self.overhead * 100:g} % budget"
        return ""

    def next_text(self) -> str:
        """'next full sample at step 512, 1 % budget' ('' when the store does not say)."""
        if self.next_sample is None:
            return ""
        budget = self.budget_text()
        return f"next full sample at step {self.next_sample:,}" + (f", {budget}" if budget else "")


def schedule(store: Store, rank: int) -> Schedule:
    """The rank's :class:`Schedule` (one row of ``ranks``)."""
    row = store._one(f"SELECT sampling, {store._column('ranks', 'next_sample')} AS next_sample FROM ranks "
                     "WHERE rank = ?", (rank,))
    sampling: Any = None
    if row is not None and row["sampling"]:
        try:
            sampling = json.loads(row["sampling"])
        except ValueError:
            sampling = None
    sampling = sampling if isinstance(sampling, dict) else {}
    every, overhead = sampling.get("every"), sampling.get("overhead")
    nxt = row["next_sample"] if row is not None else None
    return Schedule(int(nxt) if isinstance(nxt, (int, float)) else None,
                    int(every) if isinstance(every, (int, float)) and every else None,
                    float(overhead) if isinstance(overhead, (int, float)) and overhead else None)


def loss_values(store: Store, rank: int, limit: int = MAX_ROWS) -> list[tuple[int, Any]]:
    """(step, loss) of every step of ``rank`` that has a loss."""
    return [(int(r["step"]), r["loss"]) for r in store._query(
        "SELECT step, loss FROM steps WHERE rank = ? AND loss IS NOT NULL ORDER BY step LIMIT ?",
        (rank, limit), limit=limit)]


def module_paths(store: Store, rank: int, limit: int = 1_000_000) -> dict[int, str]:
    """module id -> path, every module of ``rank`` (removed ones too: their history is kept)."""
    return {int(r["module_id"]): str(r["path"]) for r in store._query(
        "SELECT module_id, path FROM modules WHERE rank = ? ORDER BY module_id LIMIT ?", (rank, limit), limit=limit)}


# -- tidy frames ------------------------------------------------------------------------------------------
def frame(rows: Iterable[tuple[int, int, str, Any]], metric_name: str) -> pd.DataFrame:
    """(step, rank, path, value) rows as the tidy frame (sorted by step, rank and the order given)."""
    data = [r for r in rows if r[3] is not None]
    df = pd.DataFrame({
        "step": pd.Series([r[0] for r in data], dtype="int64"),
        "rank": pd.Series([r[1] for r in data], dtype="int64"),
        "path": pd.Series([r[2] for r in data], dtype="str"),
        "metric": pd.Series([metric_name] * len(data), dtype="str"),
        "value": pd.Series([float(r[3]) for r in data], dtype="float64"),
    })
    return df.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def rank_rows(store: Store, rank: int, spec: Metric) -> list[tuple[int, int, str, Any]]:
    """One rank's (step, rank, path, value) rows of ``spec``, in the model's order within a step."""
    if spec.level is Level.STEP:
        return [(step, rank, "", v) for step, v in loss_values(store, rank)]
    if spec.level is Level.MODULE:
        paths = module_paths(store, rank)
        vals = sorted(module_values(store, rank, spec.column), key=lambda r: (r[1], r[0]))
        return [(step, rank, paths.get(mid, f"<module {mid}>"), v) for mid, step, v in vals]
    names = {t.param_id: t.path for t in tensors(store, rank)}
    tv = sorted(tensor_values(store, rank, [spec.column], dense=spec.dense_column is not None),
                key=lambda r: (r.step, r.param_id))
    return [(r.step, rank, names[r.param_id], r.values[0]) for r in tv if r.param_id in names]


def run_frame(run: Run, name: str, rank: int | None = None) -> pd.DataFrame:
    """:func:`read_series` of an open run."""
    spec = metric_spec(name)
    ranks = run.ranks()
    if rank is not None and rank not in ranks:
        raise StoreError(f"--rank {rank}: no such rank in this run; expected one of {', '.join(map(str, ranks))}")
    rows: list[tuple[int, int, str, Any]] = []
    for r in ranks if rank is None else [rank]:
        rows += rank_rows(run.at(r), r, spec)
    return frame(rows, spec.name)


def open_run(source: str | os.PathLike[str] | Run, *, run_id: str | None = None,
             timeout_s: float = SERIES_TIMEOUT_S) -> Run:
    """The run ``source`` names: a :class:`Run`, a run directory (its newest run, or ``run_id``) or a store or
    snapshot file. StoreError (one line) when there is nothing to read."""
    if isinstance(source, Run):
        return source
    path = Path(source)
    if not path.exists():
        raise StoreError(f"{path}: no such file or directory")
    where = RunDir.open(path, live=path.is_dir(), timeout_s=timeout_s)
    run = where.run(run_id, strict=run_id is not None)
    if not run.ready():
        raise StoreError(f"{path}: no store yet (nothing written to this run)")
    return run


def read_series(source: str | os.PathLike[str] | Run, metric: str, rank: int | None = None, *,
                run_id: str | None = None) -> pd.DataFrame:
    """A run's ``metric`` over time as a tidy frame with the columns ``step, rank, path, metric, value``: one
    row per step, rank and path (a parameter's path for ``grad_norm``, ``weight_norm``, ``update_ratio``,
    ``update_norm``, ``lr``; a module's for ``act_mean``, ``act_std``, ``act_absmax``, ``dead_fraction``,
    ``saturated_fraction``, ``zero_fraction``, ``out_grad_norm``; ``""`` for ``loss``).

    ``source``: a run directory (its newest run, or ``run_id``), a store or snapshot file, or a
    :class:`dashboard.run.Run`. ``rank``: that rank only (default every rank). Torch-free. Raises
    :class:`MetricError` for an unknown metric and :class:`dashboard.data.StoreError` for a store that cannot be
    read (both one line).

    >>> df = read_series("runs/exp1", "grad_norm")
    >>> df.pivot_table(index="path", columns="step", values="value")      # layer x step
    """
    spec = metric_spec(metric)            # before any file is opened
    return run_frame(open_run(source, run_id=run_id), spec.name, rank)
