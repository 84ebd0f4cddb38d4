"""The dense tier: every tensor's gradient norm and weight norm on the steps between full samples.

On a dense step (:meth:`probes.capture.sampling.SamplingPolicy.dense_due`) the values are taken where a full sample
takes ``param_stats.grad_norm`` and ``data_norm``: at each watched optimizer's step (its step pre-hook, a closure's
first evaluation, or an integration's ``begin_optimizer_step``), once the gradients are final (accumulated, unscaled
by a GradScaler, clipped), and, without an optimizer, at the end of the step. One fused reduction per device and dtype
(``torch._foreach_norm`` over the gradients and the tensors together) leaves one small vector on the device; no
module hook exists and nothing is read on the host then. The vectors wait on their device and ride in the next
full sample's one host copy; when DENSE_FLUSH of them wait or the oldest waited FLUSH_S seconds, a copy of their
own starts (non-blocking into pinned memory on CUDA) and is read at a later step boundary once it has landed. On
the CPU that copy is the values themselves, read at once. ``close()`` reads what is left.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import torch

from ..model.index import ModelIndex
from ..store import records
from ..store.records import ColumnRows, Op
from . import measure
from .host_values import Fetched, PendingFetch

DENSE_FLUSH = 64          # dense steps whose values wait before a copy of their own starts
FLUSH_S = 2.0             # ...or seconds the oldest waited (a live dashboard sees them soon)
MAX_UNREAD_STEPS = 4      # a copy of their own is read at the latest this many steps after it started
_NAN = math.nan


class DenseSample(NamedTuple):
    """One reduction of one step: for ``tensor_ids``, their gradient norms (NaN: no gradient), then their
    weight norms, as one float32 vector on their device."""

    step: int
    tensor_ids: list[int]
    values: torch.Tensor


class DenseRide(NamedTuple):
    """Dense samples added to a full sample's host copy: sample ``i``'s values are the fetched vector ``slots[i]``."""

    samples: list[DenseSample]
    slots: list[int]


class _DeviceGroups(NamedTuple):
    """The tensors of one device: their positions in the list, grouped by dtype (one fused reduction per group),
    and their ids in that order (a dense sample's)."""

    groups: list[list[int]]
    ids: list[int]


class _Plan(NamedTuple):
    """One of the index's lists of tensor ids (kept: its id() is the cache key), its tensors (None: some are
    DTensors, read each step for their local shard) and their devices."""

    ids: list[int]
    tensors: list[torch.Tensor] | None
    devices: list[_DeviceGroups]


class _InFlight(NamedTuple):
    samples: list[DenseSample]
    slots: list[int]
    fetch: PendingFetch
    started: int


_DTYPE_ARG = True          # torch._foreach_norm takes dtype= (torch >= 2.4 does; checked at the first call)


def _dense_grad(grad: torch.Tensor | None) -> bool:
    return grad is not None and not grad.is_sparse


def fused_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norms of tensors of one device and dtype as float32 scalars on that device, in one fused call."""
    global _DTYPE_ARG
    if _DTYPE_ARG:
        try:
            return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        except (TypeError, RuntimeError):
            _DTYPE_ARG = False
    if tensors[0].dtype == torch.float32:
        return list(torch._foreach_norm(tensors))
    return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]


class DenseSeries:
    """Takes a dense step's norms on the device and writes them to ``param_series`` once read."""

    def __init__(self, rank: int, submit: Callable[[list[Op]], object], series_taken: Callable[[int], None]) -> None:
        self.rank = rank
        self._submit = submit
        self._series_taken = series_taken        # the store session's thinning count, per dense step written
        self.armed = False                       # the step in progress is a dense step
        self.pending: list[DenseSample] = []
        self._since = 0.0                        # when the oldest pending sample was taken
        self._in_flight: list[_InFlight] = []
        self._index: ModelIndex | None = None
        self._plans: dict[int, _Plan] = {}       # id(list of the index) -> its plan
        self._nan: dict[torch.device, torch.Tensor] = {}
        self._took_orphans = False
        self._took = False                       # values were taken in the step in progress
        self._work_s = 0.0                       # the dense tier's own time in the step in progress

    def arm(self, due: bool) -> None:
        """A new step begins; ``due``: it is a dense step."""
        self.armed = due
        self._took_orphans = self._took = False
        self._work_s = 0.0

    # ------------------------------------------------------------------------------- taking
    def take_optimizer(self, step: int, index: ModelIndex, opt_index: int) -> None:
        """At an optimizer's step: its tensors' norms (and, at the step's first, those of the tensors no optimizer
        holds, as a full sample measures them there too)."""
        t0 = time.perf_counter()
        try:
            if not self._took_orphans:
                self._took_orphans = True
                orphans = index.orphan_tensors()
                if orphans:
                    self._take(step, index, orphans)
            ids = index.optimizer_tensors(opt_index)
            if ids:
                self._take(step, index, ids)
        finally:
            self._work_s += time.perf_counter() - t0

    def take_all(self, step: int, index: ModelIndex) -> None:
        """At the end of a step without an optimizer: every tensor that may hold a gradient."""
        t0 = time.perf_counter()
        try:
            ids = index.gradient_tensors()
            if ids:
                self._take(step, index, ids)
        finally:
            self._work_s += time.perf_counter() - t0

    def _take(self, step: int, index: ModelIndex, ids: list[int]) -> None:
        plan = self._plan(index, ids)
        tensors = plan.tensors if plan.tensors is not None else [index.tensor(t) for t in ids]
        grads = [t.grad for t in tensors] if plan.tensors is not None else [index.grad(t) for t in ids]
        # "is None", never "None in grads": that compares every gradient with None through Tensor.__eq__
        complete = not any(g is None or g.is_sparse for g in grads)
        if not self.pending:
            self._since = time.monotonic()
        self._took = True
        with torch.no_grad():
            for device in plan.devices:
                grad_norms: list[torch.Tensor] = []
                data_norms: list[torch.Tensor] = []
                for group in device.groups:
                    params = [tensors[i] for i in group]
                    present = group if complete else [i for i in group if _dense_grad(grads[i])]
                    norms = fused_norms([*(cast(torch.Tensor, grads[i]) for i in present), *params])
                    if complete:
                        grad_norms += norms[:len(group)]
                    else:                               # NaN (NULL) where a tensor has no gradient
                        by_position = dict(zip(present, norms, strict=False))
                        nan = self._nan_on(params[0].device)
                        grad_norms += [by_position.get(i, nan) for i in group]
                    data_norms += norms[len(present):]
                self.pending.append(DenseSample(step, device.ids, torch.stack(grad_norms + data_norms)))

    def _plan(self, index: ModelIndex, ids: list[int]) -> _Plan:
        if index is not self._index:             # cached tensors must not outlive the index's
            self._index = index
            self._plans.clear()
        plan = self._plans.get(id(ids))
        if plan is not None and plan.ids is ids:
            return plan
        nodes = [index.tensors[t].tensor for t in ids]
        sharded = any(t is None or type(t).__name__ == "DTensor" for t in nodes)
        tensors = [index.tensor(t) for t in ids]
        by_device: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, {}).setdefault(t.dtype, []).append(i)
        devices = []
        for by_dtype in by_device.values():
            groups = list(by_dtype.values())
            order = [ids[i] for group in groups for i in group]
            devices.append(_DeviceGroups(groups, ids if order == ids else order))
        plan = self._plans[id(ids)] = _Plan(ids, None if sharded else tensors, devices)
        return plan

    def _nan_on(self, device: torch.device) -> torch.Tensor:
        nan = self._nan.get(device)
        if nan is None:
            nan = self._nan[device] = torch.full((), _NAN, dtype=torch.float32, device=device)
        return nan

    # ------------------------------------------------------------------------------- reading
    def end_step(self, step: int) -> float | None:
        """The step is over: start a copy of the waiting values when enough wait, read the copies that landed.
        Returns the dense tier's own time in the step (ms), None when it took no values in the step."""
        t0 = time.perf_counter()
        took = self._took
        if self.pending and (len(self.pending) >= DENSE_FLUSH or time.monotonic() - self._since >= FLUSH_S):
            self._start_copy(step)
        if self._in_flight:
            self.collect(step)
        self._work_s += time.perf_counter() - t0
        return self._work_s * 1e3 if took else None

    def ride(self, measurements: measure.StepMeasurements) -> DenseRide | None:
        """The waiting values join a full sample's host copy (read with :meth:`read_ride`)."""
        if not self.pending:
            return None
        samples, self.pending = self.pending, []
        return DenseRide(samples, [measurements.add(s.values) for s in samples])

    def read_ride(self, ride: DenseRide | None, values: Fetched) -> None:
        if ride is not None:
            self._write(ride.samples, [values[slot] for slot in ride.slots])

    def _start_copy(self, step: int) -> None:
        samples, self.pending = self.pending, []
        m = measure.StepMeasurements()
        slots = [m.add(s.values) for s in samples]
        self._in_flight.append(_InFlight(samples, slots, m.start_fetch(), step))

    def collect(self, step: int, force: bool = False) -> None:
        """Read the copies that have landed (all of them with ``force``: at close)."""
        waiting = []
        for f in self._in_flight:
            if force or f.fetch.ready() or step - f.started >= MAX_UNREAD_STEPS:
                self._read(f)
            else:
                waiting.append(f)
        self._in_flight = waiting

    def _read(self, f: _InFlight) -> None:
        fetched = f.fetch.read()
        self._write(f.samples, [fetched[slot] for slot in f.slots])

    def _write(self, samples: Sequence[DenseSample], values: Sequence[Sequence[float]]) -> None:
        """Rows of ``param_series`` (non-finite norms as NULL, as in ``param_stats``)."""
        ids: list[int] = []
        steps: list[int] = []
        flat: list[float] = []
        grad_parts, data_parts = [], []
        for s, v in zip(samples, values, strict=True):
            n = len(s.tensor_ids)
            ids += s.tensor_ids
            steps += [s.step] * n
            grad_parts.append(v[:n])
            data_parts.append(v[n:])
        for part in grad_parts:
            flat += part
        n_rows = len(flat)
        for part in data_parts:
            flat += part
        if not n_rows:
            return
        column = torch.tensor(flat, dtype=torch.float64)
        clean = torch.where(torch.isfinite(column), column, _NAN).tolist()
        self._submit([records.param_series_op(ColumnRows([[self.rank] * n_rows, ids, steps, clean[:n_rows],
                                                          clean[n_rows:]]))])
        for step in sorted({s.step for s in samples}):
            self._series_taken(step)             # after its rows: a thinning pass never misses rows still to come

    def flush(self) -> None:
        """Read everything still waiting now (one copy: on an accelerator, a wait for it)."""
        if self.pending:
            self._start_copy(-1)
        self.collect(0, force=True)

    def close(self) -> None:
        self.flush()
        self._plans.clear()
        self._index = None
        self._nan.clear()
