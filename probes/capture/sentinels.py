"""Sentinels: the few checks cheap enough to run on every step, sampled or not.

A forward pre-hook and post-hook on the model the user calls (the outermost module: a DDP or compiled
wrapper runs them eagerly, outside its graph) note, at each forward of the model, its training flag and
the grad mode. That is all it takes to see validation run in train mode, evaluation that builds autograd
graphs for nothing, and training steps taken in eval mode, whichever step they fall on. Only the root
gets hooks: every other module keeps PyTorch's no-hook fast path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import measure
from .guard import ProbeRuntime
from .hooks import HeldHandle, hold


@dataclasses.dataclass
class EvalGraphForward:
    """A forward in eval mode with gradients enabled: was its output backpropagated?"""

    numel: int
    backpropagated: bool = False
    # normalization layers ran in training mode in it: set so after model.eval() on purpose (test-time adaptation
    # trains them with the model in eval), not a step trained in eval mode
    norms_training: bool = False


@dataclasses.dataclass
class ForwardLog:
    """The model's forwards since the last step boundary."""

    train_forwards: int = 0                  # training mode, gradients enabled: ordinary training
    nograd_train_forwards: int = 0           # training mode under no_grad/inference_mode
    nograd_train_modules: list[str] = dataclasses.field(default_factory=list)
    inference_mode: bool = False
    nograd_eval_forwards: int = 0            # eval mode under no_grad: proper evaluation
    statistics_passes: int = 0               # training mode under no_grad to recompute BatchNorm statistics
    last_nograd_training: bool | None = None  # the mode of the last no_grad forward
    eval_graph: list[EvalGraphForward] = dataclasses.field(default_factory=list)

    def empty(self) -> bool:
        return not (self.train_forwards or self.nograd_train_forwards or self.nograd_eval_forwards or self.eval_graph)


class RootSentinel:
    """The hooks on the model the user calls; ``take()`` hands over what they saw and starts afresh.

    A training loop that never calls the model itself (``model.encoder(x)`` then ``model.decoder(z)``; a
    Lightning ``training_step`` calling submodules; a GAN's ``nn.ModuleDict``) shows nothing to those hooks: after a
    step without a forward of the model, :meth:`watch_parts` puts the same hooks on the model's children, which then
    count their calls from outside the model's forward, each with its own training flag."""

    def __init__(self, probe: ProbeRuntime) -> None:
        self.probe = probe
        self.log = ForwardLog()
        self._mode_sensitive: Sequence[tuple[str, nn.Module]] = ()     # Dropout/BatchNorm-like, with paths
        self._handles: list[HeldHandle] = []
        self._part_handles: list[HeldHandle] = []
        self._root: nn.Module | None = None
        self._depth = 0                              # forwards of the model in progress (its parts' calls are in it)
        self._part_depth = 0                         # calls of its children in progress, outside its forward
        self._parts: dict[int, Sequence[tuple[str, nn.Module]]] = {}      # id(part) -> its mode-sensitive modules
        # id() of every parameter the watched optimizers hold (set before mode_sensitive), and the parts that hold
        # none: a frozen or EMA teacher, a frozen text encoder, whose forwards are no training or evaluation pass
        self.optimized: frozenset[int] = frozenset()
        self._untrained: set[int] = set()

    @property
    def mode_sensitive(self) -> Sequence[tuple[str, nn.Module]]:
        return self._mode_sensitive

    @mode_sensitive.setter
    def mode_sensitive(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self._mode_sensitive = modules
        if self._parts and self._root is not None:
            self._parts = self._parts_of(self._root)

    @property
    def parts_watched(self) -> bool:
        return bool(self._part_handles)

    def attach(self, outermost: nn.Module, root: nn.Module) -> None:
        """Hooks on ``outermost`` (what the user calls); the mode is read from ``root`` (the model inside any
        wrapper: ``model.eval()`` may have been called on it rather than on the wrapper)."""
        self._root = root
        self._handles.append(hold(outermost.register_forward_pre_hook, self.on_pre_forward))
        self._handles.append(hold(outermost.register_forward_hook, self.on_forward))

    def watch_parts(self) -> None:
        """Hooks on the model's children too (idempotent): the loop calls them, not the model."""
        root = self._root
        if root is None or self._part_handles:
            return
        self._parts = self._parts_of(root)
        for child in root.children():
            self._part_handles.append(hold(child.register_forward_pre_hook, self.on_part_pre_forward))
            self._part_handles.append(hold(child.register_forward_hook, self.on_part_forward))

    def _parts_of(self, root: nn.Module) -> dict[int, Sequence[tuple[str, nn.Module]]]:
        out: dict[int, Sequence[tuple[str, nn.Module]]] = {}
        self._untrained = set()
        for child in root.children():
            inside = {id(m) for m in child.modules()}
            out[id(child)] = [(path, m) for path, m in self._mode_sensitive if id(m) in inside]
            if self.optimized and not any(id(p) in self.optimized for p in child.parameters()):
                self._untrained.add(id(child))
        return out

    def _untrained_part(self, part: nn.Module) -> bool:
        """A part no watched optimizer trains (without optimizers: none of whose parameters requires grad)."""
        if self.optimized:
            return id(part) in self._untrained
        return not any(p.requires_grad for p in part.parameters())

    def detach(self) -> None:
        for h in [*self._handles, *self._part_handles]:
            h.remove()
        self._handles.clear()
        self._part_handles.clear()
        self._mode_sensitive = ()
        self._parts = {}
        self._root = None

    def take(self) -> ForwardLog:
        log, self.log = self.log, ForwardLog()
        self._depth = self._part_depth = 0           # a forward that raised never ran its post-hook
        return log

    def on_pre_forward(self, module: nn.Module, args: Any) -> None:
        if measure.is_compiling():
            return
        self._depth += 1
        root = self._root if self._root is not None else module
        if torch.is_grad_enabled():
            if root.training:
                self.log.train_forwards += 1         # the common case: one flag read, one add
            return
        self._nograd_forward(root.training, self._mode_sensitive)

    def on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if measure.is_compiling():
            return
        self._depth = max(0, self._depth - 1)
        root = self._root if self._root is not None else module
        if root.training or not torch.is_grad_enabled():
            return
        self._eval_forward(output, self._mode_sensitive)

    def on_part_pre_forward(self, module: nn.Module, args: Any) -> None:
        """A child of the model called from outside the model's forward (and outside another child's: a shared
        embedding a decoder calls is in the decoder's forward): a forward of the model, in its mode."""
        if measure.is_compiling():
            return
        self._part_depth += 1
        if self._depth or self._part_depth > 1:
            return
        if torch.is_grad_enabled():
            if module.training:
                self.log.train_forwards += 1
            return
        if self._untrained_part(module):
            return                                   # a frozen or momentum teacher's targets, not an evaluation
        self._nograd_forward(module.training, self._parts.get(id(module), ()))

    def on_part_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if measure.is_compiling():
            return
        self._part_depth = max(0, self._part_depth - 1)
        if self._depth or self._part_depth or module.training or not torch.is_grad_enabled() \
                or self._untrained_part(module):
            return
        self._eval_forward(output, self._parts.get(id(module), ()))

    def _nograd_forward(self, training: bool, mode_sensitive: Sequence[tuple[str, nn.Module]]) -> None:
        with self.probe.guard("root-sentinel"):
            log = self.log
            log.last_nograd_training = training
            if not training:
                log.nograd_eval_forwards += 1
                return
            in_train = [(path, m) for path, m in mode_sensitive if m.training]
            if any(_recomputes_statistics(m) for _, m in in_train):
                log.statistics_passes += 1           # PreciseBN, swa_utils.update_bn: training mode on purpose
                return
            if in_train:
                log.nograd_train_forwards += 1
                log.inference_mode = log.inference_mode or torch.is_inference_mode_enabled()
                for path, _ in in_train:
                    if path not in log.nograd_train_modules:
                        log.nograd_train_modules.append(path)

    def _eval_forward(self, output: Any, mode_sensitive: Sequence[tuple[str, nn.Module]]) -> None:
        with self.probe.guard("root-sentinel"):
            x = measure.primary(measure.float_tensors(output))
            if x is None or not x.requires_grad:
                return
            norms = any(m.training and isinstance(m, nn.modules.batchnorm._NormBase) for _, m in mode_sensitive)
            seen = EvalGraphForward(int(x.numel()), norms_training=norms)
            self.log.eval_graph.append(seen)
            x.register_hook(functools.partial(_mark_backpropagated, seen))


def _recomputes_statistics(module: nn.Module) -> bool:
    """A BatchNorm set to recompute its statistics: ``momentum=None`` (a cumulative average: ``update_bn`` of SWA) or
    1.0 (each batch's own, averaged by the caller: fvcore's and detectron2's PreciseBN)."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats and \
        module.momentum in (None, 1.0)


def _mark_backpropagated(seen: EvalGraphForward, grad: torch.Tensor) -> None:
    seen.backpropagated = True
