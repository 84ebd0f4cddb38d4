"""The Watcher: the public handle of a watched model. It owns step boundaries, the deferred reads of
sampled steps, losses and counters; the hooks are :mod:`probes.capture`'s, the model is known through
:mod:`probes.model_index`, samples are decoded by :mod:`probes.decode` and findings are tracked by
:mod:`probes.tracker`.

Optimizer step hooks mark step boundaries and stay for the whole run (they are not module hooks, so
modules keep PyTorch's no-hook fast path on unsampled steps).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import math
import os
import platform
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import decode, measure, records
from ._version import __version__
from .capture import StepCapture, StepRecord
from .causes import assign_causes
from .detectors import BypassCandidate, DynamicDetectors, StepEvidence
from .events import EventBook, SampledEvents
from .findings import Finding
from .guard import ProbeRuntime
from .model_index import IdRegistry, ModelIndex, build_index, model_signature
from .rundir import RunFiles, WriterLock, journal_mode
from .runtime_modules import RuntimeModules
from .sampling import SamplingPolicy
from .schema import RunStatus, snapshot
from .sentinels import RootSentinel
from .store import StoreWriter
from .structural import structural_findings
from .structure import ModuleNode
from .tracker import FindingTracker

# Long runs stay bounded: every sampled step of the last THIN_RECENT is kept; older samples (and older
# unsampled step rows) are thinned to about THIN_OLD evenly spaced ones.
THIN_RECENT = 1000
THIN_OLD = 1000
THIN_EVERY = 250              # sampled steps between thinning passes (run by the writer thread)
REBUILD_EVERY = 100           # sampled steps between full structure walks (plain lists can change)
MAX_UNREAD_STEPS = 4          # a deferred host copy is read at the latest this many steps later
MAX_PENDING_LOSSES = 64       # device losses read together (with a sampled step's copy, or at this many)
HEARTBEAT_S = 5.0             # the store's heartbeat (ranks.updated_at) moves at least this often while training


@dataclasses.dataclass
class UnreadSample:
    """A sampled step whose statistics are still being copied to the host (accelerators)."""

    step: int
    record: StepRecord
    fetch: measure.PendingFetch
    loss_slots: list[tuple[int, int]]     # (step, slot) of the losses read with it
    started: int                          # the step counter when the copy started


class Watcher:
    """Created by :func:`probes.watch`. Use as a context manager or call :meth:`close`."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], run_dir: Path, *,
                 run_id: str, every: int | None, overhead: float | None, window: int, rank: int,
                 world_size: int, run_name: str) -> None:
        self.files = RunFiles(run_dir, run_id, rank)
        self.run_dir = run_dir
        self.run_id = run_id
        self.store_path = self.files.store
        self.rank = rank
        self.world_size = world_size
        self.window = window
        self._model_ref = weakref.ref(model)
        self._optimizers = list(optimizers)
        self._closed = False
        self._close_lock = threading.Lock()
        self._probe = ProbeRuntime()
        self._policy = SamplingPolicy(every, overhead)
        self._detectors = DynamicDetectors(window)
        self._tracker = FindingTracker(rank)
        self._ids = IdRegistry()
        self._runtime = RuntimeModules(self._ids)
        self._activity = measure.UnitActivity(window)
        self._capture = StepCapture(self._probe, self._runtime, self._on_new_module, _is_compiled(model))
        self._static: list[Finding] = []
        self._dynamic: list[Finding] = []             # the detectors' view at the last sampled step
        self._events = EventBook()
        self._sentinel = RootSentinel(self._probe)
        self._moved: dict[int, int] = {}
        self._stepped: set[int] = set()
        self._sample_index = 0
        self._unread: UnreadSample | None = None
        self._thread = threading.get_ident()          # the training thread: the only one that reads samples
        self._pending_losses: list[tuple[int, torch.Tensor]] = []
        self._recent_samples: collections.deque[int] = collections.deque(maxlen=THIN_RECENT)
        self._opt_handles: list[RemovableHandle] = []
        self._last_counters = 0.0
        self._write_errors_logged = 0
        self._recoveries_seen = 0

        self._lock = WriterLock(self.files)
        self._lock.acquire()
        journal = journal_mode(run_dir)
        try:
            self._writer = StoreWriter(self.store_path, journal=journal)
        except BaseException:
            self._lock.release()
            self.files.status.unlink(missing_ok=True)
            raise
        now = time.time()
        # kept: written again if the store missed writes (a full disk)
        self._identity_ops = [
            *records.meta_ops(run_name, now, {"rank_count": world_size, "world_size": world_size, "run_id": run_id,
                                              "journal_mode": journal, "modscope_version": __version__}),
            *records.rank_ops({
                "rank": rank, "world_size": world_size, "hostname": socket.gethostname(), "pid": os.getpid(),
                "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
                "torch_version": torch.__version__, "python_version": platform.python_version(),
                "device": _model_device(model), "sampling": {"every": every, "overhead": overhead, "window": window},
                "started_at": now, "updated_at": now, "status": RunStatus.RUNNING, "step": 0})]
        self._writer.submit(self._identity_ops, droppable=False)
        self._index: ModelIndex = self._rebuild(model)
        self._sentinel.attach(model, model)
        for oi, opt in enumerate(self._optimizers):
            self._opt_handles.append(opt.register_step_pre_hook(functools.partial(self._on_opt_pre, oi)))
            self._opt_handles.append(opt.register_step_post_hook(functools.partial(self._on_opt_post, oi)))
        self._atexit = _atexit_closer(self)
        atexit.register(self._atexit)
        if self._policy.should_sample(0):
            self._capture.arm(self._index)

    # ===================================================================== public API
    @property
    def step_count(self) -> int:
        """Index of the current (unfinished) step."""
        return self._probe.step

    def step(self, loss: Any = None) -> None:
        """Mark a step boundary (when no optimizer is watched) and/or record the loss.

        With optimizers, steps end at ``optimizer.step()``; call ``w.step(loss)`` after it and the loss
        is stored on the step that just finished."""
        if self._closed:
            return
        with self._probe.guard("step"):
            if self._optimizers:
                if loss is not None:
                    self._record_loss(max(self._probe.step - 1, 0), loss)
                return
            if loss is not None:
                self._record_loss(self._probe.step, loss)
            self._end_step()

    def findings(self) -> list[Finding]:
        """The current findings, most severe first (the step in progress included: a validation pass after
        the last optimizer step counts)."""
        if not self._closed and threading.get_ident() == self._thread:
            self._complete_unread(force=True)
            self._preview_step()
        return self._tracker.active()

    def snapshot(self, path: str | os.PathLike[str]) -> str | Path:
        """Write a single-file snapshot (SQLite) of the run so far and return its path (a str when given a
        str, else a Path)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"snapshot path must be a str or os.PathLike, got {type(path).__qualname__}: {path!r:.80}")
        if not self._closed:
            if threading.get_ident() == self._thread:
                self._complete_unread(force=True)
                self._preview_step()
            self._flush_losses()
            self._write_counters()
            self._writer.flush()
        written = snapshot(self.files.siblings() or [self.store_path], path)
        return str(written) if isinstance(path, str) else written

    def close(self) -> None:
        """Remove every hook, flush and close the store. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._unread is not None:
                self._complete_unread(force=True)
            self._capture.close()
            for h in self._opt_handles:
                h.remove()
            self._opt_handles.clear()
            self._flush_losses()
            # the step in progress ends here: a forward after the last optimizer step is evaluated too
            self._observe_forwards(self._probe.step, step_ended=True)
            if self._events.changed:
                self._publish(self._probe.step, sampled=False)
            self._sentinel.detach()
            if self._writer.failing:
                self._writer.flush()             # one more attempt: if the disk is back, rewrite what was lost
            self._write_counters(status=RunStatus.CLOSED, closed_at=time.time())
        finally:
            self._writer.close()
            self._lock.release()
            with contextlib.suppress(Exception):
                atexit.unregister(self._atexit)
            self._optimizers = []
            self._index = ModelIndex.empty()
            self._activity.clear()
            self._runtime.clear()
            self._pending_losses.clear()
            measure.release_caches()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def probe_errors(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Errors caught inside hooks: (location, exception type) -> count, message, steps."""
        return {k: dataclasses.asdict(v) for k, v in self._probe.errors.entries.items()}

    @property
    def samples_dropped(self) -> int:
        return self._writer.dropped

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<probes.Watcher step={self._probe.step} store={str(self.store_path)!r} closed={self._closed}>"

    # ===================================================================== the model index
    def _rebuild(self, model: nn.Module) -> ModelIndex:
        self._capture.clear()            # cached views must not outlive the index's tensors
        index = build_index(model, self._optimizers, self._ids, self._runtime.nodes())
        step = self._probe.step
        self._static = structural_findings(index.structure, step=step)
        if index.structure.walk_truncated:
            self._probe.errors.record_message(
                "structure-walk", "WalkTruncated", "the walk over the model's attributes stopped early (too many "
                "objects or nesting too deep): unregistered modules beyond that point are not reported", step)
        self._writer.submit(records.structure_ops(self.rank, index.structure.modules, index.structure.tensors, step),
                            droppable=False)
        self._capture.index = index
        self._sentinel.mode_sensitive = index.mode_sensitive_modules()
        return index

    def _on_new_module(self, node: ModuleNode) -> None:
        """A module found while forward ran (closure, global, built in forward)."""
        self._index = self._index.with_runtime(node)
        self._capture.index = self._index
        self._writer.submit(records.structure_ops(self.rank, [node], [], self._probe.step), droppable=False)

    def _maybe_rebuild(self) -> None:
        model = self._model_ref()
        if model is None or self._closed:
            return
        if model_signature(model, self._optimizers) != self._index.signature or \
                self._sample_index % REBUILD_EVERY == 0:
            self._index = self._rebuild(model)

    # ===================================================================== optimizer steps
    def _on_opt_pre(self, opt_index: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        if opt_index in self._stepped:          # this optimizer steps again: a new step began
            with self._probe.guard("step-boundary"):
                self._end_step()
        if self._capture.record is None:
            return
        with self._probe.guard("optimizer-pre-hook"):
            self._capture.before_optimizer_step(opt_index, optimizer)

    def _on_opt_post(self, opt_index: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        with self._probe.guard("optimizer-post-hook"):
            self._capture.after_optimizer_step(opt_index)
        self._stepped.add(opt_index)
        if len(self._stepped) >= len(self._optimizers):
            with self._probe.guard("step-boundary"):
                self._end_step()

    # ===================================================================== step end
    def _end_step(self) -> None:
        t_end = time.perf_counter()
        step = self._probe.step
        sampled = self._capture.record is not None
        if self._unread is not None:               # a deferred sample before this step's own
            self._complete_unread(force=sampled)
        with self._probe.guard("step-sentinels"):
            self._observe_forwards(step, step_ended=True)
        if sampled:
            with self._probe.guard("finish-sample"):     # whatever fails here, the step still ends cleanly
                self._finish_sample(step)
        t_done = time.perf_counter()
        # the step's wall time as training sees it, finishing work included (the budget compares sampled
        # with unsampled steps); the probe's own time: hooks during the step plus finishing
        step_ms = (t_done - self._probe.step_t0) * 1e3
        probe_ms = self._probe.probe_s * 1e3 + (t_done - t_end) * 1e3
        if self._events.changed:                  # an event on a step whose sample is not read yet (or unsampled)
            with self._probe.guard("step-sentinels"):
                self._publish(step, sampled=False)
        self._policy.observe(step, step_ms, probe_ms, sampled)
        self._writer.submit([records.step_op(self.rank, step, time.time(), step_ms, probe_ms, sampled)])
        if sampled or self._probe.errors.dirty or time.monotonic() - self._last_counters >= HEARTBEAT_S \
                or self._writer.recoveries != self._recoveries_seen \
                or self._writer.write_errors != self._write_errors_logged:
            self._write_counters()
        self._stepped.clear()
        self._capture.detach()
        self._probe.start_step(step + 1)
        if self._policy.should_sample(step + 1):
            self._capture.arm(self._index)
        self._probe.step_t0 = time.perf_counter()

    def _finish_sample(self, step: int) -> None:
        rec = self._capture.finish()
        pending, self._pending_losses = self._pending_losses, []
        loss_slots = [(s, rec.measurements.add(v.reshape(-1)[:1])) for s, v in pending]
        fetch = rec.measurements.start_fetch()      # the one host copy of this step
        if fetch.deferred:
            # non-blocking on an accelerator: read at a later step boundary, once it has landed
            self._unread = UnreadSample(step, rec, fetch, loss_slots, self._probe.step)
        else:
            self._read_sample(step, rec, fetch, loss_slots)

    def _complete_unread(self, force: bool) -> None:
        """Read a deferred sample's copy when it has landed (or now, with ``force``)."""
        u = self._unread
        if u is None or not (force or u.fetch.ready() or self._probe.step - u.started >= MAX_UNREAD_STEPS):
            return
        self._unread = None
        with self._probe.guard("finish-sample"):
            self._read_sample(u.step, u.record, u.fetch, u.loss_slots)

    def _read_sample(self, step: int, rec: StepRecord, fetch: measure.PendingFetch,
                     loss_slots: list[tuple[int, int]]) -> None:
        values = fetch.values(self._activity, self._sample_index)
        if loss_slots:
            now = time.time()
            for s, slot in loss_slots:
                self._events.observe_loss(s, values[slot][0])
            self._writer.submit([records.loss_op(self.rank, s, now, values[slot][0]) for s, slot in loss_slots])
        self._sample_index += 1
        self._recent_samples.append(step)
        if self._sample_index % THIN_EVERY == 0 and len(self._recent_samples) >= THIN_RECENT:
            cutoff = self._recent_samples[-THIN_RECENT]
            self._writer.submit(records.thin_ops(self.rank, cutoff, max(1, -(-cutoff // THIN_OLD))),
                                droppable=False)
        index = self._index
        modules = decode.module_samples(step, rec, values)
        tensors = decode.tensor_samples(step, rec, values, lambda tid: index.tensors[tid].numel)
        module_samples = {mid: m.sample for mid, m in modules.items()}
        self._detectors.observe(module_samples, tensors)
        ops = [records.module_stats_op(decode.module_stat_rows(self.rank, step, modules)),
               records.param_stats_op(decode.param_stat_rows(self.rank, step, tensors))]
        moved = decode.moved_changes(tensors, self._moved)
        if moved:
            self._moved.update(moved)
            ops.append(records.moved_op(self.rank, moved))
        self._writer.submit(ops)                    # a full queue drops it (counted by the writer)
        self._maybe_rebuild()
        index = self._index
        bad_modules = sorted(((s.order, mid, s.nonfinite) for mid, s in module_samples.items() if s.nonfinite))
        self._events.observe_sample(SampledEvents(
            step=step, modes=rec.modes, called=frozenset(m for m, n in rec.calls.items() if n),
            arrived=frozenset(rec.arrived), owners=index.owners, bypass=_bypass_candidates(rec, index),
            bad_modules=[(mid, n) for _, mid, n in bad_modules],
            bad_grads=sorted(t for t, ts in tensors.items() if ts.grad_norm is not None and
                             not math.isfinite(ts.grad_norm) and index.tensor_known(t)),
            optimizer_skipped=bool(self._optimizers) and not rec.optimizer_stepped), index)
        self._dynamic = self._detectors.evaluate(index, StepEvidence(step, module_samples, tensors,
                                                                     rec.optimizer_stepped))
        self._publish(step, sampled=True)

    def _publish(self, step: int, sampled: bool, events: EventBook | None = None) -> None:
        """Findings now: structure, run-time modules, the detectors' last view and the events, each
        consequence naming its cause; the difference goes to the store."""
        book = events or self._events
        index = self._index
        current = assign_causes([*self._static, *self._runtime.findings(), *self._dynamic, *book.findings(index)])
        self._writer.submit(self._tracker.update(step, current, index, sampled), droppable=False)
        book.changed = False

    def _observe_forwards(self, step: int, step_ended: bool, book: EventBook | None = None) -> None:
        """Hand what the root sentinel saw since the last boundary to the event book."""
        log = self._sentinel.take() if book is None else dataclasses.replace(self._sentinel.log)
        if not log.empty():
            (book or self._events).observe_forwards(step, log, [p for p, _ in self._sentinel.mode_sensitive],
                                                    step_ended)

    def _preview_step(self) -> None:
        """Evaluate the step in progress (findings(), snapshot()) without ending it."""
        with self._probe.guard("preview"):
            book = self._events.copy()
            self._observe_forwards(self._probe.step, step_ended=False, book=book)
            if book.changed:
                self._publish(self._probe.step, sampled=False, events=book)

    # ===================================================================== losses and counters
    def _record_loss(self, step: int, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            if loss.device.type != "cpu":
                # read with the next sampled step's single host copy (or after MAX_PENDING_LOSSES, or at close)
                self._pending_losses.append((step, loss))
                if len(self._pending_losses) >= MAX_PENDING_LOSSES:
                    self._flush_losses()
                return
            loss = float(loss.reshape(-1)[0]) if loss.numel() else None
        elif loss is not None:
            loss = float(loss)
        self._events.observe_loss(step, loss)
        self._writer.submit([records.loss_op(self.rank, step, time.time(), loss)])

    def _flush_losses(self) -> None:
        if not self._pending_losses:
            return
        pending, self._pending_losses = self._pending_losses, []
        vals = torch.stack([v.reshape(-1)[0].float() for _, v in pending]).cpu().tolist()
        for (s, _), v in zip(pending, vals, strict=True):
            self._events.observe_loss(s, v)
        now = time.time()
        self._writer.submit([records.loss_op(self.rank, s, now, v)
                             for (s, _), v in zip(pending, vals, strict=True)])

    def _write_counters(self, status: RunStatus = RunStatus.RUNNING, closed_at: float | None = None) -> None:
        self._last_counters = time.monotonic()
        writer, errors = self._writer, self._probe.errors
        if writer.write_errors != self._write_errors_logged and writer.last_error:
            # failed commits are probe errors too: counted, with SQLite's message
            errors.record_message("store-write", writer.last_error.split(":", 1)[0], writer.last_error,
                                  self._probe.step, count=writer.write_errors - self._write_errors_logged)
            self._write_errors_logged = writer.write_errors
        ops = []
        if writer.recoveries != self._recoveries_seen:
            # commits succeed again: write again what the failed ones held (identity, tree, findings)
            self._recoveries_seen = writer.recoveries
            s = self._index.structure
            ops += [*self._identity_ops, *records.structure_ops(self.rank, s.modules, s.tensors, self._probe.step),
                    *records.structure_ops(self.rank, self._runtime.nodes(), [], self._probe.step),
                    *self._tracker.rewrite_ops(self._probe.step)]
            errors.dirty = True
        ops.append(records.rank_counters_op(self.rank, self._probe.step, time.time(), writer.written, writer.dropped,
                                            errors.total, self._policy.overhead(), status, closed_at,
                                            writer.write_errors, writer.last_error))
        if errors.dirty:
            ops.append(records.errors_op(self.rank, errors.entries))
            errors.dirty = False
        self._writer.submit(ops, droppable=False)


def _bypass_candidates(rec: StepRecord, index: ModelIndex) -> list[BypassCandidate]:
    """Tensors that got a gradient in a step in which none of their modules was called through __call__."""
    if not rec.calls:
        return []
    out = []
    for tid in sorted(rec.arrived):
        owners = index.owners.get(tid, ())
        if owners and not any(rec.calls.get(m) for m in owners) and not any(m in index.bypass_exempt for m in owners):
            out.append(BypassCandidate(tid, owners))
    return out


def _is_compiled(model: nn.Module) -> bool:
    """torch.compile(model) (an OptimizedModule) or model.compile() on the root or a child."""
    if type(model).__name__ == "OptimizedModule":
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in (model, *model.children()))


def _model_device(model: nn.Module) -> str:
    for p in model.parameters():
        return str(p.device)
    return "cpu"


def _atexit_closer(watcher: Watcher) -> Callable[[], None]:
    ref = weakref.ref(watcher)

    def close() -> None:
        w = ref()
        if w is not None:
            w.close()
    return close
