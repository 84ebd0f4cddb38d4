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
from torch.utils.hooks import RemovableHandle

from . import measure
from .guard import ProbeRuntime


@dataclasses.dataclass
class EvalGraphForward:
    """A forward in eval mode with gradients enabled: was its output backpropagated?"""

    numel: int
    backpropagated: bool = False


@dataclasses.dataclass
class ForwardLog:
    """The model's forwards since the last step boundary."""

    train_forwards: int = 0                  # training mode, gradients enabled: ordinary training
    nograd_train_forwards: int = 0           # training mode under no_grad/inference_mode
    nograd_train_modules: list[str] = dataclasses.field(default_factory=list)
    inference_mode: bool = False
    nograd_eval_forwards: int = 0            # eval mode under no_grad: proper evaluation
    last_nograd_training: bool | None = None  # the mode of the last no_grad forward
    eval_graph: list[EvalGraphForward] = dataclasses.field(default_factory=list)

    def empty(self) -> bool:
        return not (self.train_forwards or self.nograd_train_forwards or self.nograd_eval_forwards or self.eval_graph)


class RootSentinel:
    """The hooks on the model the user calls; ``take()`` hands over what they saw and starts afresh."""

    def __init__(self, probe: ProbeRuntime) -> None:
        self.probe = probe
        self.log = ForwardLog()
        self.mode_sensitive: Sequence[tuple[str, nn.Module]] = ()     # Dropout/BatchNorm-like, with paths
        self._handles: list[RemovableHandle] = []
        self._root: nn.Module | None = None

    def attach(self, outermost: nn.Module, root: nn.Module) -> None:
        """Hooks on ``outermost`` (what the user calls); the mode is read from ``root`` (the model inside any
        wrapper: ``model.eval()`` may have been called on it rather than on the wrapper)."""
        self._root = root
        self._handles.append(outermost.register_forward_pre_hook(self.on_pre_forward))
        self._handles.append(outermost.register_forward_hook(self.on_forward))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.mode_sensitive = ()
        self._root = None

    def take(self) -> ForwardLog:
        log, self.log = self.log, ForwardLog()
        return log

    def on_pre_forward(self, module: nn.Module, args: Any) -> None:
        if measure.is_compiling():
            return
        root = self._root if self._root is not None else module
        if torch.is_grad_enabled():
            if root.training:
                self.log.train_forwards += 1         # the common case: one flag read, one add
            return
        with self.probe.guard("root-sentinel"):
            log = self.log
            log.last_nograd_training = root.training
            if not root.training:
                log.nograd_eval_forwards += 1
                return
            in_train = [path for path, m in self.mode_sensitive if m.training]
            if in_train:
                log.nograd_train_forwards += 1
                log.inference_mode = log.inference_mode or torch.is_inference_mode_enabled()
                for path in in_train:
                    if path not in log.nograd_train_modules:
                        log.nograd_train_modules.append(path)

    def on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if measure.is_compiling():
            return
        root = self._root if self._root is not None else module
        if root.training or not torch.is_grad_enabled():
            return
        with self.probe.guard("root-sentinel"):
            x = measure.primary(measure.float_tensors(output))
            if x is None or not x.requires_grad:
                return
            seen = EvalGraphForward(int(x.numel()))
            self.log.eval_graph.append(seen)
            x.register_hook(functools.partial(_mark_backpropagated, seen))


def _mark_backpropagated(seen: EvalGraphForward, grad: torch.Tensor) -> None:
    seen.backpropagated = True
