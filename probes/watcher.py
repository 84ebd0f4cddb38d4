"""The Watcher: the public handle of a watched model. It owns step boundaries, the deferred reads of
sampled steps, losses and counters; the hooks are :mod:`probes.capture.step`'s, the model is known through
:mod:`probes.model.index`, samples are decoded by :mod:`probes.capture.decode` and findings are tracked by
:mod:`probes.findings.tracker`.

Optimizer step hooks mark step boundaries and stay for the whole run (they are not module hooks, so
modules keep PyTorch's no-hook fast path on unsampled steps).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import html
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .capture import measure
from .capture.closures import ClosureSteps, StepArgs, optimizer_position
from .capture.guard import ProbeRuntime
from .capture.hooks import HeldHook
from .capture.host_values import PendingFetch
from .capture.losses import LossRecorder
from .capture.rank_clock import RankClock
from .capture.record import StepRecord, release_outputs
from .capture.replicas import close_values
from .capture.sampling import SamplingPolicy
from .capture.sentinels import RootSentinel
from .capture.step import StepCapture
from .capture.tiers import StepTiers
from .findings.evaluation import Evaluator
from .findings.finding import Finding
from .findings.loop_checks import LoopChecks
from .findings.structural import structural_findings
from .model.index import IdRegistry, ModelIndex, Presence, build_index, model_signature
from .model.runtime import RuntimeModules
from .model.structure import ModuleNode, compiled_modules, model_device, unwrap
from .model.tensors import reads_free
from .schema import RunStatus, StrEnum, count_text, display_path
from .store import records
from .store.records import Op
from .store.rundir import RunFiles, interval_channel
from .store.session import StoreSession

REBUILD_EVERY = 100           # sampled steps between full structure walks (plain lists can change)
MAX_UNREAD_STEPS = 4          # a deferred host copy is read at the latest this many steps later


@dataclasses.dataclass
class UnreadSample:
    """A sampled step whose statistics are still being copied to the host (accelerators)."""

    step: int
    record: StepRecord
    fetch: PendingFetch
    loss_slots: list[tuple[int, int]]     # (step, slot) of the losses read with it
    started: int                          # the step counter when the copy started


class Boundaries(StrEnum):
    """Who ends a step: the watched optimizers' ``step()`` (a plain loop), or a framework integration that
    calls :meth:`Watcher.begin_optimizer_step` and :meth:`Watcher.end_step` where its own machinery says
    the gradients are final and the step is over (closures, accumulation, AMP skips)."""

    OPTIMIZER = "optimizer"
    EXTERNAL = "external"


@dataclasses.dataclass(frozen=True)
class WatchSettings:
    """How one model is watched (checked by :func:`probes.watch` before it gets here): the run and this process's
    rank in it, the sampling (``every`` sampled step, or an ``overhead`` budget), the window of the windowed rules,
    and what ends a step."""

    run_id: str
    run_name: str
    every: int | None
    overhead: float | None
    window: int
    rank: int = 0
    world_size: int = 1
    boundaries: Boundaries = Boundaries.OPTIMIZER
    dense: bool | int = True          # the dense tier: chosen within the budget, off, or every N-th step


def sampling_policy(settings: WatchSettings, model: nn.Module) -> SamplingPolicy:
    """The schedule of the full samples and the dense tier: rank 0 chooses it, the other ranks follow."""
    return SamplingPolicy(settings.every, settings.overhead, interval_channel(settings.run_id, settings.world_size),
                          leader=settings.rank == 0, dense=settings.dense,
                          host_timed=reads_free(torch.device(model_device(model))))


class Watcher:
    """Created by :func:`probes.watch`. Use as a context manager or call :meth:`close`."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], run_dir: Path,
                 settings: WatchSettings) -> None:
        run_id, every, overhead, window = settings.run_id, settings.every, settings.overhead, settings.window
        rank, world_size, run_name, dense = settings.rank, settings.world_size, settings.run_name, settings.dense
        self.settings = settings
        self.files = RunFiles(run_dir, run_id, rank)
        self.run_dir = run_dir
        self.run_id = run_id
        self.store_path = self.files.store
        self.rank = rank
        self.world_size = world_size
        self.window = window
        self._model_ref = weakref.ref(model)
        self._optimizers = list(optimizers)
        self._external = settings.boundaries == Boundaries.EXTERNAL
        self._closed = False
        self._close_lock = threading.Lock()
        self._probe = ProbeRuntime()
        self._policy = sampling_policy(settings, model)
        self._evaluator = Evaluator(rank, window)
        self._ids = IdRegistry()
        self._presence = Presence()                   # what the store holds as the model now, and what left it
        self._runtime = RuntimeModules(self._ids)
        self._activity = measure.UnitActivity(window)
        self._capture = StepCapture(self._probe, self._runtime, self._on_new_module, replicas=world_size > 1)
        self._sentinel = RootSentinel(self._probe)
        # this rank's own time per step (rank-straggler): only in a job of several processes
        self._clock = RankClock(self._probe) if world_size > 1 else None
        self._closures = ClosureSteps(self._gradients_final, self._clock)
        self.loss_source: Callable[[], Any] | None = None   # the step's loss when nothing records one (zero-code)
        self._stepped: set[int] = set()
        self._sample_index = 0
        self._unread: UnreadSample | None = None
        self._thread = threading.get_ident()          # the training thread: the only one that reads samples
        self._opt_handles: list[RemovableHandle] = []
        self._on_close: list[Callable[[], None]] = []
        user_model = unwrap(model)
        self._store = StoreSession(self.files, run_name=run_name, world_size=world_size,
                                   model_class=f"{type(user_model).__module__}.{type(user_model).__qualname__}",
                                   device=model_device(model),
                                   sampling={"every": every, "overhead": overhead, "window": window, "dense": dense})
        self._writer = self._store.writer
        self._losses = LossRecorder(rank, self._writer.submit, self._evaluator.loss)
        self._tiers = StepTiers(self._policy, self._probe, rank, self._writer.submit, self._store.series_taken)
        self._index: ModelIndex = self._rebuild(model)
        self._sentinel.attach(model, user_model)
        if self._clock is not None:
            self._clock.attach(model)
        self._checks = LoopChecks(self._probe, self._evaluator, self._sentinel, user_model, self._publish,
                                  stepping=bool(self._optimizers) and not self._external)
        for oi, opt in enumerate(self._optimizers):
            self._opt_handles.append(opt.register_step_pre_hook(HeldHook(functools.partial(self._on_opt_pre, oi))))
            self._opt_handles.append(opt.register_step_post_hook(HeldHook(functools.partial(self._on_opt_post, oi))))
        self._atexit = _atexit_closer(self)
        atexit.register(self._atexit)
        # in a notebook, a cell interrupted or failing inside a sampled step leaves that step open until the
        # next optimizer step, and Python's garbage collector paused (GcPause) with it: resumed after each cell
        from .notebook import on_cell_end
        self._cell_end = on_cell_end(_gc_resumer(self))
        self._tiers.begin(0, self._capture.arm, self._index)

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
            if self._optimizers and not self._external:
                if loss is not None:
                    self._losses.record(max(self._probe.step - 1, 0), loss)
                self._checks.reported()
                return
            if loss is not None:
                self._losses.record(self._probe.step, loss)
            self._end_step()

    def begin_optimizer_step(self, optimizer: int | torch.optim.Optimizer = 0) -> None:
        """The gradients of a watched optimizer (the optimizer or its index) are final for this step: integrations
        call it (``boundaries="external"``), a closure may (:func:`probes.begin_optimizer_step`). Only a step's first
        call counts; one before the closure of the ``step()`` in progress ran waits for its first evaluation."""
        index = optimizer_position(self._optimizers, optimizer)
        if index is None:
            raise ValueError(f"optimizer {optimizer!r:.80} is not watched by {self!r}")
        if self._closed or self._closures.defers(index):
            return
        self._gradients_final(index)

    def _gradients_final(self, index: int, where: str = "optimizer-begin") -> None:
        if self._closed or self._capture.record is None:
            self._tiers.take_optimizer(self._probe.step, self._index, index)      # on a dense step
            return
        with self._probe.guard(where):
            self._capture.before_optimizer_step(index, self._optimizers[index])

    def end_step(self, loss: Any = None) -> None:
        """(Integrations, ``boundaries="external"``.) The training step is over (its optimizer steps done,
        or skipped by a gradient scaler); ``loss`` is stored on it."""
        if self._closed:
            return
        with self._probe.guard("step"):
            if loss is not None:
                self._losses.record(self._probe.step, loss)
            self._end_step()

    def root_sets_mode(self) -> None:
        """(Integrations.) The framework puts the watched model in train or eval mode itself (Lightning's loops,
        on the LightningModule): the model's flag is then the mode every module is compared with, also in steps
        whose forwards call submodules only (a ``training_step`` calling ``self.encoder(x)``), where the model's
        own forward never runs."""
        self._capture.root_sets_mode = True

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the watcher closes (before its store does): integrations remove what they
        attached to a framework. A callback that raises is counted as a probe error."""
        if not callable(callback):
            raise TypeError(f"on_close needs a callable, got {type(callback).__qualname__}: {callback!r:.80}")
        self._on_close.append(callback)

    def findings(self) -> FindingList:
        """The current findings, most severe first (the step in progress included: a validation pass after
        the last optimizer step counts). A list; a notebook shows it as a table of root causes, each with
        its fix and the findings it explains."""
        if not self._closed and threading.get_ident() == self._thread:
            self._complete_unread(force=True)
            self._preview_step()
        return FindingList(self._evaluator.active())

    def snapshot(self, path: str | os.PathLike[str]) -> str | Path:
        """Write a single-file snapshot (SQLite) of the run so far and return its path (a str when given a
        str, else a Path)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"snapshot path must be a str or os.PathLike, got {type(path).__qualname__}: {path!r:.80}")
        if not self._closed:
            if threading.get_ident() == self._thread:
                self._complete_unread(force=True)
                self._preview_step()
                self._tiers.flush()
            self._losses.flush()
            self._write_counters()
            self._writer.flush()
        written = self._store.snapshot(path)
        return str(written) if isinstance(path, str) else Path(written)

    def close(self) -> None:
        """Remove every hook, flush and close the store. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            for callback in self._on_close:
                with self._probe.guard("on-close"):
                    callback()
            self._on_close.clear()
            if self._unread is not None:
                self._complete_unread(force=True)
            rec = self._capture.record
            if rec is not None and rec.hooks.live:
                with self._probe.guard("close"):
                    self._evaluator.last_modes(self._probe.step, rec, rec.index or self._index)
            self._capture.close()
            for h in self._opt_handles:
                h.remove()
            self._opt_handles.clear()
            self._losses.flush()
            self._tiers.close()
            # the step in progress ends here: a forward after the last optimizer step is evaluated too
            self._observe_forwards(self._probe.step)
            if self._evaluator.changed:
                self._publish(self._probe.step, sampled=False)
            self._sentinel.detach()
            if self._clock is not None:
                self._clock.detach()
                with self._probe.guard("close-fingerprints"):    # replicas compare these however rarely they sampled
                    self._writer.submit([records.close_values_op(self.rank, close_values(self._index))], False)
            if self._writer.failing:
                self._writer.flush()             # one more attempt: if the disk is back, rewrite what was lost
            self._write_counters(status=RunStatus.CLOSED, closed_at=time.time())
        finally:
            self._store.close()
            with contextlib.suppress(Exception):
                atexit.unregister(self._atexit)
            if self._cell_end is not None:
                self._cell_end()
                self._cell_end = None
            self._optimizers = []
            self._index = ModelIndex.empty()
            self._activity.clear()
            self._runtime.clear()
            self._losses.pending.clear()
            measure.release_caches()

    def show(self, *, height: int = 650, token: str | None = None) -> str | None:
        """Show this run's live dashboard inline in a Jupyter notebook and print its URL (see
        :func:`probes.show`: the dashboard is a process of its own, on 127.0.0.1; ``token``, default
        ``MODSCOPE_TOKEN``, is required on every request). Calling it again shows the same server again.
        Returns the URL, or None when the dashboard could not start."""
        from .notebook import show
        return show(self.store_path, height=height, token=token)

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
        self._capture.index_stale = False
        index = build_index(model, self._optimizers, self._ids, self._runtime.nodes())
        step = self._probe.step
        self._evaluator.static = structural_findings(index.structure, step=step)
        if index.structure.walk_truncated:
            self._probe.errors.record_message(
                "structure-walk", "WalkTruncated", "the walk over the model's attributes stopped early (too many "
                "objects or nesting too deep): unregistered modules beyond that point are not reported", step)
        gone_modules, gone_tensors = self._presence.update(index, step)
        # one transaction: a reader never sees the new module at a path next to the one it replaced as current
        self._writer.submit([*records.removal_ops(self.rank, gone_modules, gone_tensors),
                             *records.structure_ops(self.rank, index.structure.modules, index.structure.tensors, step)],
                            droppable=False)
        self._capture.index = index
        self._capture.set_compiled(compiled_modules(model))
        self._sentinel.optimized = frozenset(id(p) for opt in self._optimizers for group in opt.param_groups
                                             for p in group["params"])
        self._sentinel.mode_sensitive = index.mode_sensitive_modules()
        return index

    def _on_new_module(self, node: ModuleNode) -> None:
        """A module found while forward ran (closure, global, built in forward)."""
        self._index = self._index.with_runtime(node)
        self._capture.index = self._index
        self._presence.add(node)
        self._writer.submit(records.structure_ops(self.rank, [node], [], self._probe.step), droppable=False)

    def _maybe_rebuild(self) -> None:
        model = self._model_ref()
        if model is None or self._closed:
            return
        if self._capture.index_stale or model_signature(model, self._optimizers) != self._index.signature or \
                self._sample_index % REBUILD_EVERY == 0:
            self._index = self._rebuild(model)

    # ===================================================================== optimizer steps
    def _on_opt_pre(self, opt_index: int, optimizer: Any, args: Any, kwargs: Any) -> StepArgs | None:
        if self._closed:
            return None
        if not self._external and opt_index in self._stepped:     # this optimizer steps again: a new step began
            with self._probe.guard("step-boundary"):
                self._end_step()
        wrapped = None
        taking = self._capture.record is not None or self._tiers.armed     # a full sample, or a dense step
        with self._probe.guard("optimizer-closure"):          # a closure says when its gradients are final
            wrapped = self._closures.step_begins(opt_index, args, kwargs, taking)
        if wrapped is None and not self._external:             # no closure: final now (external: the integration says)
            self._gradients_final(opt_index, "optimizer-pre-hook")
        return wrapped

    def _on_opt_post(self, opt_index: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        self._closures.step_ends(opt_index)
        with self._probe.guard("optimizer-post-hook"):
            self._capture.after_optimizer_step(opt_index)
        if self._external:
            return
        self._stepped.add(opt_index)
        if len(self._stepped) >= len(self._optimizers):
            with self._probe.guard("step-boundary"):
                self._end_step()

    # ===================================================================== step end
    def _end_step(self) -> None:
        t_end = time.perf_counter()
        step = self._probe.step
        sampled = self._capture.record is not None
        compute_ms = self._clock.own_ms((t_end - self._probe.step_t0) * 1e3) if self._clock is not None else None
        with self._probe.guard("loss-source"):
            self._losses.record_from(step, self.loss_source)
        if self._unread is not None:               # a deferred sample before this step's own
            self._complete_unread(force=sampled)
        with self._probe.guard("step-sentinels"):
            if self._sentinel.log.empty() and not self._sentinel.parts_watched:
                self._sentinel.watch_parts()        # a step without a forward of the model: the loop calls its parts
            self._observe_forwards(step)
        if sampled:
            with self._probe.guard("finish-sample"):     # whatever fails here, the step still ends cleanly
                self._finish_sample(step)
        dense_ms = self._tiers.end_step(step, self._index, bool(self._optimizers))
        t_done = time.perf_counter()
        # the step's wall time as training sees it, finishing work included (the budget compares sampled
        # with unsampled steps); the probe's own time: hooks during the step plus finishing
        step_ms = (t_done - self._probe.step_t0) * 1e3
        probe_ms = self._probe.probe_s * 1e3 + (t_done - t_end) * 1e3
        if self._evaluator.changed:               # an event on a step whose sample is not read yet (or unsampled)
            with self._probe.guard("step-sentinels"):
                self._publish(step, sampled=False)
        self._policy.observe(step, step_ms, probe_ms, sampled, dense_ms)
        self._writer.submit([records.step_op(self.rank, step, time.time(), step_ms, probe_ms, sampled, compute_ms)])
        if sampled or self._store.counters_due(self._probe.errors):
            self._write_counters(last_step=step)
        self._stepped.clear()
        self._capture.detach()
        self._probe.gc.resume()                     # after the step's records became garbage, not before
        self._probe.start_step(step + 1)
        self._tiers.begin(step + 1, self._capture.arm, self._index)
        self._probe.step_t0 = time.perf_counter()

    def _finish_sample(self, step: int) -> None:
        rec = self._capture.finish()
        loss_slots = [(s, rec.measurements.add(v.reshape(-1)[:1])) for s, v in self._losses.take_pending()]
        fetch = self._tiers.start_fetch(rec.measurements)      # the one host copy of this step
        release_outputs(rec)
        self._capture.learn_in_place(rec.measurements.changed_keys)
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

    def _read_sample(self, step: int, rec: StepRecord, fetch: PendingFetch,
                     loss_slots: list[tuple[int, int]]) -> None:
        values = self._tiers.read(fetch, self._activity, self._sample_index)
        self._losses.read([(s, values[slot][0]) for s, slot in loss_slots])
        self._sample_index += 1
        self._store.sampled(step)
        decoded, ops = self._evaluator.decode(step, rec, values, rec.index or self._index)
        self._writer.submit(ops)                    # a full queue drops it (counted by the writer)
        self._maybe_rebuild()
        self._writer.submit(self._evaluator.evaluate(decoded, self._index, self._runtime.sightings(),
                                                     bool(self._optimizers), self._optimizers), droppable=False)

    def _publish(self, step: int, sampled: bool) -> None:
        self._writer.submit(self._evaluator.publish(step, self._index, self._runtime.sightings(), sampled),
                            droppable=False)

    def _observe_forwards(self, step: int) -> None:
        """What the root sentinel saw since the last boundary, which ends here."""
        self._evaluator.forwards(step, self._checks.take(self._closed), self._mode_sensitive(), step_ended=True)

    def _mode_sensitive(self) -> list[str]:
        return [p for p, _ in self._sentinel.mode_sensitive]

    def _preview_step(self) -> None:
        """Evaluate the step in progress (findings(), snapshot()) without ending it."""
        with self._probe.guard("preview"):
            ops = self._evaluator.preview(self._probe.step, dataclasses.replace(self._sentinel.log),
                                          self._mode_sensitive(), self._index, self._runtime.sightings())
            if ops:
                self._writer.submit(ops, droppable=False)

    # ===================================================================== losses and counters
    def _write_counters(self, status: RunStatus = RunStatus.RUNNING, closed_at: float | None = None,
                        last_step: int | None = None) -> None:
        """``last_step``: the last finished step (default: the one before the step in progress)."""
        step = self._probe.step - 1 if last_step is None else last_step
        self._store.write_counters(max(step, 0), self._probe.errors, self._policy.overhead(),
                                   functools.partial(_lost_writes, self), status, closed_at)



def _lost_writes(w: Watcher) -> list[Op]:
    """What failed commits may have held, written again once commits succeed: the tree, the findings."""
    s, step = w._index.structure, w._probe.step
    return [*records.structure_ops(w.rank, s.modules, s.tensors, step),
            *records.structure_ops(w.rank, w._runtime.nodes(), [], step),
            *records.removal_ops(w.rank, w._presence.removed_modules, w._presence.removed_tensors),
            *w._evaluator.tracker.rewrite_ops(step), w._tiers.next_sample_op()]


class FindingList(list[Finding]):
    """What :meth:`Watcher.findings` returns: a plain list of :class:`~probes.Finding`, that IPython and
    Jupyter show as one entry per root cause (severity, code, path, message, fix) with the findings it
    explains listed under it, instead of the dataclasses' repr (a wall of evidence dicts)."""

    def _groups(self) -> list[tuple[Finding, list[Finding]]]:
        keys = {f.key for f in self}
        roots = [f for f in self if f.cause is None or tuple(f.cause) not in keys]
        explained: dict[tuple[str, str], list[Finding]] = {}
        for f in self:
            if f.cause is not None and tuple(f.cause) in keys:
                explained.setdefault((f.cause[0], f.cause[1]), []).append(f)
        return [(r, explained.get(r.key, [])) for r in roots]

    def count_text(self) -> str:
        """'3 root causes (2 errors, 1 warning) and 12 consequences': as the dashboard and ``modscope findings``
        count them (``schema.count_text``)."""
        groups = self._groups()
        by_severity: dict[str, int] = {}
        for root, _ in groups:
            by_severity[str(root.severity)] = by_severity.get(str(root.severity), 0) + 1
        return count_text(by_severity, len(self) - len(groups))

    def _head(self) -> str:
        return self.count_text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        lines = [self._head()]
        for root, consequences in self._groups():
            lines.append(f"[{root.severity}] {root.code} at {display_path(root.path)}: {root.message}")
            if root.fix:
                lines.append(f"    fix: {root.fix}")
            for c in consequences:
                lines.append(f"    explains [{c.severity}] {c.code} at {display_path(c.path)}")
        p.text("\n".join(lines))

    def _repr_html_(self) -> str:
        e = html.escape
        rows = []
        for root, consequences in self._groups():
            explains = "".join(f"<li>{e(c.severity)} <code>{e(c.code)}</code> at <code>{e(display_path(c.path))}</code>"
                               "</li>" for c in consequences)
            rows.append(f"<tr><td>{e(root.severity)}</td><td><code>{e(root.code)}</code></td>"
                        f"<td><code>{e(display_path(root.path))}</code></td><td>{e(root.message)}"
                        + (f"<br><b>fix:</b> {e(root.fix)}" if root.fix else "")
                        + (f"<br>explains:<ul>{explains}</ul>" if explains else "") + "</td></tr>")
        table = ("<table><thead><tr><th>severity</th><th>code</th><th>path</th><th>finding</th></tr></thead>"
                 f"<tbody>{''.join(rows)}</tbody></table>") if rows else ""
        return f"<div><p>modscope: {e(self._head())}</p>{table}</div>"


def _gc_resumer(watcher: Watcher) -> Callable[[], None]:
    ref = weakref.ref(watcher)

    def resume() -> None:
        w = ref()
        if w is not None:
            w._probe.gc.resume()
    return resume


def _atexit_closer(watcher: Watcher) -> Callable[[], None]:
    ref = weakref.ref(watcher)

    def close() -> None:
        w = ref()
        if w is not None:
            w.close()
    return close
