"""modscope in an ``accelerate`` loop: ``w = watch(accelerator, model, optimizer)`` after ``prepare``.

    from probes.integrations.accelerate import watch
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with watch(accelerator, model, optimizer, run_dir="runs/exp1") as w:    # prints: modscope: watching ...
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(x), y); accelerator.backward(loss)
                optimizer.step(); optimizer.zero_grad()

How it sits under accelerate's step machinery (``boundaries="external"``):

- The model may come wrapped by ``prepare`` (DDP, ``torch.compile``): the Watcher sees through DDP, FSDP
  and compile wrappers (paths are the user's, no ``module.`` or ``_orig_mod.``); other wrappers
  (DeepSpeed's engine) are peeled with ``accelerator.unwrap_model``.
- Gradients are final at the step pre-hook of the torch optimizer inside accelerate's
  ``AcceleratedOptimizer`` (``.optimizer``): accelerate calls it only on the micro-batch that steps
  (``accelerator.sync_gradients``), after ``scaler.step`` unscaled the gradients. Gradient norms are of
  the accumulated, synced, unscaled gradients, clipped when ``accelerator.clip_grad_norm_`` ran.
- A step ends when ``AcceleratedOptimizer.step()`` returns on a micro-batch that syncs gradients
  (every watched optimizer's, with several): micro-batches of accumulation are not steps, and a step a
  GradScaler skipped is one (no update is expected of it; a fused optimizer, which the scaler calls
  even then, is told by the scaler's ``found_inf``: one host read per step in that setup).
- The loss: the mean of what the loop passed to ``accelerator.backward`` for the step's micro-batches
  (before accelerate divides it by the accumulation count), with no change to the loop.
- ``watch`` wraps that accelerator's ``backward`` and the ``AcceleratedOptimizer``'s ``step`` (the same
  calls, the same results) and hooks the torch optimizers; all of it comes off when the watcher closes.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from ..capture.hooks import HeldHook
from ..model.structure import unwrap
from . import LossMean, announce, guarded, require, scaler_skips

__all__ = ["watch"]

_accelerate = require("accelerate", "accelerate helper", "accelerate", "accelerate")


def watch(accelerator: Any, model: nn.Module, optimizer: Any = None, **watch_kwargs: Any) -> Any:
    """:func:`probes.watch` for a model and optimizer(s) prepared by ``accelerator``; returns the
    :class:`probes.Watcher` (close it, or use it as a context manager). ``watch_kwargs`` are
    :func:`probes.watch`'s (``run_dir``, ``every``, ``overhead``, ``window``, ``run_name``)."""
    import probes

    if not isinstance(accelerator, _accelerate.Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__qualname__}: "
                        f"{accelerator!r:.80}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__qualname__}: {model!r:.80}")
    if "boundaries" in watch_kwargs:
        raise TypeError(f"boundaries={watch_kwargs['boundaries']!r}: probes.integrations.accelerate.watch sets "
                        "the step boundaries itself (accelerate's optimizer step)")
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [] if optimizer is None else [optimizer]
    inner = [_torch_optimizer(o) for o in given]
    target = model
    try:
        user = accelerator.unwrap_model(model, keep_torch_compile=False)
    except TypeError:                     # accelerate < 1.3: unwrap_model always unwraps torch.compile
        user = accelerator.unwrap_model(model)
    if unwrap(model) is not user:
        target = user                     # a wrapper the Watcher does not know (DeepSpeed's engine)
    w = probes.watch(target, inner if len(inner) > 1 else (inner[0] if inner else None),
                     boundaries="external" if inner else "optimizer", **watch_kwargs)
    if inner:
        _Steps(accelerator, w, given, inner).attach()
    if accelerator.is_main_process:
        announce(user, w.run_dir, 0)
    return w


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside an AcceleratedOptimizer; anything else as it is (probes.watch checks it)."""
    if isinstance(optimizer, _accelerate.optimizer.AcceleratedOptimizer):
        return optimizer.optimizer
    return optimizer


class _Steps:
    """accelerate's step machinery, told to the Watcher (``boundaries="external"``):

    - gradients are final at the torch optimizer's step pre-hook: accelerate calls it only on the
      micro-batch that steps (``sync_gradients``), after ``scaler.step`` unscaled them; a fused optimizer
      that a GradScaler calls on a step it skips (``found_inf``) has no final gradients;
    - a step ends when every watched optimizer's ``AcceleratedOptimizer.step()`` returned on a micro-batch
      that syncs gradients, whether the GradScaler skipped the step or not (a plain torch optimizer: at its
      step post-hook);
    - the loss: the mean of what the loop passed to ``accelerator.backward`` since the last step.

    The wrappers (``accelerator.backward``, ``AcceleratedOptimizer.step``: the same calls) and the hooks
    come off when the watcher closes (``Watcher.on_close``). Holds the watcher and the
    accelerator weakly."""

    def __init__(self, accelerator: Any, watcher: Any, given: list[Any], inner: list[Any]) -> None:
        self._accelerator = weakref.ref(accelerator)
        self._watcher = weakref.ref(watcher)
        self._given, self._inner = given, inner
        self._losses = LossMean()
        self._stepped: set[int] = set()
        self._handles: list[Any] = []
        self._wrapped: list[tuple[Any, str, Any]] = []      # (object, attribute, our wrapper)

    def attach(self) -> None:
        acc, w = self._accelerator(), self._watcher()
        if acc is None or w is None:
            return
        self._wrap(acc, "backward", self._note_loss)
        for i, (outer, opt) in enumerate(zip(self._given, self._inner, strict=True)):
            self._handles.append(opt.register_step_pre_hook(HeldHook(functools.partial(self._gradients_final, i))))
            if outer is not opt:
                self._wrap(outer, "step", functools.partial(self._after_step, i), after=True)
            else:
                self._handles.append(opt.register_step_post_hook(
                    HeldHook(lambda o, a, k, i=i: self._optimizer_done(i))))
        w.on_close(self.detach)                 # with, close() and the atexit closer all run it

    def _wrap(self, obj: Any, name: str, hook: Any, after: bool = False) -> None:
        original = getattr(obj, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not after:
                hook(*args, **kwargs)
            out = original(*args, **kwargs)
            if after:
                hook()
            return out

        setattr(obj, name, wrapper)
        self._wrapped.append((obj, name, wrapper))

    @guarded
    def _note_loss(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(loss, torch.Tensor):
            self._losses.add(loss)

    @guarded
    def _gradients_final(self, index: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        w = self._watcher()
        if w is not None and not scaler_skips(optimizer):
            w.begin_optimizer_step(index)

    @guarded
    def _after_step(self, index: int) -> None:
        acc = self._accelerator()
        if acc is not None and acc.sync_gradients:     # a micro-batch of accumulation: step() did nothing
            self._optimizer_done(index)

    @guarded
    def _optimizer_done(self, index: int) -> None:
        w = self._watcher()
        if w is None:
            return
        if index in self._stepped:                     # it steps again: the step ended without the others
            self._end(w)
        self._stepped.add(index)
        if len(self._stepped) == len(self._inner):
            self._end(w)

    def _end(self, w: Any) -> None:
        self._stepped.clear()
        w.end_step(self._losses.mean())

    @guarded
    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for obj, name, wrapper in self._wrapped:
            if vars(obj).get(name) is wrapper:
                delattr(obj, name)                     # the class's method again
        self._wrapped.clear()
