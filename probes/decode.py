"""Decoding a sampled step: pure functions from the fetched host values of a :class:`~probes.capture.StepRecord`
to columns of per-module and per-tensor statistics (what the detectors read) and to store rows. No hooks, no
I/O.

Columns, not an object per module: a model of 15,000 modules would otherwise leave 15,000 objects behind
every sampled step, and Python's collector would walk them all again and again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .capture import MAX_CALLS_MEASURED, CallRecord, PerTensor, StepRecord
from .measure import Fetched
from .schema import ZERO_BIN, decode_hist, encode_hist

Values = Fetched       # a sampled step's host values (probes.measure.PendingFetch.read)


@dataclasses.dataclass
class ModuleColumns:
    """One sampled step's statistics of every module measured in it, column by column (same order)."""

    step: int
    module_ids: list[int] = dataclasses.field(default_factory=list)
    calls: list[int] = dataclasses.field(default_factory=list)
    numel: list[int] = dataclasses.field(default_factory=list)
    mean: list[float | None] = dataclasses.field(default_factory=list)
    std: list[float | None] = dataclasses.field(default_factory=list)
    absmax: list[float | None] = dataclasses.field(default_factory=list)
    zero_frac: list[float | None] = dataclasses.field(default_factory=list)
    dead_frac: list[float | None] = dataclasses.field(default_factory=list)
    sat_frac: list[float | None] = dataclasses.field(default_factory=list)
    nonfinite: list[int] = dataclasses.field(default_factory=list)
    out_grad_norm: list[float | None] = dataclasses.field(default_factory=list)
    order: list[int] = dataclasses.field(default_factory=list)      # execution order of its first call
    training: list[bool | None] = dataclasses.field(default_factory=list)
    grad_enabled: list[bool | None] = dataclasses.field(default_factory=list)
    hist: list[bytes] = dataclasses.field(default_factory=list)     # as stored (schema.encode_hist)

    def nonfinite_in_order(self) -> list[tuple[int, int]]:
        """(module id, NaN/Inf count) of the modules that produced non-finite values, in execution order."""
        bad = sorted((o, m, n) for o, m, n in zip(self.order, self.module_ids, self.nonfinite, strict=True) if n)
        return [(m, n) for _, m, n in bad]


@dataclasses.dataclass
class TensorColumns:
    """One sampled step's statistics of every tensor measured in it, column by column."""

    step: int
    tensor_ids: list[int] = dataclasses.field(default_factory=list)
    grad_norm: list[float | None] = dataclasses.field(default_factory=list)
    data_norm: list[float | None] = dataclasses.field(default_factory=list)
    update_norm: list[float | None] = dataclasses.field(default_factory=list)
    stale_grad_norm: list[float | None] = dataclasses.field(default_factory=list)   # .grad before this backward
    arrived: list[bool] = dataclasses.field(default_factory=list)
    lr: list[float | None] = dataclasses.field(default_factory=list)
    fingerprint: list[float | None] = dataclasses.field(default_factory=list)
    local_grad_norm: list[float | None] = dataclasses.field(default_factory=list)

    def nonfinite_grads(self) -> list[int]:
        return [t for t, g in zip(self.tensor_ids, self.grad_norm, strict=True)
                if g is not None and not math.isfinite(g)]


def module_columns(step: int, rec: StepRecord, values: Fetched) -> ModuleColumns:
    """One entry per module measured in the step; several calls are aggregated (mean of means, max of
    abs-max, sum of non-finite counts and histograms; the dead fraction is the window's, so the latest).

    Column by column: every fetched call's statistics are laid end to end, each module picks its position,
    and each column is taken in one C-level pass (a model of 15,000 modules measures 15,000 per step)."""
    cols = ModuleColumns(step)
    where, isnan = values.where, math.isnan
    # every device's columns end to end, then the aggregates of modules called more than once
    offsets, off = [], 0
    for c in values.columns:
        offsets.append(off)
        off += len(c.slots)
    agg: list[tuple[float, float, float, float, float, float, float, bytes]] = []
    positions: list[int] = []
    firsts: list[CallRecord] = []
    for mid, all_calls in rec.rows.items():
        if len(all_calls) == 1:
            first = all_calls[0]
            loc = where.get(first.slot)
            if loc is None:
                continue                # its only output was changed in place before it could be read
            positions.append(offsets[loc[0]] + loc[1])
        else:
            calls = [k for k in all_calls if k.slot in where]
            if not calls:
                continue
            first = calls[0]
            if len(calls) == 1:
                loc = where[first.slot]
                positions.append(offsets[loc[0]] + loc[1])
            else:
                agg.append(_aggregate(values, calls))
                positions.append(off + len(agg) - 1)
        cols.module_ids.append(mid)
        firsts.append(first)
    if not positions:
        return cols

    def column(name: str, extra: int) -> list[Any]:
        whole: list[Any] = [v for c in values.columns for v in getattr(c, name)] if len(values.columns) != 1 \
            else getattr(values.columns[0], name)
        if agg:
            whole = [*whole, *(a[extra] for a in agg)]
        return list(map(whole.__getitem__, positions))

    cols.mean, cols.std, cols.absmax = column("mean", 0), column("std", 1), column("absmax", 2)
    cols.zero_frac = [None if isnan(z) else z for z in column("zero_frac", 3)]          # NaN: no sample
    cols.dead_frac = [None if v < 0 else v for v in column("dead_frac", 4)]
    cols.sat_frac = [None if v < 0 else v for v in column("sat_frac", 5)]
    cols.numel = [f.numel for f in firsts]
    cols.nonfinite = [n if isnan(v) else int(v) for v, n in zip(column("nonfinite", 6), cols.numel, strict=True)]
    cols.hist = column("hist", 7)
    counted = rec.calls       # every module with a row was counted (capture)
    cols.calls = [counted.get(mid) or sum(1 for k in rec.rows[mid] if k.slot in where) for mid in cols.module_ids]
    cols.order = [f.order for f in firsts]
    cols.training = [f.training for f in firsts]
    cols.grad_enabled = [f.grad_enabled for f in firsts]
    get = _out_grad_norms(rec, values.plain).get
    cols.out_grad_norm = [None if not (g := get(mid)) else g[0] if len(g) == 1 else sum(g) / len(g)
                          for mid in cols.module_ids]
    return cols


def _out_grad_norms(rec: StepRecord, plain: list[list[float]]) -> dict[int, list[float]]:
    """Module id -> the norms of its outputs' gradients (MAX_CALLS_MEASURED calls at most), in call order."""
    norms = {mid: [plain[s.slot][s.pos] for s in slots] for mid, slots in rec.out_grads.items()}
    retained = rec.retained_norms
    if retained is not None:
        vec = plain[retained.slot]
        for value, sharing in zip(vec[retained.start:], retained.sharing, strict=True):
            for mid in sharing:
                have = norms.get(mid)
                if have is None:
                    norms[mid] = [value]
                elif len(have) < MAX_CALLS_MEASURED:
                    have.append(value)
    return norms


def _aggregate(values: Fetched, calls: list[CallRecord]) -> tuple[float, float, float, float, float, float,
                                                                  float, bytes]:
    """A module called several times: (mean, std, abs-max, zero, dead, saturated, non-finite, hist)."""
    where = [values.call(k.slot) for k in calls]
    n = len(where)
    mean = sum(cc.mean[j] for cc, j in where) / n
    std = sum(cc.std[j] for cc, j in where) / n
    absmax = max(cc.absmax[j] for cc, j in where)
    dead, sat = where[-1][0].dead_frac[where[-1][1]], sum(cc.sat_frac[j] for cc, j in where) / n
    nonfinite = sum(cc.nonfinite[j] for cc, j in where)
    counts = [sum(col) for col in zip(*(decode_hist(cc.hist[j]) or [] for cc, j in where), strict=True)]
    total = sum(counts)
    zero = counts[ZERO_BIN] / total if total else math.nan
    return mean, std, absmax, zero, dead, sat, nonfinite, encode_hist(counts)


def tensor_columns(step: int, rec: StepRecord, values: Values, update_scales: Mapping[int, float]) -> TensorColumns:
    """One entry per tensor measured in the step. The update norm measured on the sampled values is scaled to
    the whole tensor (``update_scales``: ModelIndex.update_scales); when the sample saw no change but the data
    norm did, the change of the norm is a lower bound of the update."""
    plain = values.plain

    def column(per_tensor: PerTensor) -> list[float | None]:
        return list(map(per_tensor.values(plain).get, tids))

    def first_value(slots: Mapping[int, int]) -> list[float | None]:
        get = slots.get
        return [None if (slot := get(tid)) is None else plain[slot][0] for tid in tids]

    tids = sorted(rec.grads.ids() | rec.data.ids() | rec.arrived | rec.fingerprints.ids())
    cols = TensorColumns(step, tids)
    cols.grad_norm, cols.data_norm, cols.fingerprint = column(rec.grads), column(rec.data), column(rec.fingerprints)
    updates = column(rec.updates)
    after = rec.post.values(plain)
    for j, (tid, sampled) in enumerate(zip(tids, updates, strict=True)):
        if sampled is None:
            continue
        update = sampled * update_scales[tid]
        if update == 0.0:
            post, data = after.get(tid), cols.data_norm[j]
            if post is not None and data is not None and post != data:
                update = abs(post - data)
        updates[j] = update
    cols.update_norm = updates
    cols.stale_grad_norm = first_value(rec.stale)
    cols.local_grad_norm = first_value(rec.local_grads)
    arrived, lrs = rec.arrived, rec.lrs.get
    cols.arrived = [tid in arrived for tid in tids]
    cols.lr = [lrs(tid) for tid in tids]
    return cols


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def module_stat_rows(rank: int, step: int, c: ModuleColumns) -> list[tuple[object, ...]]:
    """Rows of ``module_stats`` (records.MSTAT_COLS), non-finite floats as NULL."""
    return [(rank, mid, step, calls, numel, _finite(mean), _finite(std), _finite(absmax), zero, dead, sat, nonfinite,
             _finite(og), None if tr is None else int(tr), None if ge is None else int(ge), hist)
            for mid, calls, numel, mean, std, absmax, zero, dead, sat, nonfinite, og, tr, ge, hist in zip(
                c.module_ids, c.calls, c.numel, c.mean, c.std, c.absmax, c.zero_frac, c.dead_frac, c.sat_frac,
                c.nonfinite, c.out_grad_norm, c.training, c.grad_enabled, c.hist, strict=True)]


def param_stat_rows(rank: int, step: int, c: TensorColumns) -> list[tuple[object, ...]]:
    """Rows of ``param_stats`` (records.PSTAT_COLS), non-finite floats as NULL."""
    return [(rank, tid, step, _finite(g), _finite(d), _finite(u),
             _finite(u / d) if u is not None and d else None, _finite(lg), _finite(fp))
            for tid, g, d, u, lg, fp in zip(c.tensor_ids, c.grad_norm, c.data_norm, c.update_norm,
                                            c.local_grad_norm, c.fingerprint, strict=True)]


def moved_changes(c: TensorColumns, known: Mapping[int, int]) -> dict[int, int]:
    """The tensors whose 'moved' flag changes with this step: 1 once an update changed it (for good), 0 while
    every observed update left it unchanged."""
    changes: dict[int, int] = {}
    for tid, update, arrived in zip(c.tensor_ids, c.update_norm, c.arrived, strict=True):
        if update is None or not arrived:
            continue
        moved = 1 if update > 0 else 0
        previous = known.get(tid)
        if previous not in (1, moved):
            changes[tid] = max(moved, previous or 0)
    return changes
