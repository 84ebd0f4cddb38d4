"""The loss of a script that never calls modscope (``modscope run``): what ``backward()`` ran on.

Installed by :mod:`probes.launch.autowatch` in the zero-code process only, and removed when it closes:
``torch.autograd.backward`` (which ``Tensor.backward`` calls) is wrapped, the same call and result, to note
every scalar floating-point tensor a backward started from. A watcher's step takes what was noted since the
last step (:meth:`BackwardLosses.take`): the loss of that step, or the sum of several (gradient accumulation:
the objective whose accumulated gradient the optimizer steps on; a GAN's models each take their own, as each
model's optimizer steps right after its backward). Inside an optimizer's ``step(closure)`` only the closure's
first evaluation counts (LBFGS evaluates it several times: the first is the loss before the step). A loss that
``GradScaler.scale`` multiplied (mixed precision) is noted unscaled. Values stay on their device (summed
there): the watcher reads them with its other values, never with a sync of its own.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["BackwardLosses"]

MAX_NOTED = 1024        # losses kept until a step takes them (a script whose optimizer nobody watches yet)


class BackwardLosses:
    """The losses backward() ran on since the last :meth:`take`; :meth:`install` / :meth:`remove`."""

    def __init__(self) -> None:
        self._noted: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._original_backward: Any = None
        self._original_scale: Any = None
        self._handles: list[RemovableHandle] = []
        self._in_step = 0                 # optimizer steps in progress (a closure evaluates inside one)
        self._noted_in_step = False       # a closure's first evaluation was noted
        self._scaled: tuple[weakref.ref[torch.Tensor], torch.Tensor] | None = None   # GradScaler: scaled -> loss

    # -- installing -----------------------------------------------------------------------------------
    def install(self) -> BackwardLosses:
        if self._original_backward is not None:
            return self
        original = self._original_backward = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(tensors, *args, **kwargs)
            self._note(tensors)
            return out

        setattr(torch.autograd, "backward", backward)              # noqa: B010
        scaler = getattr(torch.amp, "GradScaler", None)
        if scaler is not None and "scale" in vars(scaler):
            self._original_scale = vars(scaler)["scale"]
            setattr(scaler, "scale", self._scale_wrapper(self._original_scale))   # noqa: B010 (a method of the class)
        self._handles = [register_optimizer_step_pre_hook(self._step_begins),
                         register_optimizer_step_post_hook(self._step_ends)]
        return self

    def remove(self) -> None:
        """Put back what :meth:`install` replaced (unless something replaced it again since) and drop the hooks."""
        original, self._original_backward = self._original_backward, None
        if original is not None and getattr(torch.autograd.backward, "__wrapped__", None) is original:
            setattr(torch.autograd, "backward", original)          # noqa: B010
        scale, self._original_scale = self._original_scale, None
        if scale is not None and getattr(vars(torch.amp.GradScaler).get("scale"), "__wrapped__", None) is scale:
            setattr(torch.amp.GradScaler, "scale", scale)          # noqa: B010
        for h in self._handles:
            h.remove()
        self._handles = []
        self.discard()

    def _scale_wrapper(self, original: Any) -> Any:
        @functools.wraps(original)
        def scale(scaler: Any, outputs: Any) -> Any:
            out = original(scaler, outputs)
            if isinstance(outputs, torch.Tensor) and isinstance(out, torch.Tensor):
                self._scaled = (weakref.ref(out), outputs)
            return out
        return scale

    # -- noting ---------------------------------------------------------------------------------------------
    def _step_begins(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_step += 1
        if self._in_step == 1:
            self._noted_in_step = False

    def _step_ends(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_step = max(0, self._in_step - 1)

    def _note(self, tensors: Any) -> None:
        try:
            items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            losses = [self._unscaled(t).detach().reshape(()) for t in items
                      if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()]
        except Exception:          # never in the way of the script's backward
            return
        if not losses:
            return
        if self._in_step:
            if self._noted_in_step:
                return             # the closure evaluated again within the step
            self._noted_in_step = True
        with self._lock:
            self._noted.extend(losses)
            del self._noted[:-MAX_NOTED]

    def _unscaled(self, t: torch.Tensor) -> torch.Tensor:
        scaled = self._scaled
        if scaled is not None and scaled[0]() is t:
            return scaled[1]
        return t

    # -- taking ---------------------------------------------------------------------------------------------
    def take(self) -> torch.Tensor | None:
        """The sum of the losses noted since the last take (on their device), or None."""
        with self._lock:
            noted, self._noted = self._noted, []
        if not noted:
            return None
        if len(noted) == 1:
            return noted[0]
        try:
            return torch.stack([t.to(noted[0].device, torch.float32) for t in noted]).sum()
        except RuntimeError:
            return None

    def discard(self) -> None:
        """Forget what was noted: it belonged to the step of an optimizer no watcher records a loss for."""
        with self._lock:
            self._noted = []
        self._scaled = None
