"""The Watcher: attaches to a model and its optimizer(s), samples steps, streams to the store.

Hooks exist only on sampled steps. A sampled step is armed with forward pre-hooks on the root
and its children; its first forward attaches two global module hooks (forward pre/post,
filtered to this model) and one gradient hook per watched trainable tensor; the step's end
removes them all. Optimizer step hooks mark step boundaries and stay for the whole run (they
are not module hooks, so modules keep PyTorch's no-hook fast path on unsampled steps). Every
hook body runs inside ``_guard``: an exception is counted, stored and never reaches the
training loop.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import findings as F
from . import measure, records
from .audit import structural_findings
from .detectors import DynamicDetectors, ModeEvents, ModuleSample, TensorSample
from .findings import Finding
from .sampling import SamplingPolicy
from .schema import STORE_FILENAME
from .store import StoreWriter
from .store import snapshot as _snapshot
from .structure import (ModelStructure, ModuleNode, build_structure, is_mode_sensitive, saturation_kind,
                        subtree_has_state_or_modes, unit_dim)

_DEBUG = os.environ.get("MODSCOPE_DEBUG") == "1"    # re-raise probe errors (development only)
# Long runs stay bounded: every sampled step of the last THIN_RECENT is kept; older samples
# (and older unsampled step rows) are thinned to about THIN_OLD evenly spaced ones.
THIN_RECENT = 1000
THIN_OLD = 1000
THIN_EVERY = 250              # sampled steps between thinning passes (run by the writer thread)
REBUILD_EVERY = 100           # sampled steps between full structure walks (plain lists can change)
MAX_CALLS_MEASURED = 4          # calls of one module measured per step (all are counted)


class _ErrorLog:
    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], dict[str, Any]] = {}
        self.total = 0
        self.dirty = False

    def record(self, location: str, exc: BaseException, step: int) -> None:
        key = (location, type(exc).__name__)
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = {"count": 0, "first_step": step, "message": ""}
        e["count"] += 1
        e["last_step"] = step
        e["message"] = str(exc)[:500]
        self.total += 1
        self.dirty = True


class _StepState:
    """Everything gathered during one sampled step."""

    def __init__(self) -> None:
        self.m = measure.StepMeasurements()
        self.calls: dict[int, int] = {}
        self.rows: dict[int, list[tuple[int, int, bool, bool, int]]] = {}   # mid -> (slot, order, training, grad, numel)
        self.ograd: dict[int, list[int]] = {}       # mid -> slots
        self.order = 0
        self.stack: list[int] = []
        self.root_training: bool | None = None
        self.arrived: set[int] = set()
        self.stale: dict[int, int] = {}             # tid -> slot (norm of the pre-existing .grad)
        self.grad_slots: dict[int, tuple[int, int]] = {}    # tid -> (slot, position)
        self.data_slots: dict[int, tuple[int, int]] = {}
        self.update_slots: dict[int, tuple[int, int]] = {}
        self.post_slots: dict[int, tuple[int, int]] = {}      # data norm after the optimizer step
        self.before: dict[int, tuple[list[int], Any]] = {}   # optimizer -> (tids, UpdateSampler.take())
        self.mismatch: dict[int, tuple[bool, bool]] = {}
        self.nograd_train: list[int] = []
        self.inference_mode = False
        self.runtime_seen: dict[tuple[int, str], int] = {}
        self.runtime_count: dict[tuple[int, str], int] = {}
        self.handles: list[Any] = []
        self.measured: dict[tuple, int] = {}         # output tensor -> slot (shared by wrappers)
        self.grad_targets: dict[tuple, list[int]] = {}
        self.live = False               # real hooks attached (after the step's first forward)


MAX_UNREAD_STEPS = 4      # a deferred host copy is read at the latest this many steps later


@dataclasses.dataclass
class _UnreadSample:
    """A sampled step whose statistics are still being copied to the host (accelerators)."""
    step: int
    st: "_StepState"
    fetch: measure.PendingFetch
    loss_slots: list[tuple[int, int]]
    started: int              # the watcher's step counter when the copy started


class _Guard:
    """A plain class, not @contextmanager: hooks run hundreds of times per sampled step and a
    generator-based context manager costs several times more to enter and leave.

    The probe's own time (the overhead the dashboard shows) is counted by the outermost guard
    only, and only since the last step boundary: a guard around the end of a step (which
    measures its finishing work itself) must not count it again into the next step."""
    __slots__ = ("watcher", "location", "t0")

    def __init__(self, watcher: "Watcher", location: str) -> None:
        self.watcher, self.location = watcher, location

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.watcher._guard_depth += 1

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        w = self.watcher
        w._guard_depth -= 1
        if w._guard_depth == 0:
            w._probe_s += max(0.0, time.perf_counter() - max(self.t0, w._step_t0))
        if isinstance(exc, Exception):        # never let a probe failure reach the training loop
            w._errors.record(self.location, exc, w._step)
            return not _DEBUG
        return False


class Watcher:
    """Created by :func:`probes.watch`. Use as a context manager or call :meth:`close`."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], run_dir: Path, *,
                 every: int | None, overhead: float | None, window: int, rank: int, world_size: int,
                 run_name: str) -> None:
        self.run_dir = run_dir
        self.store_path = run_dir / STORE_FILENAME
        self.rank = rank
        self.world_size = world_size
        self.window = window
        self._model_ref = weakref.ref(model)
        self._optimizers = list(optimizers)
        self._closed = False
        self._lock = threading.RLock()
        self._errors = _ErrorLog()
        self._policy = SamplingPolicy(every, overhead)
        self._detectors = DynamicDetectors(window)
        self._step = 0
        self._sample_index = 0
        self._sampled = False
        self._state: _StepState | None = None
        self._stepped: set[int] = set()
        self._probe_s = 0.0
        self._guard_depth = 0
        self._unread: _UnreadSample | None = None   # a sampled step whose host copy is still in flight
        self._thread = threading.get_ident()        # the training thread: the only one that reads samples
        self._step_t0 = time.perf_counter()
        self._pending_losses: list[tuple[int, Any]] = []
        self._activity = measure.UnitActivity(window)
        self._updates = measure.UpdateSampler()
        self._active: dict[tuple[str, str], tuple[Finding, int | None, int | None]] = {}
        self._first_seen: dict[tuple[str, str], int] = {}
        self._static: list[Finding] = []
        self._ids_by_path: dict[str, int] = {}
        self._tids_by_path: dict[str, int] = {}
        self._lookup: tuple | None = None
        self._runtime_nodes: dict[tuple[int, str, int], ModuleNode] = {}
        self._runtime_objects: dict[tuple[int, str, int], Any] = {}
        self._runtime_findings: dict[str, Finding] = {}
        self._moved: dict[int, int] = {}
        self._signature: tuple | None = None
        self._unit_dims: dict[tuple[int, int], int] = {}
        self._recent_samples: collections.deque[int] = collections.deque(maxlen=THIN_RECENT)
        self._opt_handles: list[Any] = []

        self._writer = StoreWriter(self.store_path)
        now = time.time()
        self._writer.submit(records.meta_ops(run_name, now, {"rank_count": world_size}), droppable=False)
        self._writer.submit(records.rank_ops({
            "rank": rank, "world_size": world_size, "hostname": socket.gethostname(), "pid": os.getpid(),
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "torch_version": torch.__version__, "python_version": platform.python_version(),
            "device": _model_device(model),
            "sampling": {"every": every, "overhead": overhead, "window": window},
            "started_at": now, "updated_at": now, "status": "running", "step": 0}), droppable=False)
        self._compiled = _is_compiled(model)
        self._structure: ModelStructure = self._build(model)
        for oi, opt in enumerate(self._optimizers):
            self._opt_handles.append(opt.register_step_pre_hook(functools.partial(self._on_opt_pre, oi)))
            self._opt_handles.append(opt.register_step_post_hook(functools.partial(self._on_opt_post, oi)))
        self._atexit = _atexit_closer(self)
        atexit.register(self._atexit)
        if self._policy.should_sample(0):
            self._arm()

    # ===================================================================== public API
    @property
    def step_count(self) -> int:
        """Index of the current (unfinished) step."""
        return self._step

    def step(self, loss: Any = None) -> None:
        """Mark a step boundary (when no optimizer is watched) and/or record the loss.

        With optimizers, steps end at ``optimizer.step()``; call ``w.step(loss)`` after it and
        the loss is stored on the step that just finished."""
        if self._closed:
            return
        with self._guard("step"):
            if self._optimizers:
                if loss is not None:
                    self._record_loss(max(self._step - 1, 0), loss)
                return
            if loss is not None:
                self._record_loss(self._step, loss)
            self._end_step()

    def findings(self) -> list[Finding]:
        """The current findings, most severe first."""
        if not self._closed and threading.get_ident() == self._thread:
            self._complete_unread(force=True)
        with self._lock:
            return F.sort_findings([f for f, _, _ in self._active.values()])

    def snapshot(self, path: str | os.PathLike) -> str | Path:
        """Write a single-file snapshot (SQLite) of the run so far and return its path (a str when
        given a str, else a Path)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"snapshot path must be a str or os.PathLike, got {type(path).__qualname__}: {path!r:.80}")
        if not self._closed:
            if threading.get_ident() == self._thread:
                self._complete_unread(force=True)
            self._flush_losses()
            self._write_counters()
            self._writer.flush()
        written = _snapshot(self.store_path, path)
        return str(written) if isinstance(path, str) else written

    def close(self) -> None:
        """Remove every hook, flush and close the store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._unread is not None:
                self._complete_unread(force=True)
            if self._sampled and self._state is not None:
                self._detach()
            for h in self._opt_handles:
                h.remove()
            self._opt_handles.clear()
            self._flush_losses()
            self._write_counters(status="closed", closed_at=time.time())
        finally:
            self._writer.close()
            with contextlib.suppress(Exception):
                atexit.unregister(self._atexit)
            self._optimizers = []
            self._structure = ModelStructure([], [], [], False, 0)
            self._module_nodes, self._tensor_nodes, self._module_ids = {}, {}, {}
            self._tensor_owners, self._sat = {}, {}
            self._activity.clear()
            self._updates.clear()
            self._runtime_objects.clear()
            self._state = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<probes.Watcher step={self._step} store={str(self.store_path)!r} closed={self._closed}>"

    # ===================================================================== structure
    def _build(self, model: nn.Module) -> ModelStructure:
        s = build_structure(model, self._optimizers)
        self._updates.clear()             # cached views must not outlive the structure's tensors
        for node in s.modules:            # stable ids across rebuilds (a head replaced mid-run)
            node.module_id = self._ids_by_path.setdefault(node.path, len(self._ids_by_path))
        remap = {i: n.module_id for i, n in enumerate(s.modules)}
        for node in s.modules:
            node.parent_id = remap.get(node.parent_id) if node.parent_id is not None else None
        for t in s.tensors:
            t.module_id = remap.get(t.module_id) if t.module_id is not None else None
            t.param_id = self._tids_by_path.setdefault(t.path, len(self._tids_by_path))
        self._module_ids = {id(n.module): n.module_id for n in s.modules if n.module is not None}
        self._module_nodes = {n.module_id: n for n in s.modules}
        for rt in self._runtime_nodes.values():
            self._module_nodes[rt.module_id] = rt
        self._tensor_nodes = {t.param_id: t for t in s.tensors}
        self._lookup = None            # path/type tables for the detectors, rebuilt lazily
        self._tensor_owners = self._owners(s)
        self._root_id = self._ids_by_path[""]
        self._mode_relevant = {n.module_id for n in s.modules if n.module is not None and (
            is_mode_sensitive(n.module) or (not n.type_module.startswith("torch.")
                                            and subtree_has_state_or_modes(n.module)))}
        self._sat = {n.module_id: saturation_kind(n.module) for n in s.modules if n.module is not None}
        self._exempt_bypass = self._builtin_children(s)
        self._static = structural_findings(s, step=self._step)
        self._signature = self._compute_signature(model)
        self._writer.submit(records.structure_ops(self.rank, s.modules, s.tensors, self._step), droppable=False)
        self._structure = s
        return s

    def _owners(self, s: ModelStructure) -> dict[int, list[int]]:
        """Every module that owns a tensor, under any of its names (tied weights)."""
        by_path = {n.path: n.module_id for n in s.modules}
        for n in s.modules:
            for a in n.aliases:
                by_path.setdefault(a, n.module_id)
        owners: dict[int, list[int]] = {}
        for t in s.tensors:
            mids = [t.module_id] if t.module_id is not None else []
            for alias in t.aliases:
                mid = by_path.get(alias.rpartition(".")[0])
                if mid is not None and mid not in mids:
                    mids.append(mid)
            owners[t.param_id] = mids
        return owners

    def _builtin_children(self, s: ModelStructure) -> set[int]:
        """Modules whose torch.nn parent uses their parameters functionally (MultiheadAttention's
        out_proj): not calling them is by design, not a bypass."""
        out = set()
        for n in s.modules:
            if n.parent_id is None:
                continue
            parent = self._module_nodes.get(n.parent_id)
            if parent is not None and parent.type_module.startswith("torch.nn"):
                out.add(n.module_id)
        return out

    def _compute_signature(self, model: nn.Module) -> tuple:
        """Changes when parameters are replaced, materialised (lazy) or the optimizer's groups change."""
        from .structure import is_uninitialized
        params = tuple((id(p), is_uninitialized(p)) for p in model.parameters())
        opt = tuple(id(p) for o in self._optimizers for g in o.param_groups for p in g["params"])
        return (params, opt)

    def _maybe_rebuild(self) -> None:
        model = self._model_ref()
        if model is None:
            return
        if self._compute_signature(model) != self._signature or self._sample_index % REBUILD_EVERY == 0:
            self._build(model)

    # ===================================================================== hooks
    def _guard(self, location: str) -> "_Guard":
        """``with self._guard(where):`` around every hook body: times it and never lets a probe
        failure reach the training loop (the error is counted and stored instead)."""
        return _Guard(self, location)

    def _eager(self, fn: Callable) -> Callable:
        """Under torch.compile, run our hooks eagerly instead of letting dynamo trace them (which
        would break graphs and recompile); a plain function otherwise (no wrapper cost)."""
        if self._compiled and hasattr(torch, "compiler") and hasattr(torch.compiler, "disable"):
            return torch.compiler.disable(fn)
        return fn

    def _arm(self) -> None:
        """Prepare a sampled step: only forward pre-hooks on the root and its children, which
        attach the real hooks at the first forward of the step. Between steps (and so around
        other models' forwards) no global hook exists."""
        st = self._state = _StepState()
        self._sampled = True
        top = [n.module for n in self._structure.modules
               if n.module is not None and (n.parent_id is None or n.parent_id == self._root_id)]
        for module in top:
            st.handles.append(module.register_forward_pre_hook(self._eager(self._on_trigger)))

    def _on_trigger(self, module: nn.Module, args: Any) -> None:
        st = self._state
        if st is None or self._closed or st.live:
            return
        with self._guard("attach"):
            for h in st.handles:
                h.remove()
            st.handles.clear()
            st.live = True
            mod = torch.nn.modules.module
            st.handles.append(mod.register_module_forward_pre_hook(self._eager(self._on_pre_forward)))
            st.handles.append(mod.register_module_forward_hook(self._eager(self._on_forward)))
            for t in self._structure.tensors:
                tensor = t.tensor
                if tensor is None or t.kind == "buffer" or measure_skip(tensor) or not tensor.requires_grad \
                        or tensor.grad_fn is not None:
                    continue
                st.handles.append(tensor.register_hook(self._eager(functools.partial(self._on_grad, t.param_id))))
        # the global pre-hook registered just now does not run for the call in progress
        self._on_pre_forward(module, args)

    def _detach(self) -> None:
        st = self._state
        if st is not None:
            for h in st.handles:
                h.remove()
            st.handles.clear()
        self._sampled = False

    def _on_pre_forward(self, module: nn.Module, args: Any) -> None:
        st = self._state
        if st is None or self._closed:
            return
        with self._guard("forward-pre-hook"):
            mid = self._module_ids.get(id(module))
            if mid == self._root_id:
                st.stack = [mid]
                st.root_training = module.training
                return
            if mid is None:
                if not st.stack:
                    return            # a module of another model
                mid = self._runtime_module(module, st.stack[-1], st)
            st.stack.append(mid)

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        st = self._state
        if st is None or self._closed or not st.stack:
            return
        with self._guard("forward-hook"):
            mid = self._module_ids.get(id(module))
            if mid is None:
                mid = st.runtime_seen.get((id(module), type(module).__name__))
                if mid is None:
                    return
            if mid in st.stack:
                while st.stack and st.stack.pop() != mid:
                    pass
            else:
                return
            n = st.calls.get(mid, 0)
            st.calls[mid] = n + 1
            training = module.training
            grad_on = torch.is_grad_enabled()
            if st.root_training is not None and mid in self._mode_relevant and training != st.root_training:
                st.mismatch[mid] = (training, st.root_training)
            if training and not grad_on and is_mode_sensitive(module):
                if mid not in st.nograd_train:
                    st.nograd_train.append(mid)
                st.inference_mode = st.inference_mode or torch.is_inference_mode_enabled()
            if n >= MAX_CALLS_MEASURED:
                return
            tensors = measure.float_tensors(output)
            x = measure.primary(tensors)
            if x is None:
                return
            st.order += 1
            # wrappers (Sequential, the root, in-place activations' callers) often return the very
            # tensor a child returned: measure it once and share the row
            key = (id(x), x._version, x.data_ptr(), tuple(x.shape))
            seen = st.measured.get(key)
            if seen is not None and not tensors[1:]:
                st.rows.setdefault(mid, []).append((seen, st.order, training, grad_on, x.numel()))
                if key in st.grad_targets:
                    st.grad_targets[key].append(mid)
                return
            others = [t for t in tensors if t is not x]
            udim = self._unit_dims.get((mid, x.dim()))
            if udim is None:
                udim = self._unit_dims[(mid, x.dim())] = unit_dim(module, x.dim())
            chunk, layout = measure.call_chunk(x, others, udim, self._sat.get(mid))
            slot = st.m.add_call(chunk, layout, mid)
            st.measured[key] = slot
            st.rows.setdefault(mid, []).append((slot, st.order, training, grad_on, x.numel()))
            if grad_on and x.requires_grad:
                st.grad_targets[key] = [mid]
                x.register_hook(self._eager(functools.partial(self._on_output_grad, st, key)))

    def _on_output_grad(self, st: _StepState, key: tuple, grad: torch.Tensor) -> None:
        if st is not self._state or self._closed:
            return
        with self._guard("output-grad-hook"):
            slot = st.m.add(measure.norm32(grad.detach()))
            for mid in st.grad_targets.get(key, ()):
                if len(st.ograd.get(mid, ())) < MAX_CALLS_MEASURED:
                    st.ograd.setdefault(mid, []).append(slot)

    def _on_grad(self, tid: int, grad: torch.Tensor) -> None:
        st = self._state
        if st is None or self._closed:
            return
        with self._guard("grad-hook"):
            if tid in st.arrived:
                return
            st.arrived.add(tid)
            node = self._tensor_nodes.get(tid)
            existing = node.tensor.grad if node is not None and node.tensor is not None else None
            if existing is not None and not existing.is_sparse:
                st.stale[tid] = st.m.add(measure.norm32(existing.detach()))

    def _runtime_module(self, module: nn.Module, parent: int, st: _StepState) -> int:
        """A module executed inside the model but not reachable from it (closure, global, or
        built inside forward)."""
        tname = type(module).__name__
        known = st.runtime_seen.get((id(module), tname))
        if known is not None:
            return known
        k = st.runtime_count.get((parent, tname), 0)
        st.runtime_count[(parent, tname)] = k + 1
        key = (parent, tname, k)
        node = self._runtime_nodes.get(key)
        if node is None:
            parent_node = self._module_nodes.get(parent)
            ppath = parent_node.path if parent_node else ""
            label = f"<unreachable {tname}>" if k == 0 else f"<unreachable {tname}#{k}>"
            path = f"{ppath}.{label}" if ppath else label
            mid = self._ids_by_path.setdefault(path, len(self._ids_by_path))
            numel = sum(p.numel() for p in module.parameters())
            node = ModuleNode(module_id=mid, path=path, parent_id=parent, name=label, type=tname,
                              type_module=type(module).__module__, kind="runtime",
                              depth=(parent_node.depth + 1) if parent_node else 1, module=None,
                              params_total=numel,
                              params_trainable=sum(p.numel() for p in module.parameters() if p.requires_grad))
            self._runtime_nodes[key] = node
            self._module_nodes[mid] = node
            self._writer.submit(records.structure_ops(self.rank, [node], [], self._step), droppable=False)
        prev = self._runtime_objects.get(key)
        persistent = prev is not None and prev() is module
        with contextlib.suppress(TypeError):
            self._runtime_objects[key] = weakref.ref(module)
        has_state = subtree_has_state_or_modes(module)
        if has_state and persistent:
            msg = (f"{node.type} is called inside {self._module_nodes[parent].path or '<root>'} but is not "
                   "reachable from the model's attributes (held in a closure or a global): its parameters "
                   "are invisible to the optimizer, state_dict(), .to() and .eval().")
            sev = "error"
        elif has_state and prev is not None:
            msg = (f"A new {node.type} is constructed on every forward call inside "
                   f"{self._module_nodes[parent].path or '<root>'}: its weights are re-initialised each call "
                   "and never trained, saved or moved.")
            sev = "error"
        elif has_state:
            msg = (f"{node.type} with parameters runs inside {self._module_nodes[parent].path or '<root>'} "
                   "but is not part of the model: the optimizer, state_dict(), .to() and .eval() miss it.")
            sev = "error"
        else:
            msg = (f"{node.type} is built or held outside the model and called in forward "
                   f"({self._module_nodes[parent].path or '<root>'}); it has no parameters or buffers, "
                   "so this is harmless (a loss criterion built per call, for example).")
            sev = "info"
        self._runtime_findings[node.path] = F.make(
            "unregistered-module", node.path, msg, severity=sev, step=self._step,
            evidence={"type": node.type, "called_from": self._module_nodes[parent].path or "<root>",
                      "parameter_numbers": node.params_total, "same_object_each_step": persistent})
        st.runtime_seen[(id(module), tname)] = node.module_id
        return node.module_id

    # ===================================================================== optimizer steps
    def _on_opt_pre(self, oi: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        if oi in self._stepped:          # this optimizer steps again: a new step began
            with self._guard("step-boundary"):
                self._end_step()
        if not self._sampled or self._state is None:
            return
        with self._guard("optimizer-pre-hook"):
            st = self._state
            if -1 not in st.before and not st.update_slots:
                # tensors no optimizer holds: their change across this step proves (non-)updates
                orphans = self._orphan_tensors()
                if orphans:
                    self._measure_grads(st, orphans)
                    st.before[-1] = (orphans, self._updates.take([self._tensor_nodes[t].tensor for t in orphans]))
            tids = self._opt_tensors(oi)
            if not tids:
                return
            tensors = [self._tensor_nodes[t].tensor for t in tids]
            self._measure_grads(st, tids)
            st.before[oi] = (tids, self._updates.take(tensors))

    def _on_opt_post(self, oi: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        with self._guard("optimizer-post-hook"):
            st = self._state
            if self._sampled and st is not None and oi in st.before:
                tids, before = st.before.pop(oi)
                self._measure_updates(st, tids, before)
        self._stepped.add(oi)
        if len(self._stepped) >= len(self._optimizers):
            with self._guard("step-boundary"):
                self._end_step()

    def _measure_updates(self, st: _StepState, tids: list[int], before: list[torch.Tensor]) -> None:
        """Sampled change across the step, plus the data norm after it (which catches a change
        the sample missed)."""
        after = [self._tensor_nodes[t].tensor for t in tids]
        vec = self._updates.delta_norms(after, before)
        if vec is None:
            return
        slot = st.m.add(vec)
        for pos, tid in enumerate(tids):
            st.update_slots[tid] = (slot, pos)
        if vec.device.type == "cpu":
            # reading a CPU tensor costs no sync: the full-tensor check only where the sample saw no change
            check = [pos for pos in torch.nonzero(vec == 0).flatten().tolist()]
        else:
            check = list(range(len(tids)))
        if check:
            post = st.m.add(measure.norms([after[pos] for pos in check]))
            for i, pos in enumerate(check):
                st.post_slots[tids[pos]] = (post, i)

    def _orphan_tensors(self) -> list[int]:
        return [t.param_id for t in self._structure.tensors
                if t.opt_index is None and t.kind != "buffer" and t.tensor is not None
                and t.tensor.requires_grad and not measure_skip(t.tensor)]

    def _opt_tensors(self, oi: int) -> list[int]:
        return [t.param_id for t in self._structure.tensors
                if t.opt_index == oi and t.tensor is not None and not measure_skip(t.tensor)]

    def _measure_grads(self, st: _StepState, tids: list[int]) -> None:
        have = [t for t in tids if t not in st.grad_slots]
        with_grad = [t for t in have if self._tensor_nodes[t].tensor.grad is not None
                     and not self._tensor_nodes[t].tensor.grad.is_sparse]
        if with_grad:
            vec = measure.norms([self._tensor_nodes[t].tensor.grad for t in with_grad])
            slot = st.m.add(vec)
            for pos, tid in enumerate(with_grad):
                st.grad_slots[tid] = (slot, pos)
        rest = [t for t in have if t not in st.data_slots]
        if rest:
            vec = measure.norms([self._tensor_nodes[t].tensor for t in rest])
            slot = st.m.add(vec)
            for pos, tid in enumerate(rest):
                st.data_slots[tid] = (slot, pos)

    # ===================================================================== step end
    def _end_step(self) -> None:
        t_end = time.perf_counter()
        step = self._step
        sampled = self._sampled and self._state is not None
        if self._unread is not None:               # a deferred sample before this step's own
            self._complete_unread(force=sampled)
        if sampled:
            with self._guard("finish-sample"):     # whatever fails here, the step still ends cleanly
                self._finish_sample(step)
        t_done = time.perf_counter()
        # the step's wall time as training sees it, finishing work included (the budget compares
        # sampled with unsampled steps); the probe's own time: hooks during the step plus finishing
        step_ms = (t_done - self._step_t0) * 1e3
        probe_ms = self._probe_s * 1e3 + (t_done - t_end) * 1e3
        self._policy.observe(step, step_ms, probe_ms, sampled)
        self._writer.submit([records.step_op(self.rank, step, time.time(), step_ms, probe_ms, sampled)])
        if sampled or step % 50 == 0 or self._errors.dirty:
            self._write_counters()
        self._stepped.clear()
        self._step = step + 1
        self._probe_s = 0.0
        if sampled:
            self._detach()
            self._state = None
        if self._policy.should_sample(self._step):
            self._arm()
        self._step_t0 = time.perf_counter()

    def _finish_sample(self, step: int) -> None:
        st = self._state
        assert st is not None
        # tensors no optimizer stepped (unregistered, not-in-optimizer, or no optimizer at all)
        remaining = [t.param_id for t in self._structure.tensors
                     if t.tensor is not None and t.kind != "buffer" and t.param_id not in st.grad_slots
                     and not measure_skip(t.tensor)]
        if remaining:
            self._measure_grads(st, remaining)
        if -1 in st.before:
            tids, before = st.before.pop(-1)
            self._measure_updates(st, tids, before)
        pending, self._pending_losses = self._pending_losses, []
        loss_slots = [(s, st.m.add(v.reshape(-1)[:1])) for s, v in pending]
        fetch = st.m.start_fetch()                  # the one host copy of this step
        if fetch.deferred:
            # non-blocking on an accelerator: read at a later step boundary, once it has landed
            self._unread = _UnreadSample(step, st, fetch, loss_slots, self._step)
        else:
            self._read_sample(step, st, fetch, loss_slots)

    def _complete_unread(self, force: bool) -> None:
        """Read a deferred sample's copy when it has landed (or now, with ``force``)."""
        u = self._unread
        if u is None or not (force or u.fetch.ready() or self._step - u.started >= MAX_UNREAD_STEPS):
            return
        self._unread = None
        with self._guard("finish-sample"):
            self._read_sample(u.step, u.st, u.fetch, u.loss_slots)

    def _read_sample(self, step: int, st: _StepState, fetch: measure.PendingFetch,
                     loss_slots: list[tuple[int, int]]) -> None:
        model = self._model_ref()
        values = fetch.values(self._activity, self._sample_index)
        if loss_slots:
            now = time.time()
            self._writer.submit([records.loss_op(self.rank, s, now, values[slot][0]) for s, slot in loss_slots])
        self._sample_index += 1
        self._recent_samples.append(step)
        if self._sample_index % THIN_EVERY == 0 and len(self._recent_samples) >= THIN_RECENT:
            cutoff = self._recent_samples[-THIN_RECENT]
            bucket = max(1, -(-cutoff // THIN_OLD))
            self._writer.submit(records.thin_ops(self.rank, cutoff, bucket), droppable=False)
        msamples = self._module_samples(step, st, values)
        tsamples = self._tensor_samples(step, st, values)
        self._detectors.observe({m: s for m, (s, _) in msamples.items()}, tsamples)
        mrows = [(self.rank, mid, step, s.calls, s.numel, s.mean, s.std, s.absmax, s.zero_frac, s.dead_frac,
                  s.sat_frac, s.nonfinite, s.out_grad_norm, *self._mode_of(st, mid), json.dumps(h))
                 for mid, (s, h) in msamples.items()]
        prows = [(self.rank, tid, step, s.grad_norm, s.data_norm, s.update_norm,
                  (s.update_norm / s.data_norm) if s.update_norm is not None and s.data_norm else None)
                 for tid, s in tsamples.items()]
        ops = [records.module_stats_op([_finite_row(r) for r in mrows]),
               records.param_stats_op([_finite_row(r) for r in prows])]
        for tid, s in tsamples.items():
            if s.update_norm is not None and s.arrived:
                moved = 1 if s.update_norm > 0 else 0
                if self._moved.get(tid) != 1 and self._moved.get(tid) != moved:
                    self._moved[tid] = max(moved, self._moved.get(tid, 0))
                    ops.append(records.moved_op(self.rank, {tid: self._moved[tid]}))
        if not self._writer.submit(ops):
            pass                                     # counted as dropped by the writer
        if model is not None and not self._closed:
            self._maybe_rebuild()
        self._update_findings(step, st, {m: s for m, (s, _) in msamples.items()}, tsamples)

    def _mode_of(self, st: _StepState, mid: int) -> tuple[int | None, int | None]:
        rows = st.rows.get(mid)
        if not rows:
            return (None, None)
        return (int(rows[0][2]), int(rows[0][3]))

    def _module_samples(self, step: int, st: _StepState, values: list[list[float]]):
        out: dict[int, tuple[ModuleSample, list[float]]] = {}
        for mid, rows in st.rows.items():
            numel = rows[0][4]
            k = len(measure.CALL_FIELDS)
            if len(rows) == 1:                                  # the common case: one call
                row = values[rows[0][0]]
                agg, hist = row[:k], row[k:]
            else:
                vecs = [values[slot] for slot, *_ in rows]
                agg = [sum(v[i] for v in vecs) / len(vecs) for i in range(k)]
                agg[2] = max(v[2] for v in vecs)                # absmax
                agg[4] = vecs[-1][4]                            # dead over the window: latest
                agg[6] = sum(v[6] for v in vecs)                # nonfinite count
                hist = [sum(col) for col in zip(*(v[k:] for v in vecs))]
            total = sum(hist)
            agg[3] = hist[measure.ZERO_BIN] / total if total else None
            og = [values[s][0] for s in st.ograd.get(mid, [])]
            sample = ModuleSample(
                step=step, calls=st.calls.get(mid, len(rows)), numel=numel,
                mean=agg[0], std=agg[1], absmax=agg[2], zero_frac=agg[3],
                dead_frac=None if agg[4] < 0 else agg[4], sat_frac=None if agg[5] < 0 else agg[5],
                nonfinite=int(agg[6]) if agg[6] == agg[6] else numel,
                out_grad_norm=(sum(og) / len(og)) if og else None, order=rows[0][1])
            out[mid] = (sample, [int(c) for c in hist])
        return out

    def _tensor_samples(self, step: int, st: _StepState, values: list[list[float]]) -> dict[int, TensorSample]:
        out: dict[int, TensorSample] = {}
        tids = set(st.grad_slots) | set(st.data_slots) | st.arrived
        def pick(slots: dict[int, tuple[int, int]], tid: int) -> float | None:
            sp = slots.get(tid)
            return values[sp[0]][sp[1]] if sp is not None else None
        for tid in tids:
            stale = values[st.stale[tid]][0] if tid in st.stale else None
            data, update, post = (pick(st.data_slots, tid), pick(st.update_slots, tid),
                                  pick(st.post_slots, tid))
            if update is not None:
                numel = self._tensor_nodes[tid].numel
                k = measure.sample_size(numel)
                update *= math.sqrt(numel / k) if k else 0.0
                if update == 0.0 and post is not None and data is not None and post != data:
                    update = abs(post - data)        # the sample missed the change: a lower bound
            out[tid] = TensorSample(step=step, grad_norm=pick(st.grad_slots, tid), data_norm=data,
                                    update_norm=update, stale_grad_norm=stale, arrived=tid in st.arrived)
        return out

    def _update_findings(self, step: int, st: _StepState, msamples: dict[int, ModuleSample],
                         tsamples: dict[int, TensorSample]) -> None:
        if self._lookup is None or self._lookup[0] != len(self._module_nodes):
            nodes = self._module_nodes
            self._lookup = (len(nodes),
                            {mid: n.path for mid, n in nodes.items()},
                            {mid: n.type for mid, n in nodes.items()},
                            {tid: t.path for tid, t in self._tensor_nodes.items()},
                            {tid: t.module_id for tid, t in self._tensor_nodes.items()},
                            {tid: {"in_optimizer": t.in_optimizer, "lr": t.lr}
                             for tid, t in self._tensor_nodes.items()})
        _, module_path, module_type, tensor_path, tensor_module, tensor_info = self._lookup
        bypass = []
        if st.calls:
            for tid in sorted(st.arrived):
                owners = self._tensor_owners.get(tid, [])
                if owners and not any(st.calls.get(m) for m in owners) \
                        and not any(m in self._exempt_bypass for m in owners):
                    bypass.append((tid, owners))
        modes = ModeEvents(st.mismatch, st.nograd_train, st.inference_mode)
        dynamic = self._detectors.evaluate(step, module_path, module_type, tensor_path, tensor_module,
                                           tensor_info, msamples, tsamples, modes,
                                           optimizer_stepped=bool(st.update_slots),
                                           bypass_candidates=bypass)
        current = list(self._static) + list(self._runtime_findings.values()) + dynamic
        self._set_findings(step, current)

    def _set_findings(self, step: int, current: list[Finding]) -> None:
        path_to_mid = {n.path: mid for mid, n in self._module_nodes.items()}
        tensor_mid = {t.path: t.module_id for t in self._tensor_nodes.values()}
        new: dict[tuple[str, str], tuple[Finding, int | None, int | None]] = {}
        for f in current:
            first = self._first_seen.setdefault(f.key, step)
            mid = path_to_mid.get(f.path, tensor_mid.get(f.path))
            if mid is None and f.code == "stale-optimizer-param":
                mid = self._root_id
            new[f.key] = (f, mid, first)
        with self._lock:
            old = self._active
            resolved = [k for k in old if k not in new]
            self._active = new
        # only new or changed findings are rewritten; the others just get their last_step moved
        changed = [v for k, v in new.items() if k not in old or old[k][0].message != v[0].message
                   or old[k][0].evidence != v[0].evidence or old[k][1] != v[1]]
        ops = records.findings_ops(self.rank, changed, resolved, step)
        ops.append(("UPDATE findings SET last_step=? WHERE rank=? AND active=1", [(step, self.rank)]))
        self._writer.submit(ops, droppable=False)

    # ===================================================================== misc
    def _record_loss(self, step: int, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            if loss.device.type == "cpu":
                loss = float(loss.reshape(-1)[0]) if loss.numel() else None
            else:
                # read with the next sampled step's single host copy (or after 64 steps, or at close)
                self._pending_losses.append((step, loss))
                if len(self._pending_losses) >= 64:
                    self._flush_losses()
                return
        elif loss is not None:
            loss = float(loss)
        self._writer.submit([records.loss_op(self.rank, step, time.time(), loss)])

    def _flush_losses(self) -> None:
        if not self._pending_losses:
            return
        pending, self._pending_losses = self._pending_losses, []
        vals = torch.stack([v.reshape(-1)[0].float() for _, v in pending]).cpu().tolist()
        now = time.time()
        self._writer.submit([records.loss_op(self.rank, s, now, v) for (s, _), v in zip(pending, vals)])

    def _write_counters(self, status: str = "running", closed_at: float | None = None) -> None:
        ops = [records.rank_counters_op(self.rank, self._step, time.time(), self._writer.written,
                                        self._writer.dropped, self._errors.total, self._policy.overhead(),
                                        status, closed_at)]
        if self._errors.dirty:
            ops.append(records.errors_op(self.rank, self._errors.entries))
            self._errors.dirty = False
        self._writer.submit(ops, droppable=False)

    @property
    def probe_errors(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Errors caught inside hooks: (location, exception type) -> count, message, steps."""
        return {k: dict(v) for k, v in self._errors.entries.items()}

    @property
    def samples_dropped(self) -> int:
        return self._writer.dropped


def measure_skip(t: torch.Tensor) -> bool:
    from .structure import is_uninitialized
    return is_uninitialized(t) or t.device.type == "meta" or t.is_sparse or not t.is_floating_point()


def _finite_row(row: tuple) -> tuple:
    return tuple(records.finite_or_none(v) if isinstance(v, float) else v for v in row)


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
