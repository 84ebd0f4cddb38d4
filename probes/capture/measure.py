"""Device-side statistics. Everything is reduced where the tensor lives and appended to one
list of small device vectors; ``StepMeasurements.fetch()`` copies them to the host once per
device per sampled step (one host sync), never ``.item()`` per tensor, and derives the rest
there in a batch."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..model.tensors import reads_free
from ..schema import HIST_BINS, HIST_EDGES, ZERO_BIN, decode_hist, encode_hist
from . import batch, tensor_stats

# layout of a call row: CALL_FIELDS, then HIST_BINS histogram counts
CALL_FIELDS = ("mean", "std", "absmax", "zero_frac", "dead_frac", "sat_frac", "nonfinite")
CALL_WIDTH = len(CALL_FIELDS) + HIST_BINS
HIST_SAMPLE = batch.HIST_SAMPLE    # the histogram is taken on at most this many evenly strided values
FLOAT_TYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
NOT_APPLICABLE = -1.0
# True while dynamo traces code that calls the watched model (a compiled function, Lightning's compiled
# validation_step): the hooks then run at trace time. They return at once: their timing (time.perf_counter) would
# break the graph, their bookkeeping would be traced into it, and what they observe belongs to eager calls
is_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor whose placement shards it: each rank holds a different part."""
    placements = getattr(t, "placements", None)
    return type(t).__name__ == "DTensor" and any(type(p).__name__ == "Shard" for p in placements or ())


def float_tensors(output: Any, limit: int = 16) -> list[torch.Tensor]:
    """Floating tensors in a module output: tensor, tuple/list, dict/ModelOutput, dataclass, None."""
    found: list[torch.Tensor] = []

    def visit(obj: Any, depth: int) -> None:
        if len(found) >= limit or depth > 3 or obj is None:
            return
        if isinstance(obj, torch.Tensor):
            if obj.dtype in FLOAT_TYPES and obj.layout == torch.strided and obj.device.type != "meta":
                found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name, None), depth + 1)

    visit(output, 0)
    return found


def primary(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    for t in tensors:
        if t.dim() >= 1 and t.numel() > 0:
            return t
    return tensors[0] if tensors and tensors[0].numel() > 0 else None


class CallLayout(NamedTuple):
    """Where the parts of one call's raw chunk lie (see :func:`call_chunk`). A NamedTuple: one is
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


class UnitActivity:
    """Per-unit 'last sample in which the unit was non-zero', kept on the host per (module, units) in one
    tensor: a unit is dead when it stayed exactly zero over the last ``window`` samples."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._offsets: dict[tuple[Any, int], int] = {}       # (key, units) -> first position in _last
        self._last = torch.empty(0, dtype=torch.int64)
        self._plans: dict[tuple[tuple[Any, int], ...], _ActivityPlan] = {}
        # the last fetch's arrangement (its call plan, held, and its calls' keys) and the activity plan it gave
        self._recent: tuple[object, list[Any], _ActivityPlan] | None = None

    def clear(self) -> None:
        self._offsets.clear()
        self._last = torch.empty(0, dtype=torch.int64)
        self._plans.clear()
        self._recent = None

    def update(self, key: Any, active: torch.Tensor, sample_index: int) -> float:
        """Fold one sample's activity mask (bool, host) in; returns the dead fraction."""
        return float(self.update_many([(key, active.numel())], active, sample_index)[0])

    def update_many(self, keys: list[tuple[Any, int]], active: torch.Tensor, sample_index: int) -> torch.Tensor:
        """Fold in the activity masks of several calls at once: ``active`` is their masks back to back, in the
        order of ``keys`` ((module, units) of each call; a module called twice folds both calls). Returns
        the dead fraction of each call's key, in the order of ``keys`` (float64)."""
        return self._fold(self._plan(keys), active, sample_index)

    def update_calls(self, arrangement: object, call_keys: list[Any], make_keys: Callable[[], list[tuple[Any, int]]],
                     active: torch.Tensor, sample_index: int) -> torch.Tensor:
        """:meth:`update_many` for the calls of one fetch: ``make_keys()`` gives the keys, which depend only on the
        calls' ``arrangement`` (an object standing for their layouts, compared by identity) and ``call_keys``. While
        both repeat (a model calling its modules the same way every sampled step), the last plan is used as it is:
        no key is made or hashed (15,000 of them per step on a model of 15,000 modules)."""
        recent = self._recent
        if recent is not None and recent[0] is arrangement and recent[1] == call_keys:
            plan = recent[2]
        else:
            plan = self._plan(make_keys())
            self._recent = (arrangement, list(call_keys), plan)
        return self._fold(plan, active, sample_index)

    def _plan(self, keys: list[tuple[Any, int]]) -> _ActivityPlan:
        plan = self._plans.get(tuple(keys))
        if plan is None:
            grow = 0
            for k in dict.fromkeys(keys):
                if k not in self._offsets:
                    self._offsets[k] = self._last.numel() + grow
                    grow += k[1]
            if grow:                                    # once for all new keys (one at a time is quadratic)
                self._last = torch.cat([self._last, torch.full((grow,), -1, dtype=torch.int64)])
            positions = torch.cat([torch.arange(self._offsets[k], self._offsets[k] + k[1]) for k in keys])
            unique = {k: i for i, k in enumerate(dict.fromkeys(keys))}
            own = torch.cat([torch.full((k[1],), i, dtype=torch.int64) for k, i in unique.items()])
            span = torch.cat([torch.arange(self._offsets[k], self._offsets[k] + k[1]) for k in unique])
            units = torch.tensor([max(1, k[1]) for k in unique], dtype=torch.float64)
            if len(self._plans) >= 4:
                self._plans.clear()
            plan = self._plans[tuple(keys)] = _ActivityPlan(positions, span, own, units,
                                                            torch.tensor([unique[k] for k in keys]))
        return plan

    def _fold(self, plan: _ActivityPlan, active: torch.Tensor, sample_index: int) -> torch.Tensor:
        self._last[plan.positions[active]] = sample_index
        dead = (self._last[plan.span] < max(0, sample_index - self.window + 1)).to(torch.float64)
        counts = torch.zeros(len(plan.units), dtype=torch.float64).index_add_(0, plan.own, dead)
        return (counts / plan.units)[plan.of_key]


class _ActivityPlan(NamedTuple):
    """Where the units of one arrangement of calls are in UnitActivity's history (made once, reused)."""

    positions: torch.Tensor     # each call's units, back to back
    span: torch.Tensor          # each distinct key's units
    own: torch.Tensor           # the distinct key of each position of ``span``
    units: torch.Tensor         # units per distinct key (float64, at least 1)
    of_key: torch.Tensor        # the distinct key of each call


class StepMeasurements:
    """Small device vectors gathered during one sampled step, fetched in one copy per device.

    Module calls add a raw chunk (sums, per-unit extremes, a histogram sample) and nothing else:
    every derived statistic (std, abs-max, dead units, histogram) is computed after the one host
    copy, in a batch. A hook that runs between the training's own kernels pays for each extra
    small op several times over (cold caches); the batch after the step does not."""

    def __init__(self) -> None:
        self._slots = 0                                     # slots given out so far
        self._vectors: list[tuple[int, torch.Tensor]] = []  # (slot, vector): the plain vectors and call chunks
        self._calls: dict[int, tuple[CallLayout, Any]] = {}
        # the small outputs, reduced together at the end, grouped by layout as they come (interned layouts: hashed
        # by identity), one list per field rather than an object per call: at the end of a step of 15,000 calls,
        # objects made among the training's own allocations lie scattered in memory, and reading them back cost
        # 1-2 us a call in cache misses
        self._small: dict[batch.SmallLayout, _SmallColumns] = {}
        self._layouts: batch.SmallLayouts | None = None     # add_small_call's (hooks bring their own layouts)
        self.changed_keys: set[Any] = set()     # after start_fetch: keys whose small outputs changed in place

    def add(self, vec: torch.Tensor) -> int:
        slot = self._slots
        self._slots = slot + 1
        self._vectors.append((slot, vec.detach()))
        return slot

    def add_call(self, chunk: torch.Tensor, layout: CallLayout, key: Any = None) -> int:
        """A module call's raw chunk from :func:`call_chunk`; its fetched value is a CALL_WIDTH row.
        ``key`` names whose unit-activity history the call extends (its module)."""
        slot = self.add(chunk)
        self._calls[slot] = (layout, key)
        return slot

    def add_small_call(self, x: torch.Tensor, udim: int, sat_kind: str | None, key: Any = None, *,
                       copy: bool = True, watch: bool = False) -> int:
        """A small output (batch.SMALL_OUTPUT values at most): kept now (see :func:`probes.capture.batch.keep`),
        reduced with the others at the end of the step; its fetched value is a CALL_WIDTH row like
        :meth:`add_call`'s, or none when it was changed in place without a copy (not in :attr:`Fetched.where`)."""
        if self._layouts is None:
            self._layouts = batch.SmallLayouts()
        layout = self._layouts.get(x.shape, x.dtype, x.device, udim, sat_kind)
        return self.add_kept(batch.keep(x, layout, copy=copy, watch=watch, version=x._version), key)

    def add_kept(self, call: batch.SmallCall, key: Any = None) -> int:
        """:meth:`add_small_call` for a hook that keeps the output itself (:func:`probes.capture.batch.keep`)."""
        return self.add_small(call.values, call.layout, call.source, call.version, key)

    def add_small(self, values: torch.Tensor, layout: batch.SmallLayout, source: torch.Tensor | None, version: int,
                  key: Any = None) -> int:
        """:meth:`add_kept` with the fields of a :class:`probes.capture.batch.SmallCall` (no object made per call)."""
        slot = self._slots
        self._slots = slot + 1
        columns = self._small.get(layout)
        if columns is None:
            columns = self._small[layout] = _SmallColumns(layout, [], [], [], [], [])
        _, slots, kept, sources, versions, keys = columns
        slots.append(slot)
        kept.append(values)
        if source is None:
            sources.append(_UNWATCHED)
            versions.append(_UNWATCHED_VERSION)
        else:
            sources.append(source)
            versions.append(version)
        keys.append(key)
        return slot

    def fetch(self, activity: UnitActivity | None = None, sample_index: int = 0) -> list[list[float]]:
        """Host values of every chunk, in order (see :meth:`start_fetch`); waits for the copy."""
        return self.start_fetch().values(activity, sample_index)

    def start_fetch(self) -> PendingFetch:
        """Start the step's host copy: one concatenation and one copy per device. On devices in
        DEFERRED_COPY_DEVICES the copy goes non-blocking into pinned memory and is read later
        (:meth:`PendingFetch.values`), so the training loop does not wait for the device."""
        # per device: plain vectors first (only they are turned into Python lists whole), then calls
        plain: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        single: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, c in self._vectors:
            (single if i in self._calls else plain).setdefault(c.device, []).append((i, c))
        batches: dict[torch.device, list[_SmallColumns]] = {}
        for kept in self._small_groups():
            batches.setdefault(kept.layout.device, []).append(kept)
        groups = []
        for device in dict.fromkeys([*plain, *single, *batches]):
            parts: list[torch.Tensor] = []
            plain_slots: list[tuple[int, int, int]] = []      # slot, start, length
            calls = CallSlots([], [], [], [])
            pos = 0
            for i, c in plain.get(device, []):
                parts.append(c.reshape(-1))
                plain_slots.append((i, pos, parts[-1].numel()))
                pos += parts[-1].numel()
            for i, c in single.get(device, []):
                parts.append(c.reshape(-1))
                layout, key = self._calls[i]
                calls.add(i, pos, layout, key)
                pos += parts[-1].numel()
            by_shape = batches.get(device)
            if by_shape:
                with torch.no_grad():        # kept outputs may require grad: the batch records no graph
                    reduced = batch.reduce_calls([g.values for g in by_shape], [g.layout for g in by_shape],
                                                 reads_free(device))
                parts.append(reduced.chunk)
                for small, group in zip(by_shape, reduced.groups, strict=True):
                    spec = group.spec
                    n, start, width = len(small.slots), pos + group.start, group.width
                    calls.slots.extend(small.slots)
                    calls.starts.extend(range(start, start + n * width, width))
                    calls.layouts.extend([CallLayout(spec.numel, spec.units, True, spec.track, spec.sample,
                                                     reduced.known_nonfinite, spec.sat)] * n)
                    calls.keys.extend(small.keys)
                pos += reduced.chunk.numel()
            parts = [t if t.dtype == torch.float32 else t.to(torch.float32) for t in parts]
            dev = torch.cat(parts)
            host, event = _start_copy(dev)
            groups.append(_FetchGroup(plain_slots, calls, dev, host, event))
        n = self._slots
        self._slots = 0
        self._vectors.clear()
        self._calls.clear()
        self._small = {}
        return PendingFetch(n, groups)

    def _small_groups(self) -> list[_SmallColumns]:
        """The small outputs grouped by layout (in order of first appearance, calls in order within a group),
        without those changed in place after their hook and not copied; sets :attr:`changed_keys`."""
        self.changed_keys = set()
        groups: list[_SmallColumns] = []
        for columns in self._small.values():
            group = columns
            _, slots, values, sources, versions, keys = columns
            if list(map(_VERSION, sources)) != versions:    # one C-level pass; a difference is rare
                lost: set[int] = set()
                for i, (source, version) in enumerate(zip(sources, versions, strict=True)):
                    if source._version != version:           # changed in place after its hook
                        self.changed_keys.add(keys[i])
                        if values[i] is source:
                            lost.add(i)                      # not what the module returned: no row this step
                if lost:
                    kept = [i for i in range(len(slots)) if i not in lost]
                    group = _SmallColumns(columns.layout, *(_picked(field, kept) for field in columns[1:]))
            if group.slots:
                groups.append(group)
        return groups


def _picked(field: list[Any], positions: list[int]) -> list[Any]:
    return [field[i] for i in positions]


class _SmallColumns(NamedTuple):
    """The small outputs of one layout in call order, one list per field: reduced together by
    :func:`probes.capture.batch.reduce_calls`."""

    layout: batch.SmallLayout
    slots: list[int]
    values: list[torch.Tensor]
    sources: list[Any]           # the output itself while its version is watched, else _UNWATCHED
    versions: list[int]          # its version counter at the hook
    keys: list[Any]


class _Unwatched:
    """The source of a small output whose version is not checked: its version never differs."""

    _version = -1


_UNWATCHED = _Unwatched()
_UNWATCHED_VERSION = _Unwatched._version
_VERSION = operator.attrgetter("_version")


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
class _FetchGroup:
    """One device's part of a step's host copy."""

    plain: list[tuple[int, int, int]]
    calls: CallSlots
    dev: torch.Tensor
    host: torch.Tensor
    event: Any


DEFERRED_COPY_DEVICES = {"cuda"}    # device types whose host copy is started non-blocking and read later


def _start_copy(dev: torch.Tensor) -> tuple[torch.Tensor, Any]:
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

    def __init__(self, n_chunks: int, groups: list[_FetchGroup]) -> None:
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


def call_chunk(x: torch.Tensor, extra_nonfinite: Sequence[torch.Tensor], udim: int,
               sat_kind: str | None, scalar_reads_free: bool | None = None) -> tuple[torch.Tensor, CallLayout]:
    """The raw statistics of one module output as one small device vector, and its layout.

    Only what needs the whole tensor is computed here, with as few kernels as possible: the sum,
    E[x^2] as a dot product (Welford's std_mean is 60x slower on CPU), per-unit max and min over
    the non-unit dims, and a copy of <= HIST_SAMPLE evenly strided values for the histogram (and
    the zero fraction). The NaN/Inf count is taken only when E[x^2] is not finite where reading
    a scalar costs no device sync (``scalar_reads_free``, default: :func:`reads_free` of its device), and
    on the device, into the chunk, everywhere else."""
    # detached, so no op below records autograd history (cheaper than entering no_grad per call)
    xf = x.detach()
    if xf.dtype not in (torch.float32, torch.float64):
        xf = xf.float()
    flat = xf.reshape(-1)
    n = flat.numel()
    head = [flat.sum(), torch.dot(flat, flat)]
    track = xf.dim() >= 1
    if not track:
        unit_parts, paired, units = [flat], False, 1
    elif xf.dim() > 1:
        dims = tuple(d for d in range(xf.dim()) if d != udim)
        umax, umin = xf.amax(dim=dims), xf.amin(dim=dims)
        if umax.numel() > MAX_UNITS:
            umax, umin, track = umax.max().reshape(1), umin.min().reshape(1), False
        unit_parts, paired, units = [umax, umin], True, umax.numel()
    elif n <= MAX_UNITS:
        unit_parts, paired, units = [flat], False, n          # a 1-D output: every value is a unit
    else:
        unit_parts, paired, units, track = [flat.amax().reshape(1), flat.amin().reshape(1)], True, 1, False
    known: int | None = None
    on_cpu = reads_free(flat.device) if scalar_reads_free is None else scalar_reads_free
    if on_cpu and not extra_nonfinite and math.isfinite(head[1].item()):
        known = 0
    elif on_cpu:
        known = int(n - torch.isfinite(flat).sum().item())
        known += sum(int(t.numel() - torch.isfinite(t.detach()).sum().item()) for t in extra_nonfinite)
    else:
        nonfinite = n - torch.isfinite(flat).sum()
        for t in extra_nonfinite:
            nonfinite = nonfinite + (t.numel() - torch.isfinite(t.detach()).sum())
        head.append(nonfinite.to(xf.dtype))
    if sat_kind == "tanh":
        head.append((flat.abs() > 0.99).sum().to(xf.dtype) / n)
    elif sat_kind == "sigmoid":
        head.append(((flat < 0.01) | (flat > 0.99)).sum().to(xf.dtype) / n)
    stride = max(1, n // HIST_SAMPLE)
    sample = flat[:stride * HIST_SAMPLE:stride]
    chunk = torch.cat([torch.stack(head), *unit_parts, sample])
    return chunk, CallLayout(n, units, paired, track, sample.numel(), known, sat_kind in ("tanh", "sigmoid"))


def release_caches() -> None:
    """Drop the index tensors cached across steps (a closing watcher calls it: a long notebook session
    watching many models must not keep them, some of which live on an accelerator)."""
    tensor_stats.release_caches()
    _PLANS.clear()
