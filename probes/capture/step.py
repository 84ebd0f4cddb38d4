"""Step capture: the hooks of a sampled step and what they gather.

Hooks exist only on sampled steps. A sampled step is armed with forward pre-hooks on the root and its
children; its first forward attaches two global module hooks (forward pre/post, filtered to this model)
and one gradient hook per watched trainable tensor; :meth:`StepCapture.detach` removes them all. Every
hook body runs inside the probe guard: an exception is counted, stored and never reaches the training
loop. The hooks only launch device work and note where its results will be (slots of one
:class:`~probes.capture.measure.StepMeasurements`); :mod:`probes.capture.decode` turns the fetched values into samples.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..model import frozen, tensors
from ..model.index import ModelIndex
from ..model.runtime import ForwardSightings, RuntimeModules
from ..model.structure import CompiledModules, ModuleNode, unit_dim
from ..schema import TensorKind
from . import batch, measure, tensor_stats
from .guard import RAISE_PROBE_ERRORS, ProbeRuntime
from .hooks import HeldHook

__all__ = ["MAX_CALLS_MEASURED", "CallRecord", "PerTensor", "StepCapture", "StepRecord", "TensorSlot", "UpdateBaseline",
           "hide_global_hook_warning", "restore_warning_filters"]

_HAS_STANCE = hasattr(torch, "compiler") and hasattr(torch.compiler, "set_stance")   # torch >= 2.6
MAX_CALLS_MEASURED = 4          # calls of one module measured per step (all are counted)
_GRAD = operator.attrgetter("grad")
_PLAIN_LEAVES = (torch.Tensor, nn.Parameter)     # no __torch_function__ of their own: register_hook's fast case
GradHookDict = dict[int, Callable[[torch.Tensor], Any]]     # a tensor's _backward_hooks
_GRAD_HOOK_KEY = -0x6D73       # our key in a tensor's hook dict (torch's handle ids count up from 0: no clash)

OutputKey = tuple[int, int, int, tuple[int, ...]]       # id, _version, data_ptr, shape of a module output
UpdateTaken = list[tuple[list[int], torch.Tensor, tuple[int, ...]]]   # tensor_stats.UpdateSampler.take()


# torch.compile(module) warns at each call of the wrapper while global module hooks exist, which ours do
# during a sampled step (they skip the wrapper: it is not in the model index); not the user's concern
_GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


def hide_global_hook_warning() -> Any:
    """Hide torch's warning about global module hooks (ours) at torch.compile wrapper calls; returns the
    filter for :func:`restore_warning_filters`."""
    warnings.filterwarnings("ignore", message=_GLOBAL_HOOK_WARNING, category=UserWarning)
    return warnings.filters[0]


def restore_warning_filters(entry: Any) -> None:
    filters: list[Any] = warnings.filters  # type: ignore[assignment]   # a list at run time
    try:
        filters.remove(entry)
    except ValueError:
        return                          # the user reset the filters meanwhile
    mutated = getattr(warnings, "_filters_mutated", None)   # so cached decisions are made again
    if callable(mutated):
        mutated()


class CallRecord(NamedTuple):
    """One measured call of a module: where its statistics are, and the modes it ran in."""

    slot: int
    order: int                  # execution order among the step's measured calls
    training: bool
    grad_enabled: bool
    numel: int
    per_unit: int               # values per unit of the output (dead units' evidence); 0: no units tracked


class IndexTensors(NamedTuple):
    """One of the index's lists of tensor ids, with what its sampled steps read of it every time: the tensors
    (local values), their optimizer param groups, and the plan of their norms (probes.capture.tensor_stats)."""

    ids: list[int]                  # the index's own list: kept, so its id() (the cache key) stays its own
    tensors: list[torch.Tensor]
    opt_groups: list[int | None]
    plan: tensor_stats.NormPlan


class TensorSlot(NamedTuple):
    """Where one tensor's value is among the fetched vectors: vector ``slot``, element ``pos``."""

    slot: int
    pos: int


class PerTensor:
    """Where each tensor's value of one kind (gradient norm, data norm...) is among the fetched vectors: kept
    vector by vector, as (slot, the tensor ids of its elements), not an object per tensor; a later vector
    overrides an earlier one for a tensor in both."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, list[int]]] = []
        self._ids: set[int] = set()

    def add(self, slot: int, tensor_ids: list[int]) -> None:
        """Element i of vector ``slot`` is the value of tensor ``tensor_ids[i]``."""
        self.blocks.append((slot, tensor_ids))
        self._ids.update(tensor_ids)

    def __contains__(self, tensor_id: object) -> bool:
        return tensor_id in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)

    def ids(self) -> set[int]:
        return self._ids

    def values(self, plain: Sequence[Sequence[float]]) -> dict[int, float]:
        """Tensor id -> its value, from the fetched vectors (``plain[slot]``)."""
        out: dict[int, float] = {}
        for slot, tensor_ids in self.blocks:
            out.update(zip(tensor_ids, plain[slot], strict=True))
        return out


class RetainedNorms(NamedTuple):
    """The gradient norms of the small outputs whose gradient autograd kept: element ``start + i`` of vector
    ``slot`` is the norm for the modules ``sharing[i]`` (each module's norms come after its ``out_grads``;
    MAX_CALLS_MEASURED at most)."""

    slot: int
    start: int
    sharing: list[list[int]]


@dataclasses.dataclass
class UpdateBaseline:
    """Sampled values of some tensors taken before an optimizer step, compared after it."""

    tensor_ids: list[int]
    taken: UpdateTaken


@dataclasses.dataclass
class StepRecord:
    """Everything gathered during one sampled step."""

    # the index its ids were taken from (it is decoded with it: a rebuild may have dropped some of them since)
    index: ModelIndex | None = None

    measurements: measure.StepMeasurements = dataclasses.field(default_factory=measure.StepMeasurements)
    calls: dict[int, int] = dataclasses.field(default_factory=dict)            # module id -> calls
    rows: dict[int, list[CallRecord]] = dataclasses.field(default_factory=dict)  # module id -> measured calls
    out_grads: dict[int, list[TensorSlot]] = dataclasses.field(default_factory=dict)  # module id -> grad norms
    retained_norms: RetainedNorms | None = None   # the norms of the gradients autograd kept, after out_grads'
    small_grads: list[tuple[torch.Tensor, list[int]]] = dataclasses.field(default_factory=list)  # (copy, modules)
    # small outputs whose gradient autograd keeps, the modules sharing each and its shape (one list per field: see
    # StepMeasurements' small outputs)
    retained: list[torch.Tensor] = dataclasses.field(default_factory=list)
    retained_sharing: list[list[int]] = dataclasses.field(default_factory=list)
    retained_shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    order: int = 0
    stack: list[int] = dataclasses.field(default_factory=list)                  # modules in a call now
    root_training: bool | None = None
    arrived: set[int] = dataclasses.field(default_factory=set)                  # tensors a gradient reached
    stale: dict[int, int] = dataclasses.field(default_factory=dict)             # tensor -> slot of old .grad norm
    # tensor -> slots of its .grad's norm when later gradients of the step arrived (a stale tensor's only): 0 says it
    # was zeroed in place in between, so what its optimizer steps on is this step's own
    rezeroed: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    grads: PerTensor = dataclasses.field(default_factory=PerTensor)
    data: PerTensor = dataclasses.field(default_factory=PerTensor)
    updates: PerTensor = dataclasses.field(default_factory=PerTensor)             # sampled, not scaled yet
    post: PerTensor = dataclasses.field(default_factory=PerTensor)                # data norm after the step
    baselines: dict[int, UpdateBaseline] = dataclasses.field(default_factory=dict)  # optimizer -> before
    # optimizer -> the rows its embedding tables' gradient reached, before the step
    touched: dict[int, tensor_stats.TouchedRows] = dataclasses.field(default_factory=dict)
    table_updates: PerTensor = dataclasses.field(default_factory=PerTensor)      # change in those rows
    orphan_baseline: UpdateBaseline | None = None      # tensors no optimizer holds
    stepped: set[int] = dataclasses.field(default_factory=set)     # the watched optimizers that stepped (their index)
    orphans_checked: bool = False
    # mid -> (own flag, the model's: None when no forward of the step told it)
    modes: dict[int, tuple[bool, bool | None]] = dataclasses.field(default_factory=dict)
    # mode-relevant modules that ran in training mode in any call of the step (a later call in eval, a part evaluated
    # within the step, does not undo what the training one did to running statistics)
    ran_training: set[int] = dataclasses.field(default_factory=set)
    # mid -> the model's modes it ran in step with in some call (1: eval, 2: train, 3: both): a mismatch's fix shows
    # in any call, not only in the step's last
    agreed: dict[int, int] = dataclasses.field(default_factory=dict)
    frozen_blocks: frozen.FrozenBlockSample | None = None   # norms, dropouts in training mode in frozen blocks
    lrs: dict[int, float | None] = dataclasses.field(default_factory=dict)          # tensor -> its group's lr
    # tensor -> where its group's lr is among the fetched vectors, for an lr held as a tensor on a device whose reads
    # cost a sync (fused optimizers take one): read with the step's one host copy, not in the optimizer hook
    device_lrs: dict[int, TensorSlot] = dataclasses.field(default_factory=dict)
    fingerprints: PerTensor = dataclasses.field(default_factory=PerTensor)        # replicas must agree
    local_grads: dict[int, int] = dataclasses.field(default_factory=dict)           # tensor -> slot (own grad)
    sightings: ForwardSightings = dataclasses.field(default_factory=ForwardSightings)
    # id() of every module of the model as it is now, made once a step when a module the index does not know runs
    registered: set[int] | None = None
    handles: list[RemovableHandle] = dataclasses.field(default_factory=list)
    hooked: list[torch.Tensor] = dataclasses.field(default_factory=list)     # tensors without hooks before
    # leaves given a gradient-hook dict of our own (they had none): (tensor, the dict)
    own_hook_dicts: list[tuple[torch.Tensor, GradHookDict]] = dataclasses.field(default_factory=list)
    # while a compiled model runs this step eagerly: the compiled call of each module compiled in place, the
    # hooks on torch.compile wrappers, and the stances those hooks entered (innermost last)
    compiled_calls: list[tuple[nn.Module, Any]] = dataclasses.field(default_factory=list)
    compiled_methods: list[tuple[nn.Module, str, Any]] = dataclasses.field(default_factory=list)
    eager_handles: list[RemovableHandle] = dataclasses.field(default_factory=list)
    stances: list[Any] = dataclasses.field(default_factory=list)
    warning_filter: Any = None   # the filter that hides torch's warning about our global hooks, while they exist
    # output -> (slot, the output itself, weakly): wrappers returning a child's very output share its row; the
    # weak reference tells that tensor apart from a later one that reuses its address after it was freed
    measured: dict[OutputKey, tuple[int, weakref.ref[torch.Tensor], int]] = dataclasses.field(default_factory=dict)
    grad_targets: dict[OutputKey, list[int]] = dataclasses.field(default_factory=dict)
    live: bool = False           # the real hooks are attached (after the step's first forward)

    @property
    def optimizer_stepped(self) -> bool:
        return bool(self.updates)


# what sys.getrefcount says, through map(), of an object that a list holds and nothing else: measured, not assumed
# (Python versions differ by one)
_HELD_BY_LIST_ONLY = next(map(sys.getrefcount, [object()]))


def release_outputs(rec: StepRecord) -> None:
    """Let go of the small outputs whose gradient autograd kept for us (``retain_grad``), once their gradients
    were read and the step's measurements hold them no more (after ``start_fetch``; ``detach`` makes sure). One
    that something else still holds keeps the ``.grad`` autograd gave it: the user may have asked to retain it
    too (``out.retain_grad()`` after our hook saw the output is a no-op), and setting it back to None would take
    it from them. The others are freed here, their ``.grad`` dropped first as before (a one-off script freed 15,000
    such outputs in 17 ms so and in 45 ms with their gradients; bench.many_modules shows no difference)."""
    outputs, rec.retained = rec.retained, []
    for x, count in zip(outputs, list(map(sys.getrefcount, outputs)), strict=True):
        if count <= _HELD_BY_LIST_ONLY:
            x.grad = None


class StepCapture:
    """Arms, runs and detaches the hooks of sampled steps. Hook bodies are bound methods (no extra
    indirection on the hot path)."""

    def __init__(self, probe: ProbeRuntime, runtime_modules: RuntimeModules,
                 on_new_module: Callable[[ModuleNode], None], replicas: bool = False) -> None:
        """``replicas``: one of several data-parallel ranks: fingerprints and this rank's own gradient
        norms are taken too, for the reader to compare ranks."""
        self.probe = probe
        self.replicas = replicas
        self.runtime_modules = runtime_modules
        self.on_new_module = on_new_module
        self.index: ModelIndex | None = None
        self.record: StepRecord | None = None
        self.closed = False
        # a module added to the model (or swapped in) since the index was built ran: the watcher rebuilds the index
        self.index_stale = False
        # the framework sets the model's mode on the root itself (Lightning's loops on the LightningModule): its
        # flag is the model's mode also in steps whose forwards call submodules only (training_step calling
        # self.encoder), where the root's forward never runs; elsewhere a root nobody calls may be a container
        # (an nn.ModuleDict of a student and its teacher) whose flag nobody sets
        self.root_sets_mode = False
        self.compiled = CompiledModules()        # set with each index (probes.model.structure.compiled_modules)
        # the model runs inside compiled code of the user's (a compiled train step calling it): a sampled step then
        # runs all compiled code eagerly, or our hooks would only ever be traced (learnt from a sampled step whose
        # optimizer stepped while no hook of ours ran eagerly)
        self.called_from_compiled = False
        self.updates = tensor_stats.UpdateSampler()
        self._unit_dims: dict[tuple[int, int], int] = {}      # (module id, output ndim) -> its unit dimension
        # (module id, shape, dtype, device) of a small output -> its layout, from one table of interned layouts
        self._small_layouts: dict[tuple[int, tuple[int, ...], torch.dtype, torch.device], batch.SmallLayout] = {}
        self._layouts = batch.SmallLayouts()
        # _gradient_hooks(): per index, each trainable leaf and the hook dict it gets
        self._grad_hooks: tuple[ModelIndex, list[tuple[torch.Tensor, Callable[[torch.Tensor], Any],
                                                       GradHookDict | None]]] | None = None
        self._top_level: tuple[ModelIndex, list[nn.Module]] | None = None    # arm()'s modules, per index
        # the shapes of the last sampled step's small output gradients and the plan of their norms
        self._grad_plan: tuple[list[tuple[int, ...]], tensor_stats.NormPlan] | None = None
        self._index_tensors: dict[int, IndexTensors] = {}   # id(list of the index) -> its tensors (this index)
        # small outputs are referenced, not copied, unless their module's output is changed in place
        # later in the step (learnt on the first sampled step, which copies all: probes.capture.batch)
        self._learning = True
        self._copy_outputs: set[int] = set()

    def learn_in_place(self, changed: set[int]) -> None:
        """After a sampled step's fetch started: the modules whose small outputs changed after their hook."""
        self._learning = False
        self._copy_outputs |= changed

    def clear(self) -> None:
        """Drop cached views of the model's tensors and what was learnt of its modules (the index is being
        rebuilt or the watcher closes)."""
        self.updates.clear()
        self._index_tensors.clear()
        self._unit_dims.clear()
        self._small_layouts.clear()
        self._layouts.clear()
        self._grad_plan = None
        self._grad_hooks, self._top_level = None, None

    def close(self) -> None:
        self.closed = True
        self.detach()
        self.probe.gc.resume()
        self.updates.clear()
        self._unit_dims.clear()
        self._small_layouts.clear()
        self._layouts.clear()
        self._grad_plan = None
        self._grad_hooks, self._top_level = None, None
        self._index_tensors.clear()
        self.index = None
        self.compiled = CompiledModules()

    def _output_grad_hook(self, rec: StepRecord, targets: list[int]) -> Callable[[torch.Tensor], None]:
        hook = functools.partial(self.on_output_grad, rec, targets)
        return self._eager(hook) if self.compiled else hook

    def _eager(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Under torch.compile without stances (torch < 2.6), run our hooks eagerly instead of letting dynamo
        trace them; a plain function otherwise (no wrapper cost)."""
        if self.compiled and not _HAS_STANCE and hasattr(torch, "compiler") and hasattr(torch.compiler, "disable"):
            return torch.compiler.disable(fn)  # type: ignore[no-any-return]
        return fn

    # ====================================================================== arming and detaching
    def arm(self, index: ModelIndex) -> None:
        """Prepare a sampled step: only forward pre-hooks on the root and its children, which attach the
        real hooks at the first forward of the step. Between steps (and so around other models'
        forwards) no global hook exists."""
        if index is not self.index:          # a module id may now name another module (a head swapped)
            self._index_tensors.clear()
            self._unit_dims.clear()
            self._small_layouts.clear()
            self._layouts.clear()
            self._grad_hooks = None
        self.index = index
        rec = self.record = StepRecord(index=index)
        if self.compiled:
            self._run_eagerly(rec)
        if self.called_from_compiled and _HAS_STANCE:
            rec.stances.append(torch.compiler.set_stance("force_eager"))    # undone at detach()
        trigger = HeldHook(self._eager(self.on_trigger))
        if self._top_level is None or self._top_level[0] is not index:
            # a TorchScript module refuses per-module hooks; the global hooks still see its calls
            self._top_level = (index, [m for m in index.top_level_modules()
                                       if not isinstance(m, torch.jit.ScriptModule)])
        for module in self._top_level[1]:
            rec.handles.append(module.register_forward_pre_hook(trigger))

    def detach(self) -> StepRecord | None:
        """Remove every hook of the step; returns what it gathered."""
        rec, self.record = self.record, None
        if rec is not None:
            if not rec.live and rec.optimizer_stepped:
                self.called_from_compiled = True      # the model's forward ran, but only dynamo saw our hooks
            for module, call in rec.compiled_calls:
                module._compiled_call_impl = call
            rec.compiled_calls.clear()
            for module, name, compiled in rec.compiled_methods:
                module.__dict__.setdefault(name, compiled)   # unless the user set another meanwhile
            rec.compiled_methods.clear()
            for h in rec.eager_handles:
                h.remove()
            rec.eager_handles.clear()
            while rec.stances:                             # a forward that never returned
                rec.stances.pop().__exit__(None, None, None)
            if rec.warning_filter is not None:
                restore_warning_filters(rec.warning_filter)
                rec.warning_filter = None
            for h in rec.handles:
                h.remove()
            rec.handles.clear()
            for tensor, hooks in rec.own_hook_dicts:
                if tensor._backward_hooks is hooks:
                    if len(hooks) == 1:
                        tensor._backward_hooks = None
                    else:                      # the user added a hook to it meanwhile: the dict is theirs now
                        del hooks[_GRAD_HOOK_KEY]
                        self._grad_hooks = None
            rec.own_hook_dicts.clear()
            for t in rec.hooked:
                # an emptied hook dict still leaves autograd a (Python) pre-hook to call on every backward:
                # a tensor that had no hooks before gets none back, and its fast path with it
                if t._backward_hooks is not None and not t._backward_hooks:
                    t._backward_hooks = None
            rec.hooked.clear()
            release_outputs(rec)
        return rec

    def set_compiled(self, found: CompiledModules) -> None:
        """What torch.compile put in the model (``structure.compiled_modules``, at each index build). A build
        during a sampled step does not see what that step swapped out: it is compiled all the same."""
        rec = self.record
        if rec is not None and (rec.compiled_calls or rec.compiled_methods):
            found = CompiledModules(
                found.wrappers,
                found.in_place + tuple(m for m, _ in rec.compiled_calls if not any(m is x for x in found.in_place)),
                found.methods + tuple((m, n) for m, n, _ in rec.compiled_methods
                                      if not any(m is x and n == y for x, y in found.methods)))
        self.compiled = found
        self._grad_hooks = None                 # their hooks are wrapped for compiled models (_eager)

    def _run_eagerly(self, rec: StepRecord) -> None:
        """A compiled model runs its sampled steps eagerly: the compiled graph never sees our hooks, so it is
        neither broken nor recompiled, and unsampled steps run it exactly as without modscope. Only this
        model's calls run eagerly: any other compiled code of the process (another model, a compiled loss)
        keeps its graph, sampled step or not."""
        for module in self.compiled.in_place:
            rec.compiled_calls.append((module, module._compiled_call_impl))
            module._compiled_call_impl = None          # this instance's __call__ runs _call_impl eagerly
        for module, name in self.compiled.methods:
            compiled = module.__dict__.pop(name, None)
            if compiled is not None:                   # the class's own method answers for this step
                rec.compiled_methods.append((module, name, compiled))
        if _HAS_STANCE:
            for wrapper in self.compiled.wrappers:
                rec.eager_handles.append(wrapper.register_forward_pre_hook(HeldHook(self._enter_eager)))
                rec.eager_handles.append(wrapper.register_forward_hook(HeldHook(self._exit_eager), always_call=True))

    def _enter_eager(self, module: nn.Module, args: Any) -> None:
        rec = self.record
        if rec is not None:
            rec.stances.append(torch.compiler.set_stance("force_eager"))

    def _exit_eager(self, module: nn.Module, args: Any, output: Any) -> None:
        rec = self.record
        if rec is not None and rec.stances:
            rec.stances.pop().__exit__(None, None, None)   # the stance the user had

    def on_trigger(self, module: nn.Module, args: Any) -> None:
        rec, index = self.record, self.index
        if rec is None or index is None or self.closed or rec.live or measure.is_compiling():
            return
        with self.probe.guard("attach"):
            self.probe.gc.pause()              # until the end of the step's finishing work
            for h in rec.handles:
                h.remove()
            rec.handles.clear()
            rec.live = True
            mod = torch.nn.modules.module
            rec.handles.append(mod.register_module_forward_pre_hook(self._eager(self.on_pre_forward)))
            rec.handles.append(mod.register_module_forward_hook(self._eager(self.on_forward)))
            if self.compiled.wrappers:
                rec.warning_filter = hide_global_hook_warning()
            own = rec.own_hook_dicts
            for tensor, hook, hooks in self._gradient_hooks(index):
                if not tensor.requires_grad:
                    continue                   # frozen since the index was built (rebuilt after this sample)
                if hooks is not None and tensor._backward_hooks is None:
                    # what Tensor.register_hook does for a leaf without hooks, without making a handle and a
                    # dict each time (most of its cost, paid for every parameter); detach() sets None back
                    tensor._backward_hooks = hooks
                    own.append((tensor, hooks))
                else:
                    if tensor._backward_hooks is None:
                        rec.hooked.append(tensor)
                    rec.handles.append(tensor.register_hook(hook))
            if self.replicas:
                self.measure_fingerprints(rec, index)
        # the global pre-hook registered just now does not run for the call in progress
        self.on_pre_forward(module, args)

    def _gradient_hooks(self, index: ModelIndex) -> list[tuple[torch.Tensor, Callable[[torch.Tensor], Any],
                                                                  GradHookDict | None]]:
        """Each trainable leaf of the index, its gradient hook, and the hook dict it gets while it has no hooks
        of its own (None: not a plain tensor, its hook goes through register_hook); made once per index."""
        if self._grad_hooks is not None and self._grad_hooks[0] is index:
            return self._grad_hooks[1]
        hooks: list[tuple[torch.Tensor, Callable[[torch.Tensor], Any], GradHookDict | None]] = []
        for t in index.grad_hook_targets():
            tensor = t.tensor
            assert tensor is not None
            hook = self._eager(functools.partial(self.on_grad, t.param_id))
            plain = type(tensor) in _PLAIN_LEAVES and tensor.grad_fn is None
            # an OrderedDict, as torch makes: a user's handle on it holds it by a weak reference
            hooks.append((tensor, hook, collections.OrderedDict({_GRAD_HOOK_KEY: hook}) if plain else None))
        self._grad_hooks = (index, hooks)
        return hooks

    # ====================================================================== forward
    def on_pre_forward(self, module: nn.Module, args: Any) -> None:
        rec, index = self.record, self.index
        if rec is None or index is None or self.closed or measure.is_compiling():
            return
        mid = index.module_ids.get(id(module))
        if mid is not None and mid != index.root_id and rec.stack:
            rec.stack.append(mid)     # the common case, which cannot fail: no guard (a third of this hook's cost)
            return
        self._guarded("forward-pre-hook", self._pre_forward, rec, index, module)

    def _guarded(self, location: str, body: Callable[..., None], *args: Any) -> None:
        """probes.capture.guard's Guard as a plain call: the forward hooks run on every module call of a sampled step,
        where making, entering and leaving a guard object costs about a tenth of the hook."""
        rt = self.probe
        t0 = time.perf_counter()
        rt.depth += 1
        try:
            body(*args)
        except Exception as exc:
            rt.errors.record(location, exc, rt.step)
            if RAISE_PROBE_ERRORS:
                raise
        finally:
            rt.depth -= 1
            if rt.depth == 0:
                rt.probe_s += max(0.0, time.perf_counter() - max(t0, rt.step_t0))

    def _pre_forward(self, rec: StepRecord, index: ModelIndex, module: nn.Module) -> None:
        mid = index.module_ids.get(id(module))
        if mid is None and id(module) in index.wrappers:
            return                # a wrapper inside the model (an FSDP unit): its module is what counts
        if mid == index.root_id:
            rec.stack = [mid]
            rec.root_training = module.training
            return
        if mid is None:
            if not rec.stack:
                return            # a module of another model
            if self._registered_now(rec, index, module):
                # registered since the index was built (a head added, a block swapped): not run-time, and not
                # measured until the index that names it is built, at the end of this step
                self.index_stale = True
                return
            mid, node = self.runtime_modules.discover(module, rec.stack[-1], index, rec.sightings,
                                                      self.probe.step)
            if node is not None:
                self.on_new_module(node)
        elif not rec.stack and (rec.root_training is not None or self.root_sets_mode):
            # a call from outside the model's forward (an evaluation of a part after model.eval(), a framework's
            # training_step calling a submodule): the model's mode is its flag now, not at its last forward
            root = index.modules[index.root_id].module
            if root is not None:
                rec.root_training = root.training
        rec.stack.append(mid)

    @staticmethod
    def _registered_now(rec: StepRecord, index: ModelIndex, module: nn.Module) -> bool:
        if rec.registered is None:
            root = index.modules[index.root_id].module
            rec.registered = set() if root is None else {id(m) for m in root.modules()}
        return id(module) in rec.registered

    def on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        rec, index = self.record, self.index
        if rec is None or index is None or self.closed or not rec.stack or measure.is_compiling():
            return
        self._guarded("forward-hook", self._forward, rec, index, module, output)

    def _forward(self, rec: StepRecord, index: ModelIndex, module: nn.Module, output: Any) -> None:
        mid = index.module_ids.get(id(module))
        if mid is None:
            if id(module) in index.wrappers:
                return
            mid = self.runtime_modules.lookup(module, rec.sightings)
            if mid is None:
                return
        if mid not in rec.stack:
            return
        while rec.stack and rec.stack.pop() != mid:
            pass
        n = rec.calls.get(mid, 0)
        rec.calls[mid] = n + 1
        training = module.training
        grad_on = torch.is_grad_enabled()
        if mid in index.mode_relevant:
            # a call out of step with the model stays the step's mode: a validation pass that left a module in
            # training mode, followed by the next training forward before the optimizer step, must not hide it.
            # Without the model's mode, the own flag still tells a frozen BatchNorm that updates its statistics
            mode = rec.modes.get(mid)
            if mode is None or mode[1] is None or mode[0] == mode[1]:
                rec.modes[mid] = (training, rec.root_training)
            if training:
                rec.ran_training.add(mid)
            if training == rec.root_training:
                rec.agreed[mid] = rec.agreed.get(mid, 0) | (2 if training else 1)
        if n >= MAX_CALLS_MEASURED:
            return
        others: list[torch.Tensor]
        x: torch.Tensor | None
        if type(output) is torch.Tensor and (dtype := output.dtype) in measure.FLOAT_TYPES and output.numel():
            x, others = output, []             # the common case, without walking a structure
        else:
            tensors = measure.float_tensors(output)
            x = measure.primary(tensors)
            if x is None:
                return
            others = [t for t in tensors if t is not x]
            dtype = x.dtype
        rec.order += 1
        numel = x.numel()
        # wrappers (Sequential, the root, in-place activations' callers) often return the very tensor
        # a child returned: measure it once and share the row
        try:
            version = x._version
        except RuntimeError:    # made under torch.inference_mode (validation): no version counter, nothing to keep
            version = -1
        key: OutputKey = (id(x), version, x.data_ptr(), x.shape)
        seen = rec.measured.get(key)
        if seen is not None and not others and seen[1]() is x:
            rec.rows.setdefault(mid, []).append(CallRecord(seen[0], rec.order, training, grad_on, numel, seen[2]))
            if key in rec.grad_targets:
                rec.grad_targets[key].append(mid)
            return
        if numel <= batch.SMALL_OUTPUT and not others and version >= 0:
            # kept (or copied) now, reduced with the step's other small outputs at its end (one batch of kernels)
            shape, device = key[3], x.device
            small = self._small_layouts.get((mid, shape, dtype, device))
            if small is None:
                small = self._small_layouts[(mid, shape, dtype, device)] = self._layouts.get(
                    shape, dtype, device, self._unit_dim(mid, module, len(shape)), index.saturation.get(mid))
            per_unit = numel // small.units if small.track and small.units else 0
            if self._learning:
                slot = rec.measurements.add_kept(batch.keep(x, small, copy=True, watch=True, version=key[1]), mid)
            elif mid in self._copy_outputs:
                slot = rec.measurements.add_kept(batch.keep(x, small, copy=True, watch=False, version=key[1]), mid)
            else:
                slot = rec.measurements.add_small(x, small, x, key[1], mid)      # batch.keep without a copy
        else:
            udim = self._unit_dim(mid, module, x.dim())
            chunk, layout = measure.call_chunk(x, others, udim, index.saturation.get(mid))
            slot = rec.measurements.add_call(chunk, layout, mid)
            per_unit = numel // layout.units if layout.track and layout.units else 0
        rec.measured[key] = (slot, weakref.ref(x), per_unit)
        rec.rows.setdefault(mid, []).append(CallRecord(slot, rec.order, training, grad_on, numel, per_unit))
        if grad_on and x.requires_grad:
            # the modules sharing this output, bound to it now: once the output is freed, a later output
            # may get its key (address, id, version 0) while its gradient is still to come
            targets = rec.grad_targets[key] = [mid]
            # not a leaf (it requires grad: so it has a grad_fn), asked without making grad_fn's Python object.
            # autograd keeps a tensor's gradient for its latest version only: an output changed in place after its
            # hook (known from the first sampled step on, which copies and checks every small output) gets a hook
            # of its own instead. One first changed at a later step is lost that step, its norm with its row
            if numel <= batch.SMALL_OUTPUT and not x.is_leaf and not self._learning and mid not in self._copy_outputs \
                    and not x.retains_grad:
                # autograd keeps its gradient for us (a C++ hook, several times cheaper than a Python one); read
                # and normed with the others at the end of the step. One kept already (by the user, or a tensor
                # a module returns step after step, whose .grad would add up) gets a hook of its own
                x.retain_grad()
                rec.retained.append(x)
                rec.retained_sharing.append(targets)
                rec.retained_shapes.append(key[3])
            else:
                x.register_hook(self._output_grad_hook(rec, targets))

    def _unit_dim(self, mid: int, module: nn.Module, ndim: int) -> int:
        udim = self._unit_dims.get((mid, ndim))
        if udim is None:
            udim = self._unit_dims[(mid, ndim)] = unit_dim(module, ndim)
        return udim

    # ====================================================================== backward
    def on_output_grad(self, rec: StepRecord, sharing: list[int], grad: torch.Tensor) -> None:
        if rec is not self.record or self.closed:
            return
        with self.probe.guard("output-grad-hook"):
            targets = [mid for mid in sharing if len(rec.out_grads.get(mid, ())) < MAX_CALLS_MEASURED]
            if grad.numel() <= batch.SMALL_OUTPUT:
                # normed with the others at the end of the step (a copy: autograd may reuse the buffer)
                rec.small_grads.append((grad.detach().clone(), targets))
                for mid in targets:
                    rec.out_grads.setdefault(mid, []).append(TensorSlot(-1, len(rec.small_grads) - 1))
                return
            slot = rec.measurements.add(tensor_stats.norm32(grad.detach()))
            for mid in targets:
                rec.out_grads.setdefault(mid, []).append(TensorSlot(slot, 0))

    def on_grad(self, tensor_id: int, grad: torch.Tensor) -> None:
        rec, index = self.record, self.index
        if rec is None or index is None or self.closed:
            return
        if tensor_id in rec.arrived:
            # another backward of the step, after one that found an old gradient (judged once: zeroed or not)
            if tensor_id in rec.stale and tensor_id not in rec.rezeroed:
                self._guarded("grad-hook", self._on_grad_again, rec, index, tensor_id)
            return
        if not self.replicas:
            # the common case, which cannot fail: no gradient was there before this one (no guard: it is
            # most of this hook's cost, paid for every parameter)
            node = index.tensors.get(tensor_id)
            if node is None or node.tensor is None or node.tensor.grad is None:
                rec.arrived.add(tensor_id)
                return
        self._guarded("grad-hook", self._on_grad, rec, index, tensor_id, grad)

    def _on_grad(self, rec: StepRecord, index: ModelIndex, tensor_id: int, grad: torch.Tensor) -> None:
        rec.arrived.add(tensor_id)
        if self.replicas:         # this rank's own gradient: the hook runs before any all-reduce
            rec.local_grads[tensor_id] = rec.measurements.add(tensor_stats.norm32(tensors.local(grad).detach()))
        node = index.tensors.get(tensor_id)
        existing = index.grad(tensor_id) if node is not None else None
        if existing is not None:
            rec.stale[tensor_id] = rec.measurements.add(tensor_stats.norm32(existing.detach()))

    def _on_grad_again(self, rec: StepRecord, index: ModelIndex, tensor_id: int) -> None:
        """A tensor whose first gradient of the step found an old one gets another: zeroed in between (a GAN trained
        generator first, whose backward reaches the discriminator before ``opt_d.zero_grad()``), the old one is not
        in what its optimizer steps on."""
        existing = index.grad(tensor_id) if tensor_id in index.tensors else None
        if existing is None:                        # zero_grad(set_to_none=True) ran in between
            del rec.stale[tensor_id]
            rec.rezeroed.pop(tensor_id, None)
        else:                                       # zeroed in place, or added to: told by its norm, on the device
            rec.rezeroed.setdefault(tensor_id, []).append(rec.measurements.add(tensor_stats.norm32(existing.detach())))

    # ====================================================================== optimizer steps
    def before_optimizer_step(self, opt_index: int, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are final: their norms, the learning rates (schedulers change them every step), and
        the update baseline of this optimizer's tensors."""
        rec, index = self.record, self.index
        if rec is None or index is None or opt_index in rec.baselines or opt_index in rec.stepped:
            return       # said already this step (a closure evaluated again: its first evaluation's gradients count)
        if not rec.orphans_checked and not rec.updates:
            # tensors no optimizer holds: their change across this step proves (non-)updates
            rec.orphans_checked = True
            orphans = index.orphan_tensors()
            if orphans:
                self.measure_grads(rec, orphans, self._tensors_of(index, orphans))
                rec.orphan_baseline = UpdateBaseline(orphans, self.updates.take([index.tensor(t) for t in orphans]))
        tids = index.optimizer_tensors(opt_index)
        if not tids:
            return
        known = self._tensors_of(index, tids)
        group_lrs = [_group_lr(rec, g.get("lr")) for g in optimizer.param_groups]
        numbers = [None if isinstance(lr, TensorSlot) else lr for lr in group_lrs]
        n_groups = len(group_lrs)
        groups = [g if g is not None and g < n_groups else None
                  for g in (known.opt_groups if known is not None else [index.tensors[t].opt_group for t in tids])]
        rec.lrs.update(zip(tids, [None if g is None else numbers[g] for g in groups], strict=True))
        if None in numbers:           # some held on a device, or not a number: those on a device come with the copy
            rec.device_lrs.update((t, lr) for t, g in zip(tids, groups, strict=True)
                                  if g is not None and isinstance(lr := group_lrs[g], TensorSlot))
        self.measure_grads(rec, tids, known)
        rec.baselines[opt_index] = UpdateBaseline(tids, self.updates.take(
            known.tensors if known is not None else [index.tensor(t) for t in tids]))
        tables = index.optimizer_tables(opt_index)
        if tables:
            touched = tensor_stats.touched_rows([index.tensor(t) for t in tables])
            if touched is not None:
                rec.touched[opt_index] = touched

    def _tensors_of(self, index: ModelIndex, ids: list[int]) -> IndexTensors | None:
        """The tensors of one of the index's own lists of ids (the same list object every step), read once
        per index; None where some are DTensors (their local shards are read each time)."""
        known = self._index_tensors.get(id(ids))
        if known is not None and known.ids is ids:
            return known
        nodes = [index.tensors[t] for t in ids]
        if any(n.tensor is None or type(n.tensor).__name__ == "DTensor" for n in nodes):
            return None
        tensors = [n.tensor for n in nodes if n.tensor is not None]
        known = self._index_tensors[id(ids)] = IndexTensors(ids, tensors, [n.opt_group for n in nodes],
                                                            tensor_stats.plan_norms(tensors))
        return known

    def after_optimizer_step(self, opt_index: int) -> None:
        rec = self.record
        if rec is None:
            return
        rec.stepped.add(opt_index)
        baseline = rec.baselines.pop(opt_index, None)
        if baseline is not None:
            self.measure_updates(rec, baseline)
        touched = rec.touched.pop(opt_index, None)
        if touched is not None and self.index is not None:
            tables = self.index.optimizer_tables(opt_index)
            changes = tensor_stats.touched_changes([self.index.tensor(t) for t in tables], touched)
            rec.table_updates.add(rec.measurements.add(changes), [tables[i] for i in touched.taken])

    def finish(self) -> StepRecord:
        """The end of a sampled step: gradients of tensors no optimizer stepped, and the change of the
        tensors no optimizer holds. The record stays armed until :meth:`detach`."""
        rec, index = self.record, self.index
        assert rec is not None and index is not None
        small = rec.small_grads               # copies made by gradient hooks during backward (slot -1)
        hooked = len(small)
        grads = [g for g, _ in small]
        shapes: list[tuple[int, ...]] = [g.shape for g in grads]
        kept: list[list[int]] = []
        outputs = rec.retained
        if outputs:
            # the outputs stay in rec.retained until the host copy has started (release_outputs)
            taken = list(map(_GRAD, outputs))
            arrived = [i for i, g in enumerate(taken) if g is not None]
            if len(arrived) == len(taken):
                grads += taken
                kept = rec.retained_sharing
                shapes += rec.retained_shapes   # the outputs', read by the hook (a torch.Size costs ~1 us)
            else:
                grads += [taken[i] for i in arrived]
                kept = [rec.retained_sharing[i] for i in arrived]
                shapes += [rec.retained_shapes[i] for i in arrived]
            rec.retained_sharing, rec.retained_shapes = [], []
        if grads:
            slot = rec.measurements.add(self._output_grad_norms(grads, shapes))
            if hooked:
                out_grads = rec.out_grads
                for mid, slots in out_grads.items():
                    out_grads[mid] = [TensorSlot(slot, s.pos) if s.slot == -1 else s for s in slots]
            if kept:
                rec.retained_norms = RetainedNorms(slot, hooked, kept)
            small.clear()
        gradient_tensors, measured = index.gradient_tensors(), rec.grads.ids()
        # every one measured at an optimizer step: the common case, in one C-level pass
        remaining = [] if measured.issuperset(gradient_tensors) else [t for t in gradient_tensors if t not in measured]
        if remaining:
            self.measure_grads(rec, remaining)
        computed = index.computed_tensors()
        if computed:                # no .grad of their own (reading it makes torch warn): their values alone
            rest = [t for t in computed if t not in rec.data]
            if rest:
                _add_per_tensor(rec, rest, tensor_stats.norms([index.tensor(t) for t in rest]), rec.data)
        if rec.orphan_baseline is not None:
            baseline, rec.orphan_baseline = rec.orphan_baseline, None
            self.measure_updates(rec, baseline)
        norms = index.running_stat_norms.intersection(rec.ran_training) if rec.stepped else None
        drops: Collection[int] | None = index.random_drops.intersection(rec.ran_training) if rec.stepped else None
        if drops:                  # those run in training mode under no_grad: a frozen teacher's targets, noisy
            drops = [m for m in drops if any(r.training and not r.grad_enabled for r in rec.rows.get(m, ()))]
        if norms or drops:
            sampled = frozen.sample_frozen_blocks(index, norms or (), drops or ())
            if sampled is not None:
                rec.frozen_blocks = frozen.FrozenBlockSample(rec.measurements.add(sampled[0]), sampled[1])
        return rec

    def _output_grad_norms(self, grads: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        """The norms of the step's small output gradients, with the plan of the last sampled step while
        their shapes are the same (the same calls in the same order: planning reads every gradient's
        device, dtype and size, several microseconds each)."""
        last = self._grad_plan
        if last is None or last[0] != shapes:
            last = self._grad_plan = (shapes, tensor_stats.plan_norms(grads, shapes))
        try:
            norms = tensor_stats.norms(grads, last[1])
        except RuntimeError:       # a gradient on another device than last step's: plan again
            last = self._grad_plan = (shapes, tensor_stats.plan_norms(grads, shapes))
            norms = tensor_stats.norms(grads, last[1])
        assert norms is not None
        return norms

    def measure_fingerprints(self, rec: StepRecord, index: ModelIndex) -> None:
        """At the step's first forward (after DDP has broadcast the buffers): a fingerprint of every
        parameter and buffer, and the data norm of the buffers (the parameters' comes at the optimizer step)."""
        tids = index.fingerprint_tensors()
        for group in _by_device(index, tids):
            _add_per_tensor(rec, group, tensor_stats.fingerprints([index.tensor(t) for t in group]),
                            rec.fingerprints)
        buffers = [t for t in tids if index.tensors[t].kind == TensorKind.BUFFER]
        if buffers:
            _add_per_tensor(rec, buffers, tensor_stats.norms([index.tensor(t) for t in buffers]), rec.data)

    def measure_grads(self, rec: StepRecord, tensor_ids: list[int], known: IndexTensors | None = None) -> None:
        """Gradient and data norms of the tensors not measured yet this step; ``known``: the tensors of
        ``tensor_ids`` when it is one of the index's own lists (:meth:`_tensors_of`)."""
        index = self.index
        assert index is not None
        if known is not None and not any(t in rec.grads or t in rec.data for t in tensor_ids):
            current = [p.grad for p in known.tensors]
            complete = not any(g is None or g.is_sparse for g in current)     # all there: their parameters' plan
            try:
                grad_norms = tensor_stats.norms(current, known.plan) if complete else None  # type: ignore[arg-type]
                data_norms = tensor_stats.norms(known.tensors, known.plan)
            except RuntimeError:       # a shape changed in place (p.data = a tensor of another shape): plan again
                self._index_tensors.pop(id(tensor_ids), None)
            else:
                if complete:
                    _add_per_tensor(rec, tensor_ids, grad_norms, rec.grads)
                else:
                    with_grad = [t for t, g in zip(tensor_ids, current, strict=True)
                                 if g is not None and not g.is_sparse]
                    if with_grad:
                        _add_per_tensor(rec, with_grad, tensor_stats.norms(
                            [g for g in current if g is not None and not g.is_sparse]), rec.grads)
                _add_per_tensor(rec, tensor_ids, data_norms, rec.data)
                return
        have = [t for t in tensor_ids if t not in rec.grads]
        grads = {t: index.grad(t) for t in have}
        with_grad = [t for t in have if grads[t] is not None]
        if with_grad:
            _add_per_tensor(rec, with_grad, tensor_stats.norms([grads[t] for t in with_grad]),  # type: ignore[misc]
                            rec.grads)
        rest = [t for t in have if t not in rec.data]
        if rest:
            _add_per_tensor(rec, rest, tensor_stats.norms([index.tensor(t) for t in rest]), rec.data)

    def measure_updates(self, rec: StepRecord, baseline: UpdateBaseline) -> None:
        """Sampled change across the step, plus the data norm after it (which catches a change the
        sample missed)."""
        index = self.index
        assert index is not None
        tids = baseline.tensor_ids
        known = self._index_tensors.get(id(tids))
        after = known.tensors if known is not None and known.ids is tids else [index.tensor(t) for t in tids]
        vec = self.updates.delta_norms(after, baseline.taken)
        if vec is None:
            return
        rec.updates.add(rec.measurements.add(vec), tids)
        if tensors.reads_free(vec.device):
            # reading it costs no sync: the full-tensor check only where the sample saw no change
            check = torch.nonzero(vec == 0).flatten().tolist()
        else:
            check = list(range(len(tids)))
        if check:
            post = tensor_stats.norms([after[pos] for pos in check])
            assert post is not None
            rec.post.add(rec.measurements.add(post), [tids[pos] for pos in check])


def _group_lr(rec: StepRecord, lr: object) -> float | TensorSlot | None:
    """A param group's learning rate as a number, or, when it is a tensor on a device whose reads cost a sync, a
    copy of it added to the step's measurements (a scheduler may change it in place before the copy starts)."""
    if isinstance(lr, torch.Tensor) and lr.numel() == 1 and not tensors.reads_free(lr.device):
        return TensorSlot(rec.measurements.add(lr.detach().reshape(1).float().clone()), 0)
    return tensors.host_number(lr)


def _by_device(index: ModelIndex, tensor_ids: list[int]) -> list[list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for tid in tensor_ids:
        groups.setdefault(index.tensor(tid).device, []).append(tid)
    return list(groups.values())


def _add_per_tensor(rec: StepRecord, tensor_ids: list[int], vec: torch.Tensor | None, into: PerTensor) -> None:
    """One device vector with a value per tensor: where each tensor's value will be."""
    assert vec is not None
    into.add(rec.measurements.add(vec), tensor_ids)
