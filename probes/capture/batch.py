"""Small module outputs, reduced together at the end of a sampled step.

A hook that launches a handful of reductions costs far more than they compute when the output is small
(a 16-wide Linear in a deep stack): each launch has a fixed cost. For outputs of at most SMALL_OUTPUT
values the hook only keeps the output; at the end of the step all of them are concatenated and reduced
in one batch of segment reductions, which produces exactly the raw chunk :func:`probes.capture.measure.call_chunk`
would have made for each call (sum, sum of squares, NaN/Inf count, saturated fraction, per-unit max and
min, a strided histogram sample), so everything downstream reads both alike.

Kept, not copied, where that is safe: an output changed in place later in the step (ReLU(inplace=True)
on a BatchNorm's output, ``out += identity``) would be measured changed. Its version counter says so
(every in-place op bumps it), so the first sampled step copies every output and notes which modules'
outputs change after their hook; those are copied from then on, the others only referenced. An output
found changed without a copy (the model took another path) is not measured that step, and its module
is copied from then on: a statistic is missing, never wrong.

Calls of one shape and layout (most of a model of many small modules) are stacked and reduced with dense
reductions, a handful of kernels per shape whatever the number of calls; no index plan is needed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

SMALL_OUTPUT = 4096           # outputs of at most this many values are copied and reduced at the end of the step
HIST_SAMPLE = 1024            # as probes.capture.measure
MAX_UNITS = 1 << 16


@dataclasses.dataclass(frozen=True, eq=False)
class SmallLayout:
    """The shape, dtype and device of a small output and how its values map to units: value i of the
    flattened output belongs to unit (i // inner) % units. Made by a :class:`SmallLayouts` table, which
    gives equal layouts one object: the batch groups calls by it, hashed by identity (cheap, once per call)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    units: int
    inner: int                # the stride of the unit dimension
    track: bool               # per-unit activity is tracked (dead units)
    sat: str | None           # 'tanh' | 'sigmoid' | None


class SmallLayouts:
    """Interns :class:`SmallLayout` objects (one table per capture or per batch of measurements)."""

    def __init__(self) -> None:
        self._table: dict[tuple[object, ...], SmallLayout] = {}

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, udim: int,
            sat_kind: str | None) -> SmallLayout:
        """The layout of an output of ``shape`` whose unit dimension is ``udim``."""
        ndim = len(shape)
        sat = sat_kind if sat_kind in ("tanh", "sigmoid") else None
        if ndim == 0:
            units, inner, track = 1, 1, False
        elif ndim == 1:
            units, inner, track = shape[0], 1, True            # a 1-D output: every value is a unit
        else:
            d = udim % ndim
            units, inner, track = shape[d], math.prod(shape[d + 1:]), True
        key = (tuple(shape), dtype, device, units, inner, track, sat)
        layout = self._table.get(key)
        if layout is None:
            layout = self._table[key] = SmallLayout(*key)
        return layout

    def clear(self) -> None:
        self._table.clear()


class SmallCall(NamedTuple):
    """A small output kept by a hook (a NamedTuple: one is made per module call). The histogram samples
    the very values call_chunk would."""

    values: torch.Tensor      # the output, or a copy of it (any float dtype, its own shape)
    layout: SmallLayout
    source: torch.Tensor | None   # the output itself while its version is watched, else None
    version: int              # the output's version counter at the hook


def keep(x: torch.Tensor, layout: SmallLayout, *, copy: bool, watch: bool, version: int) -> SmallCall:
    """What a hook keeps: the output itself, or a copy (``copy``) where an in-place operation later in
    the step would change it; with ``watch`` its version (``version``, read by the hook) is checked at the
    end of the step. Only the copy is made here (one op); flattening and the float32 conversion happen in
    the batch."""
    values = x.detach().clone(memory_format=torch.contiguous_format) if copy else x
    return SmallCall(values, layout, x if watch else None, version)


@dataclasses.dataclass(frozen=True)
class ChunkLayoutSpec:
    """What probes.capture.measure.CallLayout needs, per call (one object for all the calls of a group)."""

    numel: int
    units: int
    track: bool
    sample: int
    sat: bool


class ReducedGroup(NamedTuple):
    """The calls of one group (one shape and layout): call j of the group starts at ``start + j * width`` of
    the batch's chunk."""

    start: int
    width: int
    spec: ChunkLayoutSpec


class ReducedCalls(NamedTuple):
    """The raw chunks of a batch of small calls, back to back in ``chunk``, group by group."""

    chunk: torch.Tensor
    groups: list[ReducedGroup]
    known_nonfinite: int | None       # 0 for all calls when known on the host, else counted into each chunk


def reduce_calls(groups: Sequence[Sequence[torch.Tensor]], layouts: Sequence[SmallLayout],
                 scalar_reads_free: bool) -> ReducedCalls:
    """Every call's raw chunk, as :func:`probes.capture.measure.call_chunk` makes it for one output. ``groups``: the
    kept values of the calls of one layout each (``layouts``: one shape, dtype, device and unit layout), stacked and
    reduced together with dense reductions (per-unit extremes over the non-unit dimensions, like call_chunk):
    a handful of kernels per layout whatever the number of calls. Chunks come out group by group (the
    returned groups say where each is). The NaN/Inf count is known on the host (0) where reading a scalar is
    free and the squares are finite."""
    stacked: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    squares: list[torch.Tensor] = []
    for values in groups:
        v = torch.stack(list(values)).reshape(len(values), -1)
        v = v if v.dtype == torch.float32 else v.float()
        stacked.append(v)
        sums.append(v.sum(1))
        squares.append(torch.linalg.vecdot(v, v))
    known: int | None = None
    if scalar_reads_free and math.isfinite(float(sum(float(q.sum()) for q in squares))):
        known = 0
    mats: list[torch.Tensor] = []
    reduced: list[ReducedGroup] = []
    pos = 0
    for layout, v, total, sq in zip(layouts, stacked, sums, squares, strict=True):
        units, inner, track, sat = layout.units, layout.inner, layout.track, layout.sat
        g, n = v.shape
        head = [total, sq]
        if known is None:
            head.append((~torch.isfinite(v)).sum(1).to(torch.float32))
        if sat == "tanh":
            head.append((v.abs() > 0.99).sum(1).to(torch.float32) / n)
        elif sat == "sigmoid":
            head.append(((v < 0.01) | (v > 0.99)).sum(1).to(torch.float32) / n)
        by_unit = v.view(g, n // (units * inner), units, inner)
        stride = max(1, n // HIST_SAMPLE)
        sample = v[:, :stride * HIST_SAMPLE:stride]
        mat = torch.cat([torch.stack(head, 1), by_unit.amax(dim=(1, 3)), by_unit.amin(dim=(1, 3)), sample], 1)
        mats.append(mat.reshape(-1))
        spec = ChunkLayoutSpec(n, units, track and units <= MAX_UNITS, sample.shape[1], sat is not None)
        reduced.append(ReducedGroup(pos, mat.shape[1], spec))
        pos += mat.numel()
    return ReducedCalls(torch.cat(mats) if len(mats) > 1 else mats[0], reduced, known)
