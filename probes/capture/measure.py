"""Device-side statistics. Everything is reduced where the tensor lives and appended to one
list of small device vectors; ``StepMeasurements.fetch()`` copies them to the host once per
device per sampled step (one host sync), never ``.item()`` per tensor, and derives the rest
there in a batch."""
from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..model.tensors import reads_free
from . import batch, host_values, tensor_stats
from .host_values import (
    MAX_UNITS,
    CallLayout,
    CallSlots,
    FetchGroup,
    PendingFetch,
    start_copy,
)

HIST_SAMPLE = batch.HIST_SAMPLE    # the histogram is taken on at most this many evenly strided values
FLOAT_TYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
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
            host, event = start_copy(dev)
            groups.append(FetchGroup(plain_slots, calls, dev, host, event))
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
    host_values.release_plans()
