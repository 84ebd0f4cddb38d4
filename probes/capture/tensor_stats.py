"""Per-tensor statistics of a sampled step, reduced on the tensor's device: L2 norms of many tensors at
once (gradients, data), the fingerprints replicas must agree on, and the update sampler that compares a
fixed sample of each tensor across ``optimizer.step()``. Index tensors are made once per layout and kept
until :func:`release_caches`."""
from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

_DATA_PTR, _NUMEL = operator.methodcaller("data_ptr"), operator.methodcaller("numel")

UPDATE_SAMPLE = 4096          # values per tensor compared across optimizer.step() for the update norm


def norm32(t: torch.Tensor) -> torch.Tensor:
    """L2 norm as a float32 scalar, accumulated in at least float32 (any float dtype)."""
    norm: torch.Tensor
    if t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu":
        flat = t.reshape(-1)
        norm = torch.dot(flat, flat).sqrt()     # BLAS: about 1.7x faster than vector_norm on the CPU
    elif t.dtype == torch.float32:
        norm = torch.linalg.vector_norm(t)
    elif t.dtype in (torch.float16, torch.bfloat16):
        norm = torch.linalg.vector_norm(t, dtype=torch.float32)
    else:
        norm = torch.linalg.vector_norm(t).to(torch.float32)
    return norm


def _groups(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    first = tensors[0]
    device, dtype = first.device, first.dtype
    if all(t.dtype == dtype and t.device == device for t in tensors):     # the common case, without a dict
        yield list(range(len(tensors))), list(tensors)
        return
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        by_key.setdefault((t.device, t.dtype), []).append(i)
    for idx in by_key.values():
        yield idx, [tensors[i] for i in idx]


_INDEX: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _index(idx: list[int], device: torch.device) -> torch.Tensor:
    """Index tensors on the device, made once (a host-to-device copy per step would be a sync)."""
    key = (tuple(idx), device)
    t = _INDEX.get(key)
    if t is None:
        if len(_INDEX) > 256:
            _INDEX.clear()
        t = _INDEX[key] = torch.tensor(idx, device=device)
    return t


SMALL_NORM = 4096        # tensors of at most this many values are normed together (one reduction for all)


class NormGroup(NamedTuple):
    positions: list[int]         # in the tensor list
    stacked: bool                # one shape of small tensors: stacked and reduced at once


class NormPlan(NamedTuple):
    """How the norms of a list of tensors are taken: groups by device, dtype and (small tensors) shape.
    Making it reads every tensor's shape (a microsecond each), so a list that recurs step after step (the
    parameters) keeps its plan; gradients have their parameters' shapes and share it."""

    n: int
    groups: list[NormGroup]


def plan_norms(tensors: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]] | None = None) -> NormPlan:
    """``shapes``: the tensors' shapes, where the caller has them already."""
    groups: list[NormGroup] = []
    for idx, group in _groups(tensors):
        if len(group) > 8 and all(t.numel() <= SMALL_NORM for t in group):
            # many small tensors: stacked by shape, one reduction per shape beats a kernel (or a foreach entry,
            # or a flattening view) per tensor
            by_shape: dict[tuple[int, ...], list[int]] = {}
            if shapes is None:
                for i, t in zip(idx, group, strict=True):
                    by_shape.setdefault(t.shape, []).append(i)
            else:
                for i in idx:
                    by_shape.setdefault(shapes[i], []).append(i)
            groups.extend(NormGroup(positions, True) for positions in by_shape.values())
        else:
            groups.append(NormGroup(idx, False))
    return NormPlan(len(tensors), groups)


def _group_norms(group: list[torch.Tensor], stacked: bool) -> torch.Tensor:
    """Norms of tensors of one device and dtype (``stacked``: and one small shape), as float32 (accumulated in
    at least float32)."""
    if stacked:
        s = torch.stack(group)
        if s.dtype not in (torch.float32, torch.float64):
            s = s.float()
        dims = tuple(range(1, s.dim()))
        sq = s.square().sum(dim=dims) if dims else s.square()
        return sq.sqrt_().to(torch.float32)
    if group[0].dtype == torch.float32 and hasattr(torch, "_foreach_norm"):
        return torch.stack(torch._foreach_norm(group))
    return torch.stack([norm32(t) for t in group])


def norms(tensors: Sequence[torch.Tensor], plan: NormPlan | None = None) -> torch.Tensor | None:
    """L2 norms of many tensors as one float32 vector on the first tensor's device. ``plan``: this list's
    (:func:`plan_norms`), or that of a list of tensors of the very same devices, dtypes and shapes."""
    if not tensors:
        return None
    if plan is None:
        plan = plan_norms(tensors)
    device = tensors[0].device
    with torch.no_grad():
        if len(plan.groups) == 1:
            return _group_norms(list(tensors), plan.groups[0].stacked).to(device)
        out = torch.empty(len(tensors), dtype=torch.float32, device=device)
        for positions, stacked in plan.groups:
            out[_index(positions, device)] = _group_norms([tensors[i] for i in positions], stacked).to(device)
    return out


FINGERPRINT_VALUES = 16       # values summed into a tensor's fingerprint (replicas must agree on it)


def fingerprints(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Per tensor, the sum of up to FINGERPRINT_VALUES evenly strided values (in float64, returned as
    float32): cheap, and identical on replicas that hold identical tensors. One vector on the first
    tensor's device."""
    if not tensors:
        return None
    device = tensors[0].device
    parts, lengths = [], []
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().reshape(-1)
            n = flat.numel()
            k = min(FINGERPRINT_VALUES, n)
            stride = max(1, n // max(k, 1))
            parts.append(flat[:stride * k:stride].to(device=device, dtype=torch.float64))
            lengths.append(k)
        seg = _segment_ids(tuple(lengths), device)
        sums = torch.zeros(len(tensors), dtype=torch.float64, device=device).index_add_(0, seg, torch.cat(parts))
    return sums.to(torch.float32)


UPDATE_BLOCK = 64             # the update sample is UPDATE_SAMPLE // UPDATE_BLOCK contiguous blocks


def _update_view(t: torch.Tensor) -> torch.Tensor:
    """The update sample of ``t`` as a view: the whole tensor (1-D) when it has at most
    UPDATE_SAMPLE values, else evenly spaced contiguous blocks (2-D, UPDATE_BLOCK wide). Blocks,
    not single strided values: a value every few kilobytes costs a cache line each, and the
    copy would read as much memory as the whole tensor."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= UPDATE_SAMPLE:
        return flat
    blocks = UPDATE_SAMPLE // UPDATE_BLOCK
    return flat.as_strided((blocks, UPDATE_BLOCK), (n // blocks, 1))


def sample_size(numel: int) -> int:
    """How many values the update sample takes from a tensor of ``numel`` values."""
    return max(0, numel) if numel <= UPDATE_SAMPLE else (UPDATE_SAMPLE // UPDATE_BLOCK) * UPDATE_BLOCK


def update_scale(numel: int) -> float:
    """The factor from the norm of the sampled change of a tensor of ``numel`` values to the whole change's."""
    k = sample_size(numel)
    return math.sqrt(numel / k) if k else 0.0


class TouchedRows(NamedTuple):
    """Rows of embedding tables that received gradient this step, and their values before the optimizer step."""

    taken: list[int]               # the positions, among the tables given, of those with a gradient
    rows: list[torch.Tensor]       # per table taken: row indices (a device tensor)
    before: list[torch.Tensor]     # per table taken: those rows' values, copied


def touched_rows(tables: Sequence[torch.Tensor]) -> TouchedRows | None:
    """Up to UPDATE_SAMPLE values of each 2-D table, in rows its gradient reaches (all on the device, no read).
    An embedding's gradient reaches only the rows of the step's ids: the evenly spaced update sample of a large
    table seldom meets one, and its data norm does not resolve their change (float32 resolution at its size), so
    a table that changes every step would read as not updating."""
    taken, rows, before = [], [], []
    for i, t in enumerate(tables):
        g = t.grad
        if g is None or t.dim() != 2 or not t.shape[0] or not t.shape[1]:
            continue
        taken.append(i)
        k = max(1, min(t.shape[0], UPDATE_SAMPLE // t.shape[1]))
        # a dense gradient: the rows with the largest gradient in their first column, one value read per row (a
        # reached row's gradient is dense within the row), not a pass over the whole gradient
        idx = (g._indices()[0][:k] if g.is_sparse
               else torch.topk(g.detach()[:, 0].abs(), k, sorted=False).indices)
        rows.append(idx)
        before.append(t.detach()[idx])          # advanced indexing: a copy
    return TouchedRows(taken, rows, before) if taken else None


def touched_changes(tables: Sequence[torch.Tensor], touched: TouchedRows) -> torch.Tensor:
    """The norm of the change of each table :func:`touched_rows` took (the same list of tables), in its rows
    (float32, on the device)."""
    return torch.stack([torch.linalg.vector_norm(tables[i].detach()[idx].float() - b.float())
                        for i, idx, b in zip(touched.taken, touched.rows, touched.before, strict=True)])


class UpdateSampler:
    """Up to UPDATE_SAMPLE values of each tensor (the whole tensor when it is that small),
    copied before an optimizer step and compared after it: enough to estimate an update's norm
    without cloning the model.

    The views are cached: optimizers update parameters in place, so a view sees every step,
    and a step costs a few concatenations per (device, dtype) instead of a few small ops per
    tensor. A tensor whose storage changed (``p.data = ...``) or that is not contiguous (its
    flat view would be a copy) gets a fresh view. ``clear()`` drops the cache (the watcher does on
    every structure rebuild, so no view outlives the model's own tensors)."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[int, int, torch.Tensor]] = {}
        self._plans: dict[int, _GatherPlan] = {}        # id(list of tensors) -> its plan (the list is kept)

    def clear(self) -> None:
        self._views.clear()
        self._plans.clear()

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        # the flat view depends only on the storage, the number of values and contiguity (t.shape would
        # cost a microsecond a tensor: a torch.Size is made at each read)
        ptr = t.data_ptr()
        entry = self._views.get(id(t))
        if entry is not None and entry[0] == ptr and entry[1] == t.numel():
            return entry[2]
        view = _update_view(t)
        if t.is_contiguous():
            self._views[id(t)] = (ptr, t.numel(), view)
        return view

    def _plan(self, tensors: Sequence[torch.Tensor]) -> list[_GatherGroup]:
        """The views to copy, per (device, dtype) group: whole small tensors first, then the blocks of the
        large ones. A list that recurs (the model index's own) keeps its plan while every tensor keeps its
        storage and size (reading those is a fraction of what planning costs: a view, two dims, a size each)."""
        # two lists of ints, made in C-level passes (no tuple per tensor: 10,000s of tensors, twice a step)
        signature = (list(map(_DATA_PTR, tensors)), list(map(_NUMEL, tensors)))
        plan = self._plans.get(id(tensors))
        if plan is not None and plan.tensors is tensors and plan.signature == signature:
            return plan.groups
        groups = []
        for idx, _ in _groups(tensors):
            views = [self._view(tensors[i]) for i in idx]
            small = [k for k, v in enumerate(views) if v.dim() == 1]
            large = [k for k, v in enumerate(views) if v.dim() == 2]
            order = small + large
            groups.append(_GatherGroup([idx[k] for k in order], [views[k] for k in small], [views[k] for k in large],
                                       tuple(views[k].numel() for k in order)))
        if all(t.is_contiguous() for t in tensors):          # as _view: other views are copies, made each time
            if len(self._plans) >= 16:
                self._plans.clear()
            self._plans[id(tensors)] = _GatherPlan(tensors, signature, groups)
        return groups

    def take(self, tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor, tuple[int, ...]]]:
        """The sampled values now: (tensor positions, one flat copy, sample sizes) per group."""
        with torch.no_grad():
            return [(g.positions, _copy(g), g.lengths) for g in self._plan(tensors)]

    def delta_norms(self, tensors: Sequence[torch.Tensor],
                    taken: list[tuple[list[int], torch.Tensor, tuple[int, ...]]]) -> torch.Tensor | None:
        """||now - taken|| per tensor on the sampled values, as one float32 vector on the first
        tensor's device (scale by sqrt(numel / sample_size) for an estimate of the whole)."""
        if not tensors:
            return None
        device = tensors[0].device
        out = torch.zeros(len(tensors), dtype=torch.float32, device=device)
        groups = self._plan(tensors)
        if len(groups) != len(taken):
            raise ValueError(f"the tensors' devices or dtypes changed during the step: {len(taken)} groups -> "
                             f"{len(groups)}")
        with torch.no_grad():
            for (idx, before, lengths), group in zip(taken, groups, strict=True):
                if group.lengths != lengths or group.positions != idx:
                    raise ValueError(f"sampled sizes changed during the step: {lengths} -> {group.lengths}")
                diff = _copy(group).float()
                diff.sub_(before)
                seg = _segment_ids(lengths, diff.device)
                sq = torch.zeros(len(idx), dtype=torch.float32, device=diff.device).index_add_(0, seg, diff * diff)
                out[_index(idx, device)] = sq.sqrt_().to(device)
        return out


class _GatherGroup(NamedTuple):
    """The update samples of one (device, dtype) group of tensors, in copy order."""

    positions: list[int]            # the tensors' positions in the list, small ones first
    small: list[torch.Tensor]       # whole tensors (1-D views)
    large: list[torch.Tensor]       # sampled blocks (2-D views)
    lengths: tuple[int, ...]        # values taken per tensor, in ``positions`` order


class _GatherPlan(NamedTuple):
    tensors: Sequence[torch.Tensor]         # the list planned: kept, so that its id() (the key) stays its own
    signature: tuple[list[int], list[int]]   # data_ptr and numel of each tensor when planned
    groups: list[_GatherGroup]


def _copy(group: _GatherGroup) -> torch.Tensor:
    """One flat copy of a group's sampled values."""
    parts = []
    if group.small:
        parts.append(torch.cat(group.small))
    if group.large:
        parts.append(torch.cat(group.large).reshape(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


_SEGMENTS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def release_caches() -> None:
    _INDEX.clear()
    _SEGMENTS.clear()


def _segment_ids(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[0]*lengths[0] + [1]*lengths[1] + ... on the device, made once per layout."""
    key = (lengths, device)
    t = _SEGMENTS.get(key)
    if t is None:
        if len(_SEGMENTS) > 64:
            _SEGMENTS.clear()
        lens = torch.tensor(lengths, dtype=torch.int64)
        t = _SEGMENTS[key] = torch.repeat_interleave(torch.arange(len(lengths)), lens).to(device)
    return t
