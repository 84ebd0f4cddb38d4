"""A run's numbers over time, as tidy pandas frames: ``step, rank, path, metric, value``.

:func:`read_series` is the public door (``modscope series`` prints what it returns as CSV; a notebook pivots
it to a layer x step table). Torch-free: the store is read through :class:`dashboard.read.run.RunDir` /
:class:`dashboard.read.store.Store`, whose series queries (:mod:`dashboard.read.series_queries`) the Layers
page, the module detail and the command line share.

Where the values live (``probes/schema.py``): a full sample's in ``param_stats`` and ``module_stats`` at its
step, the dense tier's (gradient and weight norms on the steps between full samples) in ``param_series``. A
tensor's series is the union of both; the loss is ``steps.loss``. Paths are the model's own: a parameter's
(``blocks.0.attn.weight``) for the per-tensor metrics, a module's for the activation metrics, ``""`` for the
loss.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import pandas as pd

from probes.schema import StrEnum

from .errors import StoreError
from .run import Run, RunDir
from .series_queries import MAX_SERIES_ROWS, LossPoint, ModuleValue, Schedule, StepCounts, Tensor, TensorValue
from .store import Store

__all__ = ["COLUMNS", "MAX_SERIES_ROWS", "METRICS", "Level", "LossPoint", "Metric", "MetricError", "ModuleValue",
           "Schedule", "SeriesRow", "StepCounts", "Tensor", "TensorValue", "frame", "metric_names", "metric_spec",
           "open_run", "read_series", "run_frame"]

COLUMNS = ("step", "rank", "path", "metric", "value")
SERIES_TIMEOUT_S = 120.0       # a whole-run read may take longer than a page's query


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


# -- tidy frames ------------------------------------------------------------------------------------------
class SeriesRow(NamedTuple):
    """One row of a series before it is a frame (the metric is the frame's)."""

    step: int
    rank: int
    path: str
    value: Any


def frame(rows: Iterable[SeriesRow], metric_name: str) -> pd.DataFrame:
    """Rows as the tidy frame (sorted by step, rank and the order given; rows without a value left out)."""
    data = [r for r in rows if r.value is not None]
    df = pd.DataFrame({
        "step": pd.Series([r.step for r in data], dtype="int64"),
        "rank": pd.Series([r.rank for r in data], dtype="int64"),
        "path": pd.Series([r.path for r in data], dtype="str"),
        "metric": pd.Series([metric_name] * len(data), dtype="str"),
        "value": pd.Series([float(r.value) for r in data], dtype="float64"),
    })
    return df.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def _rank_rows(store: Store, rank: int, spec: Metric) -> list[SeriesRow]:
    """One rank's rows of ``spec``, in the model's order within a step."""
    if spec.level is Level.STEP:
        return [SeriesRow(p.step, rank, "", p.loss) for p in store.loss_points(rank)]
    if spec.level is Level.MODULE:
        paths = store.module_paths(rank)
        vals = sorted(store.module_stat_series(rank, spec.column), key=lambda r: (r.step, r.module_id))
        return [SeriesRow(v.step, rank, paths.get(v.module_id, f"<module {v.module_id}>"), v.value) for v in vals]
    names = {t.param_id: t.path for t in store.series_tensors(rank)}
    tv = sorted(store.tensor_series(rank, [spec.column], dense=spec.dense_column is not None),
                key=lambda r: (r.step, r.param_id))
    return [SeriesRow(r.step, rank, names[r.param_id], r.values[0]) for r in tv if r.param_id in names]


def run_frame(run: Run, name: str, rank: int | None = None) -> pd.DataFrame:
    """:func:`read_series` of an open run."""
    spec = metric_spec(name)
    ranks = run.ranks()
    if rank is not None and rank not in ranks:
        raise StoreError(f"--rank {rank}: no such rank in this run; expected one of {', '.join(map(str, ranks))}")
    rows: list[SeriesRow] = []
    for r in ranks if rank is None else [rank]:
        rows += _rank_rows(run.at(r), r, spec)
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
    :class:`dashboard.read.run.Run`. ``rank``: that rank only (default every rank). Torch-free. Raises
    :class:`MetricError` for an unknown metric and :class:`dashboard.read.errors.StoreError` for a store that cannot be
    read (both one line).

    >>> df = read_series("runs/exp1", "grad_norm")
    >>> df.pivot_table(index="path", columns="step", values="value")      # layer x step
    """
    spec = metric_spec(metric)            # before any file is opened
    return run_frame(open_run(source, run_id=run_id), spec.name, rank)
