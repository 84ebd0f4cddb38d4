"""Decoding a sampled step: pure functions from the fetched host values of a :class:`~probes.capture.step.StepRecord`
to columns of per-module and per-tensor statistics (what the detectors read) and to store rows. No hooks, no
I/O.

Columns, not an object per module: a model of 15,000 modules would otherwise leave 15,000 objects behind
every sampled step, and Python's collector would walk them all again and again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import NamedTuple, cast

import torch

from ..schema import ZERO_BIN, decode_hist, encode_hist
from ..store.records import ColumnRows
from .host_values import CALL_FIELDS, Fetched
from .record import MAX_CALLS_MEASURED, CallRecord, PerTensor, StepRecord

Values = Fetched       # a sampled step's host values (probes.capture.host_values.PendingFetch.read)


MODULE_STATS = CALL_FIELDS      # the columns of ModuleColumns.stats: each call's, aggregated per module
_FIRST = operator.itemgetter(0)
_SLOT, _ORDER = operator.attrgetter("slot"), operator.attrgetter("order")
_TRAINING, _GRAD_ENABLED = operator.attrgetter("training"), operator.attrgetter("grad_enabled")
_PER_UNIT = operator.attrgetter("per_unit")
_NUMEL = operator.attrgetter("numel")
_MEAN, _DEAD, _SAT, _NONFINITE = (MODULE_STATS.index(f) for f in ("mean", "dead_frac", "sat_frac", "nonfinite"))


class SharedCalls(NamedTuple):
    """A module measured in several calls of one step (one ReLU applied after a block's first conv and again after
    its residual add): each call's units and spread are its own, judged apart (its row's dead fraction is its
    worst call's)."""

    row: int                    # the module's row in the columns
    called: int                 # its calls in the step (measured or not)
    dead_call: int              # the call (0: the first) whose dead fraction is the module's: the largest
    per_unit: int               # that call's values per unit
    flat: int                   # bit k: call k's output is flat (std 0 over more than one value)
    orders: tuple[int, ...]     # the execution order of each call read (the first's is the module's order)
    calls: tuple[int, ...]      # which call each of those is (0: the first)
    # (dead fraction, numel, std, mean) of each of those outputs (NaN: not applicable)
    rows: tuple[tuple[float, float, float, float], ...]


class NonFiniteModule(NamedTuple):
    """A module that produced non-finite values in a sampled step."""

    module_id: int
    values: int                    # NaN/Inf values
    # only -inf (no NaN or +inf: its mean is then -inf), as masking writes (masked_fill(mask, -inf) before a
    # softmax or a loss): harmless unless NaN or Inf follow
    minus_inf_only: bool


@dataclasses.dataclass
class ModuleColumns:
    """One sampled step's statistics of every module measured in it, column by column (same order).

    ``stats`` holds the floating statistics, one float64 row per module, MODULE_STATS in order, NaN where a
    statistic does not apply (no sample, no units tracked, not a saturating activation); the moments are as
    measured (NaN or Inf when the output had some) and ``nonfinite`` is the NaN/Inf count. A tensor, not lists:
    the detectors take whole columns of it and the store's rows clean them column by column."""

    step: int
    module_ids: list[int] = dataclasses.field(default_factory=list)
    calls: list[int] = dataclasses.field(default_factory=list)
    numel: list[int] = dataclasses.field(default_factory=list)
    per_unit: list[int] = dataclasses.field(default_factory=list)    # values per unit (first call); 0: no units
    stats: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0, len(MODULE_STATS),
                                                                                   dtype=torch.float64))
    out_grad_norm: list[float] = dataclasses.field(default_factory=list)     # NaN: no gradient reached it
    order: list[int] = dataclasses.field(default_factory=list)      # execution order of its first call
    training: list[bool] = dataclasses.field(default_factory=list)
    grad_enabled: list[bool] = dataclasses.field(default_factory=list)
    hist: list[bytes] = dataclasses.field(default_factory=list)     # as stored (schema.encode_hist)
    shared: dict[int, SharedCalls] = dataclasses.field(default_factory=dict)   # modules measured in several calls

    def nonfinite_in_order(self) -> list[NonFiniteModule]:
        """The modules that produced non-finite values, in execution order."""
        counts = self.stats[:, _NONFINITE]
        rows = counts.nonzero().flatten().tolist()
        if not rows:
            return []
        means = self.stats[:, _MEAN]
        bad = sorted((self.order[i], self.module_ids[i], int(counts[i]), bool(means[i] == -math.inf)) for i in rows)
        return [NonFiniteModule(m, n, minus_inf) for _, m, n, minus_inf in bad]


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
    abs-max, sum of non-finite counts and histograms; the dead fraction is the window's, of each call apart: its
    largest), what each showed kept in :attr:`ModuleColumns.shared`.

    Column by column: every fetched call's statistics are laid end to end, each module picks its position,
    and each column is taken in one C-level pass (a model of 15,000 modules measures 15,000 per step)."""
    cols = ModuleColumns(step)
    single = _single_calls(rec, values)
    if single is not None:               # the common case, in C-level passes
        positions, firsts = single
        cols.module_ids = list(rec.rows)
        agg: list[tuple[list[float], bytes]] = []
    else:
        positions, firsts, cols.module_ids, agg = _any_calls(rec, values, cols.shared)
    if not positions:
        return cols

    parts = [c.stats for c in values.columns]
    hists: list[bytes] = [h for c in values.columns for h in c.hist] if len(values.columns) != 1 \
        else values.columns[0].hist
    if agg:
        parts.append(torch.tensor([a[0] for a in agg], dtype=torch.float64))
        hists = [*hists, *(a[1] for a in agg)]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts)
    stats = whole.index_select(0, torch.tensor(positions, dtype=torch.int64))
    cols.numel = list(map(_NUMEL, firsts))
    cols.per_unit = list(map(_PER_UNIT, firsts))
    for shared in cols.shared.values():
        cols.per_unit[shared.row] = shared.per_unit
    counts = stats[:, _NONFINITE]
    # a count not measured (NaN) says every value may be non-finite; dead and saturated fractions that do not
    # apply (NOT_APPLICABLE) become NaN like the zero fraction without a sample
    stats[:, _NONFINITE] = torch.where(torch.isnan(counts), torch.tensor(cols.numel, dtype=torch.float64),
                                       counts.trunc())
    fractions = stats[:, _DEAD:_SAT + 1]
    stats[:, _DEAD:_SAT + 1] = torch.where(fractions < 0, math.nan, fractions)
    cols.stats = stats
    cols.hist = list(map(hists.__getitem__, positions))
    cols.calls = list(map(rec.calls.__getitem__, cols.module_ids))   # every module with a row was counted (capture)
    cols.order = list(map(_ORDER, firsts))
    cols.training = list(map(_TRAINING, firsts))
    cols.grad_enabled = list(map(_GRAD_ENABLED, firsts))
    nan = math.nan
    one_each = _single_out_grad_norms(rec, values.plain)
    if one_each is not None:
        cols.out_grad_norm = list(map(one_each.get, cols.module_ids, itertools.repeat(nan)))
    else:
        get = _out_grad_norms(rec, values.plain).get
        cols.out_grad_norm = [nan if not (g := get(mid)) else g[0] if len(g) == 1 else sum(g) / len(g)
                              for mid in cols.module_ids]
    return cols


def _any_calls(rec: StepRecord, values: Fetched, shared: dict[int, SharedCalls]
               ) -> tuple[list[int], list[CallRecord], list[int], list[tuple[list[float], bytes]]]:
    """(positions, first calls, module ids, aggregates) of the modules measured in the step, whatever the number
    of their calls and devices: every device's columns end to end, then the aggregates of modules called more
    than once (and, into ``shared``, what each of their calls showed)."""
    where = values.where
    offsets, off = [], 0
    for c in values.columns:
        offsets.append(off)
        off += len(c.slots)
    agg: list[tuple[list[float], bytes]] = []
    positions: list[int] = []
    firsts: list[CallRecord] = []
    module_ids: list[int] = []
    for mid, all_calls in rec.rows.items():
        if len(all_calls) == 1:
            first = all_calls[0]
            loc = where.get(first.slot)
            if loc is None:
                continue                # its only output was changed in place before it could be read
            positions.append(offsets[loc[0]] + loc[1])
        else:
            read = [i for i, k in enumerate(all_calls) if k.slot in where]     # i: which call (0: the first)
            if not read:
                continue
            first = all_calls[read[0]]
            if len(read) == 1:
                loc = where[first.slot]
                positions.append(offsets[loc[0]] + loc[1])
            else:
                calls = [all_calls[i] for i in read]
                row, hist, worst, flat, each = _aggregate(values, calls)
                agg.append((row, hist))
                positions.append(off + len(agg) - 1)
                shared[mid] = SharedCalls(len(module_ids), rec.calls.get(mid, len(all_calls)), read[worst],
                                          calls[worst].per_unit,
                                          sum(1 << read[i] for i in range(len(read)) if flat[i]),
                                          tuple(map(_ORDER, calls)), tuple(read), tuple(each))
        module_ids.append(mid)
        firsts.append(first)
    return positions, firsts, module_ids, agg


def _single_calls(rec: StepRecord, values: Fetched) -> tuple[list[int], list[CallRecord]] | None:
    """(positions, first calls) of the modules in ``rec.rows`` order when every module was called once, on one
    device, and every call was read; else None (the general path)."""
    calls = list(rec.rows.values())
    if len(values.columns) != 1 or list(map(len, calls)).count(1) != len(calls):
        return None
    firsts: list[CallRecord] = list(map(_FIRST, calls))
    found: list[int | None] = list(map(values.row_of.get, map(_SLOT, firsts)))
    if None in found:
        return None                      # an output changed in place before it could be read
    return cast(list[int], found), firsts


def _single_out_grad_norms(rec: StepRecord, plain: list[list[float]]) -> dict[int, float] | None:
    """Module id -> the norm of its output's gradient when every norm came from autograd's kept gradients, one
    output per module (the common case of small outputs); else None (the general path, :func:`_out_grad_norms`)."""
    if rec.out_grads:
        return None
    retained = rec.retained_norms
    if retained is None:
        return {}
    sharing = retained.sharing
    norms_of = plain[retained.slot][retained.start:]
    if len(norms_of) != len(sharing):
        return None
    # each output's norm for every module sharing it (a container returning its last child's output)
    mids = list(itertools.chain.from_iterable(sharing))
    norms = dict(zip(mids, itertools.chain.from_iterable(map(itertools.repeat, norms_of, map(len, sharing))),
                     strict=True))
    return norms if len(norms) == len(mids) else None    # a module with several outputs: averaged (general path)


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


def _aggregate(values: Fetched, calls: list[CallRecord]
               ) -> tuple[list[float], bytes, int, list[bool], list[tuple[float, float, float, float]]]:
    """A module called several times: its row of the calls' stats (host_values.CALL_FIELDS), its histogram, the
    call whose dead fraction (each call's units are tracked apart) is the row's (the largest, the first of equals)
    and, per call, whether its output was flat (std 0 over more than one value) and its (dead fraction, numel, std,
    mean)."""
    where = [values.call(k.slot) for k in calls]
    rows = [cc.stats[j].tolist() for cc, j in where]
    n = len(rows)
    mean = sum(r[0] for r in rows) / n
    std = sum(r[1] for r in rows) / n
    absmax = max(r[2] for r in rows)
    deads = [r[4] if r[4] == r[4] else -math.inf for r in rows]        # NaN: none
    worst = deads.index(max(deads))
    dead, sat = rows[worst][4], sum(r[5] for r in rows) / n
    nonfinite = sum(r[6] for r in rows)
    counts = [sum(col) for col in zip(*(decode_hist(cc.hist[j]) or [] for cc, j in where), strict=True)]
    total = sum(counts)
    zero = counts[ZERO_BIN] / total if total else math.nan
    flat = [r[1] == 0 and k.numel > 1 for r, k in zip(rows, calls, strict=True)]
    each = [(r[4] if r[4] >= 0 else math.nan, float(k.numel), r[1], r[0]) for r, k in zip(rows, calls, strict=True)]
    return [mean, std, absmax, zero, dead, sat, nonfinite], encode_hist(counts), worst, flat, each


def tensor_columns(step: int, rec: StepRecord, values: Values, update_scales: Mapping[int, float]) -> TensorColumns:
    """One entry per tensor measured in the step. The update norm measured on the sampled values is scaled to
    the whole tensor (``update_scales``: Evaluator.update_scales); when the sample saw no change but the data
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
    in_rows = rec.table_updates.values(plain) if rec.table_updates else {}
    for j, (tid, sampled) in enumerate(zip(tids, updates, strict=True)):
        if sampled is None:
            continue
        update = sampled * update_scales[tid]
        if update == 0.0:
            post, data = after.get(tid), cols.data_norm[j]
            if post is not None and data is not None and post != data:
                update = abs(post - data)
            # an embedding table: the change in the rows its gradient reached (a lower bound, as the above)
            update = max(update, in_rows.get(tid, 0.0))
        updates[j] = update
    cols.update_norm = updates
    cols.stale_grad_norm = first_value(rec.stale)
    if rec.rezeroed:           # zeroed in place before a later backward of the step: not stale for its optimizer
        zeroed = {tid for tid, slots in rec.rezeroed.items() if any(plain[s][0] == 0.0 for s in slots)}
        cols.stale_grad_norm = [None if tid in zeroed else v for tid, v in zip(tids, cols.stale_grad_norm, strict=True)]
    cols.local_grad_norm = first_value(rec.local_grads)
    arrived, lrs = rec.arrived, rec.lrs.get
    cols.arrived = [tid in arrived for tid in tids]
    cols.lr = [lrs(tid) for tid in tids]
    if rec.device_lrs:                    # held on a device: fetched with the step's values
        slot_of = rec.device_lrs.get
        cols.lr = [lr if (at := slot_of(tid)) is None else plain[at.slot][at.pos]
                   for tid, lr in zip(tids, cols.lr, strict=True)]
    return cols


def floats(values: Sequence[float | int | bool | None]) -> torch.Tensor:
    """A column as float64, NaN for None (the common column has no None: converted in one call)."""
    try:
        return torch.tensor(values, dtype=torch.float64)
    except TypeError:
        if values.count(None) == len(values):      # a column no value was measured for (stale or local grads)
            return torch.full((len(values),), math.nan, dtype=torch.float64)
        return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)


def module_stat_rows(rank: int, step: int, c: ModuleColumns) -> ColumnRows:
    """Rows of ``module_stats`` (records.MSTAT_COLS), non-finite floats as NULL: as NaN, which SQLite stores as
    NULL (column by column, not a call per value: a model of 15,000 modules has 60,000 of them per step)."""
    n = len(c.module_ids)
    out_grad_norms = torch.tensor(c.out_grad_norm, dtype=torch.float64).reshape(n, 1)
    measured = torch.cat([c.stats[:, :_NONFINITE], out_grad_norms], 1)
    mean, std, absmax, zero, dead, sat, og = torch.where(torch.isfinite(measured), measured, math.nan).T.tolist()
    nonfinite = c.stats[:, _NONFINITE].to(torch.int64).tolist()
    return ColumnRows([[rank] * n, c.module_ids, [step] * n, c.calls, c.numel, mean, std, absmax, zero, dead, sat,
                       nonfinite, og, list(map(int, c.training)), list(map(int, c.grad_enabled)), c.hist])


def param_stat_rows(rank: int, step: int, c: TensorColumns) -> ColumnRows:
    """Rows of ``param_stats`` (records.PSTAT_COLS), non-finite floats as NULL (as NaN, which SQLite stores as
    NULL; the update ratio is NULL too where the data norm is 0 or missing)."""
    n = len(c.tensor_ids)
    grad, data, update = floats(c.grad_norm), floats(c.data_norm), floats(c.update_norm)
    cols = torch.stack([grad, data, update, update / data, floats(c.local_grad_norm), floats(c.fingerprint),
                        floats(c.lr)])
    g, d, u, ratio, lg, fp, lr = torch.where(torch.isfinite(cols), cols, math.nan).tolist()
    return ColumnRows([[rank] * n, c.tensor_ids, [step] * n, g, d, u, ratio, lg, fp, lr])


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
