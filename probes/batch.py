"""Small module outputs, reduced together at the end of a sampled step.

A hook that launches a handful of reductions costs far more than they compute when the output is small
(a 16-wide Linear in a deep stack): each launch has a fixed cost. For outputs of at most SMALL_OUTPUT
values the hook only keeps the output; at the end of the step all of them are concatenated and reduced
in one batch of segment reductions, which produces exactly the raw chunk :func:`probes.measure.call_chunk`
would have made for each call (sum, sum of squares, NaN/Inf count, saturated fraction, per-unit max and
min, a strided histogram sample), so everything downstream reads both alike.

Kept, not copied, where that is safe: an output changed in place later in the step (ReLU(inplace=True)
on a BatchNorm's output, ``out += identity``) would be measured changed. Its version counter says so
(every in-place op bumps it), so the first sampled step copies every output and notes which modules'
outputs change after their hook; those are copied from then on, the others only referenced. An output
found changed without a copy (the model took another path) is not measured that step, and its module
is copied from then on: a statistic is missing, never wrong.

The index tensors of a batch depend only on the step's arrangement of calls (their sizes and unit
counts), which a model repeats from sampled step to sampled step: they are built once and reused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

SMALL_OUTPUT = 4096           # outputs of at most this many values are copied and reduced at the end of the step
HIST_SAMPLE = 1024            # as probes.measure
MAX_UNITS = 1 << 16


class SmallCall(NamedTuple):
    """A copy of one small output (a NamedTuple: one is made per module call). Value i of the flattened
    copy belongs to unit (i // inner) % units, so the histogram samples the very values call_chunk would."""

    values: torch.Tensor      # the output, or a copy of it (any float dtype, its own shape)
    units: int
    inner: int                # the stride of the unit dimension
    track: bool               # per-unit activity is tracked (dead units)
    sat: str | None           # 'tanh' | 'sigmoid' | None
    source: torch.Tensor | None   # the output itself while its version is watched, else None
    version: int              # the output's version counter at the hook

    def changed(self) -> bool:
        """The output was changed in place after its hook."""
        return self.source is not None and self.source._version != self.version

    def lost(self) -> bool:
        """Changed in place and not copied: what is kept is no longer what the module returned."""
        return self.source is not None and self.values is self.source and self.source._version != self.version


def keep(x: torch.Tensor, udim: int, sat_kind: str | None, *, copy: bool, watch: bool) -> SmallCall:
    """What a hook keeps: the output itself, or a copy (``copy``) where an in-place operation later in
    the step would change it; with ``watch`` its version is checked at the end of the step. Only the copy
    is made here (one op); flattening and the float32 conversion happen in the batch."""
    shape = x.shape
    ndim = len(shape)
    if ndim == 0:
        units, inner, track = 1, 1, False
    elif ndim == 1:
        units, inner, track = shape[0], 1, True            # a 1-D output: every value is a unit
    else:
        d = udim % ndim
        units, inner, track = shape[d], math.prod(shape[d + 1:]), True
    values = x.detach().clone(memory_format=torch.contiguous_format) if copy else x
    return SmallCall(values, units, inner, track, sat_kind if sat_kind in ("tanh", "sigmoid") else None,
                     x if watch else None, x._version)


@dataclasses.dataclass(frozen=True)
class ChunkLayoutSpec:
    """What probes.measure.CallLayout needs, per call."""

    numel: int
    units: int
    track: bool
    sample: int
    sat: bool


@dataclasses.dataclass
class _Plan:
    elem_call: torch.Tensor        # [E] call of each value
    elem_unit: torch.Tensor        # [E] global unit of each value
    sample_pos: torch.Tensor       # [S] positions of the histogram samples
    sat_tanh: torch.Tensor | None  # [E] bool: the value belongs to a tanh-like call
    sat_sigmoid: torch.Tensor | None
    perm: torch.Tensor             # positions in the component vector of every value of the chunks
    specs: list[ChunkLayoutSpec]
    chunk_sizes: list[int]
    n_calls: int
    n_units: int


_PLANS: dict[tuple[object, ...], _Plan] = {}


def release_caches() -> None:
    _PLANS.clear()


def _plan(calls: Sequence[SmallCall], order: Sequence[int], with_nonfinite: bool, device: torch.device) -> _Plan:
    """``calls`` in the order their values are concatenated; ``order[j]``: the call's position in the step
    (the chunks come out in the step's order)."""
    key = (device, with_nonfinite, tuple(order),
           tuple((c.values.numel(), c.units, c.inner, c.sat, c.track) for c in calls))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    n_calls = len(calls)
    numels = [c.values.numel() for c in calls]
    units = [c.units for c in calls]
    unit_off = [0]
    for u in units:
        unit_off.append(unit_off[-1] + u)
    elem_call = torch.repeat_interleave(torch.arange(n_calls), torch.tensor(numels))
    elem_unit = torch.cat([torch.arange(n) // c.inner % c.units + unit_off[i]
                           for i, (n, c) in enumerate(zip(numels, calls, strict=True))])
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    sample_parts, samples = [], []
    for i, n in enumerate(numels):
        stride = max(1, n // HIST_SAMPLE)
        pos = torch.arange(0, min(n, stride * HIST_SAMPLE), stride) + starts[i]
        sample_parts.append(pos)
        samples.append(pos.numel())
    sample_pos = torch.cat(sample_parts)
    kinds = [c.sat for c in calls]
    sat_tanh = sat_sigmoid = None
    if "tanh" in kinds:
        sat_tanh = torch.repeat_interleave(torch.tensor([k == "tanh" for k in kinds]), torch.tensor(numels))
    if "sigmoid" in kinds:
        sat_sigmoid = torch.repeat_interleave(torch.tensor([k == "sigmoid" for k in kinds]), torch.tensor(numels))
    # components, in order: sums [C], squares [C], (non-finite [C]), (saturated [C]), unit max [U],
    # unit min [U], samples [S]; each call's chunk picks its values out of them
    has_sat = sat_tanh is not None or sat_sigmoid is not None
    base = {"sum": 0, "sq": n_calls}
    nxt = 2 * n_calls
    if with_nonfinite:
        base["nonfinite"] = nxt
        nxt += n_calls
    if has_sat:
        base["sat"] = nxt
        nxt += n_calls
    base["umax"], base["umin"] = nxt, nxt + unit_off[-1]
    base["sample"] = nxt + 2 * unit_off[-1]
    chunk_parts: list[list[int]] = []
    flat_specs: list[ChunkLayoutSpec] = []
    sample_off = 0
    for i, c in enumerate(calls):
        head = [base["sum"] + i, base["sq"] + i]
        if with_nonfinite:
            head.append(base["nonfinite"] + i)
        if c.sat is not None:
            head.append(base["sat"] + i)
        u = units[i]
        umax = list(range(base["umax"] + unit_off[i], base["umax"] + unit_off[i] + u))
        umin = list(range(base["umin"] + unit_off[i], base["umin"] + unit_off[i] + u))
        smp = list(range(base["sample"] + sample_off, base["sample"] + sample_off + samples[i]))
        sample_off += samples[i]
        chunk_parts.append(head + umax + umin + smp)
        flat_specs.append(ChunkLayoutSpec(numels[i], u, c.track and u <= MAX_UNITS, samples[i], c.sat is not None))
    flat_of = {call: j for j, call in enumerate(order)}         # step position -> concatenation position
    perm = [p for i in range(n_calls) for p in chunk_parts[flat_of[i]]]
    specs = [flat_specs[flat_of[i]] for i in range(n_calls)]
    sizes = [len(chunk_parts[flat_of[i]]) for i in range(n_calls)]
    if len(_PLANS) >= 4:
        _PLANS.clear()
    plan = _PLANS[key] = _Plan(elem_call.to(device), elem_unit.to(device), sample_pos.to(device),
                               None if sat_tanh is None else sat_tanh.to(device),
                               None if sat_sigmoid is None else sat_sigmoid.to(device),
                               torch.tensor(perm, dtype=torch.int64).to(device), specs, sizes, n_calls, unit_off[-1])
    return plan


def reduce_calls(calls: Sequence[SmallCall], scalar_reads_free: bool) -> tuple[torch.Tensor, list[ChunkLayoutSpec],
                                                                                list[int], int | None]:
    """One chunk tensor holding every call's raw chunk back to back, the layout of each, their sizes, and the
    NaN/Inf count when it is known on the host (0 for all calls: only where reading a scalar is free)."""
    device = calls[0].values.device
    # stacked by shape (one op per shape, not a flattening view per call), shapes in order of appearance
    groups: dict[tuple[torch.Size, torch.dtype], list[int]] = {}
    for i, c in enumerate(calls):
        groups.setdefault((c.values.shape, c.values.dtype), []).append(i)
    order = [i for idx in groups.values() for i in idx]
    flat = torch.cat([torch.stack([calls[i].values for i in idx]).reshape(-1).float() for idx in groups.values()])
    squares = flat * flat
    known: int | None = None
    if scalar_reads_free and math.isfinite(float(squares.sum())):
        known = 0
    plan = _plan([calls[i] for i in order], order, known is None, device)
    sums = torch.zeros(plan.n_calls, device=device).index_add_(0, plan.elem_call, flat)
    sq = torch.zeros(plan.n_calls, device=device).index_add_(0, plan.elem_call, squares)
    parts = [sums, sq]
    if known is None:
        bad = (~torch.isfinite(flat)).to(torch.float32)
        parts.append(torch.zeros(plan.n_calls, device=device).index_add_(0, plan.elem_call, bad))
    if plan.sat_tanh is not None or plan.sat_sigmoid is not None:
        mask = torch.zeros_like(flat, dtype=torch.bool)
        if plan.sat_tanh is not None:
            mask |= plan.sat_tanh & (flat.abs() > 0.99)
        if plan.sat_sigmoid is not None:
            mask |= plan.sat_sigmoid & ((flat < 0.01) | (flat > 0.99))
        counts = torch.zeros(plan.n_calls, device=device).index_add_(0, plan.elem_call, mask.to(torch.float32))
        numel = torch.tensor([s.numel for s in plan.specs], dtype=torch.float32, device=device)
        parts.append(counts / numel)
    umax = torch.full((plan.n_units,), -math.inf, device=device).scatter_reduce_(
        0, plan.elem_unit, flat, "amax", include_self=False)
    umin = torch.full((plan.n_units,), math.inf, device=device).scatter_reduce_(
        0, plan.elem_unit, flat, "amin", include_self=False)
    parts += [umax, umin, flat[plan.sample_pos]]
    return torch.cat(parts)[plan.perm], plan.specs, plan.chunk_sizes, known
