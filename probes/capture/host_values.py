"""The host side of a sampled step's measurements: the step's one host copy (started by
:meth:`probes.capture.measure.StepMeasurements.start_fetch`, non-blocking where the device allows) and what is
derived from it in a batch on the host: each module call's statistics as columns (:class:`CallColumns`: mean, std,
abs-max, zero, dead and saturated fractions, NaN/Inf count, histogram), plain vectors as lists."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..schema import HIST_BINS, HIST_EDGES, ZERO_BIN, decode_hist, encode_hist
from . import batch

if TYPE_CHECKING:
    from .measure import UnitActivity

__all__ = [
    "CALL_FIELDS",
    "CALL_WIDTH",
    "DEFERRED_COPY_DEVICES",
    "MAX_UNITS",
    "NOT_APPLICABLE",
    "CallColumns",
    "CallLayout",
    "CallSlots",
    "FetchGroup",
    "Fetched",
    "PendingFetch",
    "release_plans",
    "start_copy",
]

# layout of a call row: CALL_FIELDS, then HIST_BINS histogram counts
CALL_FIELDS = ("mean", "std", "absmax", "zero_frac", "dead_frac", "sat_frac", "nonfinite")
CALL_WIDTH = len(CALL_FIELDS) + HIST_BINS
NOT_APPLICABLE = -1.0


class CallLayout(NamedTuple):
    """Where the parts of one call's raw chunk lie (see :func:`probes.capture.measure.call_chunk`). A NamedTuple: one is
    made per module call, and it keys the cached index plan."""
    numel: int
    units: int                  # length of the per-unit max (and min) vectors
    paired: bool                # a per-unit min vector follows the max vector (else one vector is both)
    track: bool                 # the units extend an activity history (dead units); False: not applicable
    sample: int                 # histogram sample length, at the end of the chunk
    nonfinite: int | None       # NaN/Inf count known on the host already; None: it is in the chunk
    sat: bool                   # a saturated fraction is in the chunk

    @property
    def head(self) -> int:
        return 2 + (self.nonfinite is None) + self.sat



class CallSlots(NamedTuple):
    """The module calls of one device's fetch, column by column: call i is slot ``slots[i]``, its raw chunk
    starts at ``starts[i]`` of the host copy, laid out as ``layouts[i]``; ``keys[i]`` names whose unit
    activity it extends."""

    slots: list[int]
    starts: list[int]
    layouts: list[CallLayout]
    keys: list[Any]

    def add(self, slot: int, start: int, layout: CallLayout, key: Any) -> None:
        self.slots.append(slot)
        self.starts.append(start)
        self.layouts.append(layout)
        self.keys.append(key)


@dataclasses.dataclass
class FetchGroup:
    """One device's part of a step's host copy."""

    plain: list[tuple[int, int, int]]
    calls: CallSlots
    dev: torch.Tensor
    host: torch.Tensor
    event: Any


DEFERRED_COPY_DEVICES = {"cuda"}    # device types whose host copy is started non-blocking and read later


def start_copy(dev: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(host tensor, completion event or None). A deferred copy needs pinned memory and an event
    (CUDA); elsewhere the copy is made now (on the CPU there is nothing to copy)."""
    if dev.device.type not in DEFERRED_COPY_DEVICES:
        return dev.cpu(), None
    if dev.device.type != "cuda":
        return dev, None                 # a device type forced into the deferred path (tests): no copy
    try:
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
    except RuntimeError:                 # no pinned memory to be had: copy now rather than lose the sample
        return dev.cpu(), None
    host.copy_(dev, non_blocking=True)
    with torch.cuda.device(dev.device):
        event = torch.cuda.Event()
        event.record()
    return host, event


class PendingFetch:
    """One sampled step's host copy, started by :meth:`StepMeasurements.start_fetch`."""

    def __init__(self, n_chunks: int, groups: list[FetchGroup]) -> None:
        self._n = n_chunks
        self._groups = groups

    @property
    def deferred(self) -> bool:
        """Whether reading the values may wait for a device (the copy was started non-blocking)."""
        return any(g.dev.device.type in DEFERRED_COPY_DEVICES for g in self._groups)

    def ready(self) -> bool:
        """The copy has landed: reading the values now costs no wait."""
        return all(g.event is None or g.event.query() for g in self._groups)

    def read(self, activity: UnitActivity | None = None, sample_index: int = 0) -> Fetched:
        """The host values: plain vectors as lists, calls as columns (waits for the copy)."""
        plain: list[list[float]] = [[] for _ in range(self._n)]
        calls: list[CallColumns] = []
        for g in self._groups:
            if g.event is not None:
                g.event.synchronize()
            if g.plain:
                end = g.plain[-1][1] + g.plain[-1][2]
                flat = g.host[:end].tolist()
                for i, start, n in g.plain:
                    plain[i] = flat[start:start + n]
            if g.calls.slots:
                calls.append(_call_columns(g.host, g.calls, activity, sample_index))
        self._groups = []
        return Fetched(plain, calls)

    def values(self, activity: UnitActivity | None = None, sample_index: int = 0) -> list[list[float]]:
        """Host values of every chunk, in order; call chunks come back as CALL_WIDTH rows."""
        return self.read(activity, sample_index).rows()


class Fetched:
    """A sampled step's host values: ``self[slot]`` is a plain vector's list; a call's statistics are read
    through :meth:`call` (columns, one per device)."""

    def __init__(self, plain: list[list[float]], calls: list[CallColumns]) -> None:
        self.plain = plain
        self.columns = calls

    @functools.cached_property
    def where(self) -> dict[int, tuple[int, int]]:
        """Slot -> (which columns, row): the calls measured (an output changed in place after its hook was not)."""
        return {slot: (c, i) for c, cols in enumerate(self.columns) for i, slot in enumerate(cols.slots)}

    @functools.cached_property
    def row_of(self) -> dict[int, int]:
        """Slot -> row of the first columns (the only ones of a step on one device), made in one C-level pass."""
        slots = self.columns[0].slots if self.columns else []
        return dict(zip(slots, range(len(slots)), strict=True))

    def __getitem__(self, slot: int) -> list[float]:
        return self.plain[slot]

    def call(self, slot: int) -> tuple[CallColumns, int]:
        c, i = self.where[slot]
        return self.columns[c], i

    def rows(self) -> list[list[float]]:
        out = list(self.plain)
        for cols in self.columns:
            for i, slot in enumerate(cols.slots):
                out[slot] = cols.row(i)
        return out


MAX_UNITS = batch.MAX_UNITS    # per-unit activity is tracked up to this many units per output


def _segments(starts: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the concatenated ranges [s, s + n) and, for each, the index of its range."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    total = int(sum(lengths))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lens, output_size=total)
    first = torch.tensor(starts, dtype=torch.int64) - (torch.cumsum(lens, 0) - lens)
    return first[seg] + torch.arange(total), seg


_INNER_EDGES = torch.tensor(HIST_EDGES, dtype=torch.float32)


def _bin_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Per top 16 bits of a float32 (sign, exponent, 7 mantissa bits): the histogram bin of the smallest
    float with those bits, and the edge among them (+inf where there is none: no two edges are that close),
    at or above which a value is one bin further. Bins grow with the value, so this is exact."""
    prefix = torch.arange(1 << 16, dtype=torch.int32) << 16
    ends = torch.stack([prefix.view(torch.float32), (prefix | 0xFFFF).view(torch.float32)])
    low = torch.nan_to_num(ends.amin(0), nan=math.inf)        # negative floats: more bits, smaller value
    bins = torch.bucketize(ends, _INNER_EDGES, right=True)
    base = bins.amin(0)
    split = bins.amax(0) > base
    edge = _INNER_EDGES[base.clamp(max=len(HIST_EDGES) - 1)]
    return base, torch.where(split & torch.isfinite(low), edge, torch.full_like(edge, math.inf))


_BIN_BASE, _BIN_EDGE = _bin_tables()
_BIN_BASE = _BIN_BASE.to(torch.int32)      # int32 all along: int64 index arithmetic costs twice as much
_LITTLE_ENDIAN = sys.byteorder == "little"


def _bins(values: torch.Tensor) -> torch.Tensor:
    """torch.bucketize(values, HIST_EDGES, right=True) as int32, for finite float32 values on the host, by
    table lookup of their top bits (a binary search costs some 20 ns a value in mispredicted branches)."""
    if _LITTLE_ENDIAN and values.is_contiguous():
        key = values.view(torch.uint16)[1::2].to(torch.int32)     # the high half of each float
    else:
        key = (values.view(torch.int32) >> 16) & 0xFFFF
    bins = _BIN_BASE.index_select(0, key)
    bins += values >= _BIN_EDGE.index_select(0, key)
    return bins


@dataclasses.dataclass
class _CallPlan:
    """Index tensors into the fetched buffer for one arrangement of call chunks. A model's
    sampled steps repeat the same arrangement, so the plan is built once and reused."""
    pmax: torch.Tensor
    pmin: torch.Tensor
    seg: torch.Tensor
    psamp: torch.Tensor
    hist_base: torch.Tensor     # per sample value: its call's first bin in the flattened histograms
    heads: torch.Tensor
    head_sum: torch.Tensor      # per call: where its sum, sum of squares, NaN/Inf count and saturated
    head_sq: torch.Tensor       # fraction are in the host buffer (the last two -1 where the call has none)
    head_nonfinite: torch.Tensor
    head_sat: torch.Tensor
    known_nonfinite: torch.Tensor   # per call: the count known on the host (NaN: it is in the buffer)
    numel: torch.Tensor         # float64
    tracked_calls: list[int]    # calls whose units extend an activity history
    tracked_units: torch.Tensor | None   # their units' positions among all calls' units


_PLANS: dict[tuple[tuple[int, ...], tuple[CallLayout, ...]], _CallPlan] = {}


def _plan(starts: list[int], lays: list[CallLayout]) -> _CallPlan:
    key = (tuple(starts), tuple(lays))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    max_starts = [s + lay.head for s, lay in zip(starts, lays, strict=True)]
    min_starts = [m + lay.units if lay.paired else m for m, lay in zip(max_starts, lays, strict=True)]
    units = [lay.units for lay in lays]
    pmax, seg = _segments(max_starts, units)
    pmin, _ = _segments(min_starts, units)
    psamp, sseg = _segments([m + lay.units * (1 + lay.paired) for m, lay in zip(max_starts, lays, strict=True)],
                            [lay.sample for lay in lays])
    heads = torch.tensor([s + j for s, lay in zip(starts, lays, strict=True) for j in range(lay.head)],
                         dtype=torch.int64)
    head_nf = [s + 2 if lay.nonfinite is None else -1 for s, lay in zip(starts, lays, strict=True)]
    head_sat = [s + 2 + (lay.nonfinite is None) if lay.sat else -1 for s, lay in zip(starts, lays, strict=True)]
    unit_ends = torch.cumsum(torch.tensor(units), 0).tolist()
    tracked = [c for c, lay in enumerate(lays) if lay.track]
    tracked_units = (torch.cat([torch.arange(unit_ends[c] - lays[c].units, unit_ends[c]) for c in tracked])
                     if tracked else None)
    if len(_PLANS) >= 2:          # a few MB each on a large model; a run repeats one arrangement
        _PLANS.clear()
    plan = _PLANS[key] = _CallPlan(
        pmax, pmin, seg, psamp, (sseg * HIST_BINS).to(torch.int32), heads, torch.tensor(starts, dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64) + 1, torch.tensor(head_nf, dtype=torch.int64),
        torch.tensor(head_sat, dtype=torch.int64),
        torch.tensor([math.nan if lay.nonfinite is None else float(lay.nonfinite) for lay in lays],
                     dtype=torch.float64),
        torch.tensor([lay.numel for lay in lays], dtype=torch.float64), tracked, tracked_units)
    return plan


class CallColumns(NamedTuple):
    """Every call's statistics of one fetch (index: the call's position in ``slots``): ``stats`` holds one
    float64 row per call, CALL_FIELDS in order (NaN zero fraction: no sample; NOT_APPLICABLE dead or saturated
    fraction), kept as a tensor so that decoding picks and cleans whole columns at once; ``hist`` holds each
    call's histogram as stored (schema.encode_hist)."""

    slots: list[int]
    stats: torch.Tensor
    hist: list[bytes]

    def row(self, i: int) -> list[float]:
        """Call ``i`` as a CALL_WIDTH row (CALL_FIELDS, then the HIST_BINS counts)."""
        return [*self.stats[i].tolist(), *(decode_hist(self.hist[i]) or [])]


def _pick(host: torch.Tensor, positions: torch.Tensor, missing: float) -> torch.Tensor:
    """host[positions] in float64, ``missing`` where the position is -1."""
    out = host[positions.clamp(min=0)].double()
    return torch.where(positions >= 0, out, torch.full_like(out, missing))


def _call_columns(host: torch.Tensor, calls: CallSlots,
                  activity: UnitActivity | None, sample_index: int) -> CallColumns:
    """Every statistic of every call from their raw chunks in ``host`` (CPU), vector by vector: extremes,
    moments, histograms, per-module unit activity. Nothing here runs a loop per call but the dead
    fractions' lookup."""
    n_calls = len(calls.slots)
    # the plan is relative to the first call: plain vectors before it change size from step to step
    base = calls.starts[0]
    host = host[base:]
    plan = _plan([s - base for s in calls.starts] if base else calls.starts, calls.layouts)
    umax, umin = host.index_select(0, plan.pmax), host.index_select(0, plan.pmin)
    hi = torch.full((n_calls,), float("nan")).scatter_reduce_(0, plan.seg, umax, "amax", include_self=False).double()
    lo = torch.full((n_calls,), float("nan")).scatter_reduce_(0, plan.seg, umin, "amin", include_self=False).double()
    sample = host.index_select(0, plan.psamp)
    if math.isfinite(float(sample.sum())):           # no NaN/Inf (one pass, cheaper than isfinite().all())
        idx = plan.hist_base + _bins(sample)
    else:
        finite = torch.isfinite(sample)
        idx = plan.hist_base[finite] + _bins(sample[finite])
    hists = torch.bincount(idx, minlength=n_calls * HIST_BINS).view(n_calls, HIST_BINS)
    total = hists.sum(1).double()
    zero = torch.where(total > 0, hists[:, ZERO_BIN].double() / total.clamp(min=1), torch.full_like(total, math.nan))
    blob = hists.clamp(max=65535).to(torch.int32).to(torch.int16).contiguous()    # the uint16 bit pattern
    raw = ctypes.string_at(blob.data_ptr(), blob.numel() * 2)
    width = HIST_BINS * 2
    hist_bytes = [raw[i:i + width] for i in range(0, n_calls * width, width)]
    if sys.byteorder == "big":
        hist_bytes = [encode_hist(decode_hist(b) or []) for b in hist_bytes]
    s, d = host[plan.head_sum].double(), host[plan.head_sq].double()
    mean = s / plan.numel
    var = d / plan.numel - mean * mean
    # exactly 0 for a constant output (E[x^2] - mean^2 would leave rounding noise); NaN stays NaN
    zeros = torch.zeros_like(var)
    spread = torch.where(var > 0, var.clamp(min=0).sqrt(), torch.where(torch.isnan(var), var, zeros))
    std = torch.where(hi == lo, zeros, spread)
    nonfinite = torch.where(torch.isnan(plan.known_nonfinite), _pick(host, plan.head_nonfinite, math.nan),
                            plan.known_nonfinite)
    sat = _pick(host, plan.head_sat, NOT_APPLICABLE)
    absmax = torch.maximum(hi, -lo)
    dead = torch.full((n_calls,), NOT_APPLICABLE, dtype=torch.float64)
    if activity is not None and plan.tracked_calls:
        active = (umax > 0) | (umin < 0)
        keys_of, layouts = calls.keys, calls.layouts
        fractions = activity.update_calls(
            plan, keys_of, lambda: [(keys_of[c], layouts[c].units) for c in plan.tracked_calls],
            active[plan.tracked_units], sample_index)
        if len(fractions) == n_calls:            # every call tracked: the common case
            dead = fractions
        else:
            dead[plan.tracked_calls] = fractions
    stats = torch.stack([mean, std, absmax, zero, dead, sat, nonfinite], 1)     # CALL_FIELDS, in order
    return CallColumns(calls.slots, stats, hist_bytes)


def release_plans() -> None:
    """Drop the cached index plans (a few MB each on a large model)."""
    _PLANS.clear()
