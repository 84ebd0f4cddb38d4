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
import functools
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..model import tensors
from ..model.index import ModelIndex
from ..model.runtime import RuntimeModules
from ..model.structure import CompiledModules, ModuleNode, unit_dim
from . import batch, measure, tensor_stats
from .eager import EagerScope, hide_global_hook_warning, restore_warning_filters
from .guard import ProbeRuntime, call_guarded
from .hooks import hold
from .optimizer_step import OptimizerStepMeasure
from .record import (
    MAX_CALLS_MEASURED,
    CallRecord,
    GradHookDict,
    OutputKey,
    PerTensor,
    StepRecord,
    TensorSlot,
    UpdateBaseline,
    release_outputs,
)
from .step_end import StepEnd

__all__ = ["MAX_CALLS_MEASURED", "CallRecord", "PerTensor", "StepCapture", "StepRecord", "TensorSlot", "UpdateBaseline",
           "hide_global_hook_warning", "release_outputs", "restore_warning_filters"]

_GRAD = operator.attrgetter("grad")
_PLAIN_LEAVES = (torch.Tensor, nn.Parameter)     # no __torch_function__ of their own: register_hook's fast case
_GRAD_HOOK_KEY = -0x6D73       # our key in a tensor's hook dict (torch's handle ids count up from 0: no clash)


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
        self.eager = EagerScope()                # a compiled model's sampled steps run eagerly
        self.optimizer_step = OptimizerStepMeasure()
        self._unit_dims: dict[tuple[int, int], int] = {}      # (module id, output ndim) -> its unit dimension
        # (module id, shape, dtype, device) of a small output -> its layout, from one table of interned layouts
        self._small_layouts: dict[tuple[int, tuple[int, ...], torch.dtype, torch.device], batch.SmallLayout] = {}
        self._layouts = batch.SmallLayouts()
        # _gradient_hooks(): per index, each trainable leaf and the hook dict it gets
        self._grad_hooks: tuple[ModelIndex, list[tuple[torch.Tensor, Callable[[torch.Tensor], Any],
                                                       GradHookDict | None]]] | None = None
        self._top_level: tuple[ModelIndex, list[nn.Module]] | None = None    # arm()'s modules, per index
        # the shapes of the last sampled step's small output gradients and the plan of their norms
        self.step_end = StepEnd()
        # small outputs are referenced, not copied, unless their module's output is changed in place
        # later in the step (learnt on the first sampled step, which copies all: probes.capture.batch)
        self._learning = True
        self._copy_outputs: set[int] = set()

    def learn_in_place(self, changed: set[Any]) -> None:
        """After a sampled step's fetch started: the modules whose small outputs changed after their hook."""
        self._learning = False
        self._copy_outputs |= {k[0] if isinstance(k, tuple) else k for k in changed}     # a later call's: (id, n)

    def clear(self) -> None:
        """Drop cached views of the model's tensors and what was learnt of its modules (the index is being
        rebuilt or the watcher closes)."""
        self.optimizer_step.clear()
        self._unit_dims.clear()
        self._small_layouts.clear()
        self._layouts.clear()
        self.step_end.clear()
        self._grad_hooks, self._top_level = None, None

    def close(self) -> None:
        self.closed = True
        self.detach()
        self.probe.gc.resume()
        self.clear()
        self.index = None
        self.eager.reset()

    def _output_grad_hook(self, rec: StepRecord, targets: list[int]) -> Callable[[torch.Tensor], None]:
        hook = functools.partial(self.on_output_grad, rec, targets)
        return self.eager.wrap(hook) if self.eager.compiled else hook

    # ====================================================================== arming and detaching
    def arm(self, index: ModelIndex) -> None:
        """Prepare a sampled step: only forward pre-hooks on the root and its children, which attach the
        real hooks at the first forward of the step. Between steps (and so around other models'
        forwards) no global hook exists."""
        if index is not self.index:          # a module id may now name another module (a head swapped)
            self.optimizer_step.forget_index()
            self._unit_dims.clear()
            self._small_layouts.clear()
            self._layouts.clear()
            self._grad_hooks = None
        self.index = index
        rec = self.record = StepRecord(index=index)
        self.eager.enter()
        trigger = self.eager.wrap(self.on_trigger)
        if self._top_level is None or self._top_level[0] is not index:
            # a TorchScript module refuses per-module hooks; the global hooks still see its calls
            self._top_level = (index, [m for m in index.top_level_modules()
                                       if not isinstance(m, torch.jit.ScriptModule)])
        for module in self._top_level[1]:
            rec.hooks.handles.append(hold(module.register_forward_pre_hook, trigger))

    def detach(self) -> StepRecord | None:
        """Remove every hook of the step; returns what it gathered."""
        rec, self.record = self.record, None
        if rec is not None:
            hooks = rec.hooks
            self.eager.leave(ran_compiled=not hooks.live and rec.optimizer_stepped)
            for h in hooks.handles:
                h.remove()
            hooks.handles.clear()
            for tensor, own in hooks.own_hook_dicts:
                if tensor._backward_hooks is own:
                    if len(own) == 1:
                        tensor._backward_hooks = None
                    else:                      # the user added a hook to it meanwhile: the dict is theirs now
                        del own[_GRAD_HOOK_KEY]
                        self._grad_hooks = None
            hooks.own_hook_dicts.clear()
            for t in hooks.hooked:
                # an emptied hook dict still leaves autograd a (Python) pre-hook to call on every backward:
                # a tensor that had no hooks before gets none back, and its fast path with it
                if t._backward_hooks is not None and not t._backward_hooks:
                    t._backward_hooks = None
            hooks.hooked.clear()
            release_outputs(rec)
        return rec

    def set_compiled(self, found: CompiledModules) -> None:
        """What torch.compile put in the model, at each index build (:meth:`EagerScope.set_compiled`)."""
        self.eager.set_compiled(found)
        self._grad_hooks = None                 # their hooks are wrapped for compiled models (EagerScope.wrap)

    def on_trigger(self, module: nn.Module, args: Any) -> None:
        rec, index = self.record, self.index
        if rec is None or index is None or self.closed or rec.hooks.live or measure.is_compiling():
            return
        with self.probe.guard("attach"):
            self.probe.gc.pause()              # until the end of the step's finishing work
            hooks = rec.hooks
            for h in hooks.handles:
                h.remove()
            hooks.handles.clear()
            hooks.live = True
            mod = torch.nn.modules.module
            hooks.handles.append(mod.register_module_forward_pre_hook(self.eager.wrap(self.on_pre_forward)))
            hooks.handles.append(mod.register_module_forward_hook(self.eager.wrap(self.on_forward)))
            self.eager.global_hooks_attached()
            own = hooks.own_hook_dicts
            for tensor, hook, hook_dict in self._gradient_hooks(index):
                if not tensor.requires_grad:
                    continue                   # frozen since the index was built (rebuilt after this sample)
                if hook_dict is not None and tensor._backward_hooks is None:
                    # what Tensor.register_hook does for a leaf without hooks, without making a handle and a
                    # dict each time (most of its cost, paid for every parameter); detach() sets None back
                    tensor._backward_hooks = hook_dict
                    own.append((tensor, hook_dict))
                else:
                    if tensor._backward_hooks is None:
                        hooks.hooked.append(tensor)
                    hooks.handles.append(tensor.register_hook(hook))
            if self.replicas:
                self.optimizer_step.measure_fingerprints(rec, index)
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
            hook = self.eager.wrap(functools.partial(self.on_grad, t.param_id))
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
        call_guarded(self.probe, "forward-pre-hook", self._pre_forward, rec, index, module)

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
        call_guarded(self.probe, "forward-hook", self._forward, rec, index, module, output)

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
            _note_mode(rec, mid, training)
        if n >= MAX_CALLS_MEASURED:
            return
        others: list[torch.Tensor]
        x: torch.Tensor | None
        if type(output) is torch.Tensor and output.dtype in measure.FLOAT_TYPES and output.numel():
            x, others = output, []             # the common case, without walking a structure
        else:
            tensors = measure.float_tensors(output)
            x = measure.primary(tensors)
            if x is None:
                return
            others = [t for t in tensors if t is not x]
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
        # whose unit activity the call extends: a module's own, or for the later calls of a module called several
        # times a step (one ReLU after a block's first conv and again after its residual add) that call's own
        site: int | tuple[int, int] = mid if n == 0 else (mid, n)
        if numel <= batch.SMALL_OUTPUT and not others and version >= 0:
            slot, per_unit = self._measure_small(rec, index, module, mid, x, key, site)
        else:
            udim = self._unit_dim(mid, module, x.dim())
            chunk, layout = measure.call_chunk(x, others, udim, index.saturation.get(mid))
            slot = rec.measurements.add_call(chunk, layout, site)
            per_unit = numel // layout.units if layout.track and layout.units else 0
        rec.measured[key] = (slot, weakref.ref(x), per_unit)
        rec.rows.setdefault(mid, []).append(CallRecord(slot, rec.order, training, grad_on, numel, per_unit))
        if grad_on and x.requires_grad:
            self._hook_output_grad(rec, mid, x, key, numel)

    def _measure_small(self, rec: StepRecord, index: ModelIndex, module: nn.Module, mid: int, x: torch.Tensor,
                       key: OutputKey, site: int | tuple[int, int]) -> tuple[int, int]:
        """A small output, kept (or copied) now and reduced with the step's other small outputs at its end (one
        batch of kernels); returns its slot and the values per unit. ``site``: whose unit activity it extends."""
        shape, dtype, device = key[3], x.dtype, x.device
        small = self._small_layouts.get((mid, shape, dtype, device))
        if small is None:
            small = self._small_layouts[(mid, shape, dtype, device)] = self._layouts.get(
                shape, dtype, device, self._unit_dim(mid, module, len(shape)), index.saturation.get(mid))
        per_unit = x.numel() // small.units if small.track and small.units else 0
        if self._learning:
            slot = rec.measurements.add_kept(batch.keep(x, small, copy=True, watch=True, version=key[1]), site)
        elif mid in self._copy_outputs:
            slot = rec.measurements.add_kept(batch.keep(x, small, copy=True, watch=False, version=key[1]), site)
        else:
            slot = rec.measurements.add_small(x, small, x, key[1], site)      # batch.keep without a copy
        return slot, per_unit

    def _hook_output_grad(self, rec: StepRecord, mid: int, x: torch.Tensor, key: OutputKey, numel: int) -> None:
        """The gradient of a measured output that requires one: kept by autograd, or hooked."""
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
                call_guarded(self.probe, "grad-hook", self._on_grad_again, rec, index, tensor_id)
            return
        if not self.replicas:
            # the common case, which cannot fail: no gradient was there before this one (no guard: it is
            # most of this hook's cost, paid for every parameter)
            node = index.tensors.get(tensor_id)
            if node is None or node.tensor is None or node.tensor.grad is None:
                rec.arrived.add(tensor_id)
                return
        call_guarded(self.probe, "grad-hook", self._on_grad, rec, index, tensor_id, grad)

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
    # ====================================================================== optimizer steps
    def before_optimizer_step(self, opt_index: int, optimizer: torch.optim.Optimizer) -> None:
        rec, index = self.record, self.index
        if rec is not None and index is not None:
            self.optimizer_step.before(rec, index, opt_index, optimizer)

    def after_optimizer_step(self, opt_index: int) -> None:
        rec, index = self.record, self.index
        if rec is not None and index is not None:
            self.optimizer_step.after(rec, index, opt_index)

    def finish(self) -> StepRecord:
        """The end of a sampled step (:meth:`StepEnd.finish`). The record stays armed until :meth:`detach`."""
        rec, index = self.record, self.index
        assert rec is not None and index is not None
        return self.step_end.finish(rec, index, self.optimizer_step)


def _note_mode(rec: StepRecord, mid: int, training: bool) -> None:
    """The modes a mode-relevant module ran in. A call out of step with the model stays the step's mode: a validation
    pass that left a module in training mode, followed by the next training forward before the optimizer step, must
    not hide it. Without the model's mode, the own flag still tells a frozen BatchNorm that updates its statistics."""
    mode = rec.modes.get(mid)
    if mode is None or mode[1] is None or mode[0] == mode[1]:
        rec.modes[mid] = (training, rec.root_training)
    if training:
        rec.ran_training.add(mid)
    if training == rec.root_training:
        rec.agreed[mid] = rec.agreed.get(mid, 0) | (2 if training else 1)
