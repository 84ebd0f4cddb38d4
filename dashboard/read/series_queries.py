"""The queries of the series over time: each tensor's values at every step that has them (the full samples'
``param_stats`` and the dense tier's ``param_series``), each module's output statistics, the loss, which steps
hold what, and when the next full sample is due. :mod:`dashboard.read.series` makes tidy frames of them; the
Layers page, the module detail and ``modscope series`` read them through it.

A store older than the dense tier reads its ``param_series`` as an empty table (:mod:`.store_guard`), so every
statement here reads both tables whatever the store's version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from probes.schema import TensorKind

from .connection import _loads
from .errors import StoreError
from .run_queries import RunQueries

MAX_SERIES_ROWS = 20_000_000   # rows of one series read (a 1,000-tensor model's 20,000 steps)
MAX_STEP_SCAN = 200_000        # distinct steps walked by one skip-scan
MAX_SERIES_TENSORS = 1_000_000
# the columns the statements below may name (the metric specs', never user text)
TENSOR_COLUMNS = frozenset({"grad_norm", "data_norm", "update_ratio", "update_norm", "lr"})
DENSE_COLUMNS = frozenset({"grad_norm", "data_norm"})
MODULE_COLUMNS = frozenset({"mean", "std", "absmax", "dead_frac", "sat_frac", "zero_frac", "out_grad_norm"})
STEP_KINDS = ("tensor", "full", "dense", "module")


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
    """Some columns of one tensor at one step."""

    param_id: int
    step: int
    values: tuple[Any, ...]      # the columns asked for, in order
    full: bool                   # from a full sample (param_stats), else from the dense tier


class ModuleValue(NamedTuple):
    """One column of one module's output statistics at one full sample."""

    module_id: int
    step: int
    value: Any


class LossPoint(NamedTuple):
    step: int
    loss: Any


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


def _in_clause(name: str, values: Sequence[int] | None) -> tuple[str, list[int]]:
    if values is None:
        return "", []
    return f" AND {name} IN ({','.join('?' * len(values)) or 'NULL'})", [int(v) for v in values]


def _filters(rank: int, after: int | None, **named: Sequence[int] | None) -> tuple[str, list[Any]]:
    """``AND ...`` clauses (and their arguments, ``rank`` first) for a rank, the steps after ``after``, and the
    ids or steps given."""
    where = " AND step > ?" if after is not None else ""
    args: list[Any] = [rank] + ([after] if after is not None else [])
    for name, values in named.items():
        clause, extra = _in_clause(name, values)
        where += clause
        args += extra
    return where, args


class SeriesQueries(RunQueries):
    def series_tensors(self, rank: int, limit: int = MAX_SERIES_TENSORS) -> list[Tensor]:
        """The parameters and unregistered tensors of ``rank`` (not buffers), in id order (the model's)."""
        removed = self._column("params", "removed_step")
        return [Tensor(int(r["param_id"]), str(r["path"]), None if r["module_id"] is None else int(r["module_id"]),
                       str(r["kind"]), int(r["numel"] or 0), r["removed"] is None)
                for r in self._query(f"SELECT param_id, path, module_id, kind, numel, {removed} AS removed "
                                     "FROM params WHERE rank = ? AND kind != ? ORDER BY param_id LIMIT ?",
                                     (rank, TensorKind.BUFFER.value, limit), limit=limit)]

    def tensor_series(self, rank: int, columns: Sequence[str], *, dense: bool = True,
                      steps: Sequence[int] | None = None, param_ids: Sequence[int] | None = None,
                      after: int | None = None, limit: int = MAX_SERIES_ROWS) -> list[TensorValue]:
        """``columns`` of the tensors of ``rank`` at every step that has them: the full samples' (``param_stats``)
        and, with ``dense`` when every column is in the dense tier too, the dense tier's (``param_series``; a step
        stored in both reads as the full sample's). ``steps`` / ``param_ids``: only those; ``after``: only later
        steps. StoreError when more than ``limit`` rows match."""
        bad = [c for c in columns if c not in TENSOR_COLUMNS]
        if bad or not columns:
            raise ValueError(f"not tensor series columns: {bad or list(columns)}")
        cols = ", ".join(self._column("param_stats", c) + f" AS {c}" for c in columns)
        where, args = _filters(rank, after, step=steps, param_id=param_ids)
        sql = f"SELECT param_id, step, 1 AS full, {cols} FROM param_stats WHERE rank = ?{where}"
        params = list(args)
        if dense and all(c in DENSE_COLUMNS for c in columns):
            sql += (f" UNION ALL SELECT param_id, step, 0 AS full, {', '.join(columns)} FROM param_series "
                    f"WHERE rank = ?{where}")
            params += args
        rows = self._query(sql + " LIMIT ?", (*params, limit + 1), limit=limit + 1)
        if len(rows) > limit:
            raise StoreError(f"{self.where}: more than {limit:,} values of {', '.join(columns)} on rank {rank}")
        out: dict[tuple[int, int], TensorValue] = {}
        for r in rows:
            key = (int(r["param_id"]), int(r["step"]))
            if key in out and out[key].full:
                continue                      # a full sample's own values win over the dense tier's
            out[key] = TensorValue(key[0], key[1], tuple(r[c] for c in columns), bool(r["full"]))
        return list(out.values())

    def module_stat_series(self, rank: int, column: str, *, steps: Sequence[int] | None = None,
                           module_ids: Sequence[int] | None = None, after: int | None = None,
                           limit: int = MAX_SERIES_ROWS) -> list[ModuleValue]:
        """``column`` of the modules of ``rank`` at their full samples."""
        if column not in MODULE_COLUMNS:
            raise ValueError(f"not a module series column: {column!r}")
        where, args = _filters(rank, after, step=steps, module_id=module_ids)
        rows = self._query(f"SELECT module_id, step, {column} AS v FROM module_stats WHERE rank = ?{where} "
                           f"AND {column} IS NOT NULL LIMIT ?", (*args, limit + 1), limit=limit + 1)
        if len(rows) > limit:
            raise StoreError(f"{self.where}: more than {limit:,} values of {column} on rank {rank}")
        return [ModuleValue(int(r["module_id"]), int(r["step"]), r["v"]) for r in rows]

    def _distinct_steps(self, table: str, rank: int, after: int | None, limit: int) -> list[int]:
        """The distinct steps of ``table`` for ``rank`` (after ``after``), oldest first: one index seek per step (a
        skip-scan over its (rank, step) index), not a walk over every row."""
        rows = self._query(
            f"WITH RECURSIVE s(step) AS (SELECT (SELECT MIN(step) FROM {table} WHERE rank = ? AND step > ?) "
            f"UNION ALL SELECT (SELECT MIN(step) FROM {table} WHERE rank = ? AND step > s.step) FROM s "
            "WHERE s.step IS NOT NULL) SELECT step FROM s WHERE step IS NOT NULL LIMIT ?",
            (rank, -1 if after is None else after, rank, limit), limit=limit)
        return [int(r["step"]) for r in rows]

    def series_steps(self, rank: int, kind: str = "tensor", *, after: int | None = None,
                     limit: int = MAX_STEP_SCAN) -> list[int]:
        """The steps with values, oldest first: ``tensor`` (full samples and the dense tier), ``full`` (the full
        samples' tensor statistics), ``dense`` (the dense tier only), ``module`` (module statistics)."""
        if kind not in STEP_KINDS:
            raise ValueError(f"series steps of {kind!r}: expected one of {', '.join(STEP_KINDS)}")
        if kind == "module":
            return self._distinct_steps("module_stats", rank, after, limit)
        full = self._distinct_steps("param_stats", rank, after, limit) if kind != "dense" else []
        dense = self._distinct_steps("param_series", rank, after, limit) if kind in ("tensor", "dense") else []
        return sorted(set(full) | set(dense))

    def step_counts(self, rank: int) -> StepCounts:
        """Full samples (``steps.sampled``) and the steps with dense series only."""
        row = self._one("SELECT COUNT(*) AS n FROM steps WHERE rank = ? AND sampled = 1", (rank,))
        full = int(row["n"]) if row else 0
        sampled = set(self._distinct_steps("param_stats", rank, None, MAX_STEP_SCAN))
        dense = sum(1 for s in self._distinct_steps("param_series", rank, None, MAX_STEP_SCAN) if s not in sampled)
        return StepCounts(full, dense)

    def sample_schedule(self, rank: int) -> Schedule:
        """The rank's :class:`Schedule` (one row of ``ranks``)."""
        row = self._one(f"SELECT sampling, {self._column('ranks', 'next_sample')} AS next_sample FROM ranks "
                        "WHERE rank = ?", (rank,))
        sampling = _loads(row["sampling"], None) if row is not None else None
        sampling = sampling if isinstance(sampling, dict) else {}
        every, overhead = sampling.get("every"), sampling.get("overhead")
        nxt = row["next_sample"] if row is not None else None
        return Schedule(int(nxt) if isinstance(nxt, (int, float)) else None,
                        int(every) if isinstance(every, (int, float)) and every else None,
                        float(overhead) if isinstance(overhead, (int, float)) and overhead else None)

    def loss_points(self, rank: int, limit: int = MAX_SERIES_ROWS) -> list[LossPoint]:
        """Every step of ``rank`` that has a loss, oldest first."""
        return [LossPoint(int(r["step"]), r["loss"]) for r in self._query(
            "SELECT step, loss FROM steps WHERE rank = ? AND loss IS NOT NULL ORDER BY step LIMIT ?",
            (rank, limit), limit=limit)]

    def module_paths(self, rank: int, limit: int = MAX_SERIES_TENSORS) -> dict[int, str]:
        """module id -> path, every module of ``rank`` (removed ones too: their history is kept)."""
        return {int(r["module_id"]): str(r["path"]) for r in self._query(
            "SELECT module_id, path FROM modules WHERE rank = ? ORDER BY module_id LIMIT ?", (rank, limit),
            limit=limit)}
