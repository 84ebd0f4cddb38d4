"""modscope in the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[ModscopeCallback()])``.

    from probes.integrations.transformers import ModscopeCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ModscopeCallback(run_dir="runs/exp1")])
    trainer.train()                                  # prints: modscope: watching GPT2LMHeadModel -> runs/exp1

How it sits under the Trainer's step machinery:

- The watch starts at ``on_train_begin``, after ``accelerator.prepare``: on the ``model`` the callbacks
  receive (the Trainer's ``self.model``, outside DDP wrappers; the Watcher sees through FSDP's), or, with
  ``torch_compile=True``, on the compile wrapper the Trainer calls (sampled steps then run eagerly),
  with the torch optimizer inside accelerate's ``AcceleratedOptimizer`` (``.optimizer``), and
  ``boundaries="external"``.
- The gradients are final at the torch optimizer's own step pre-hook: it runs inside
  ``optimizer.step()``, after ``on_pre_optimizer_step`` and after clipping and the GradScaler's unscale
  (``scaler.step`` unscales before it calls the optimizer; ``on_pre_optimizer_step`` itself still sees
  scaled gradients under fp16 when ``max_grad_norm`` is 0). Gradient norms are of the accumulated,
  synced, unscaled, clipped gradients. A step a GradScaler skips never calls the optimizer: no gradients
  are measured for it (they hold inf/NaN), and no update is expected of it.
- A fused optimizer (the Trainer's default ``adamw_torch_fused`` with torch >= 2.8) unscales and skips by
  itself: the GradScaler calls it on a skipped step too, with ``found_inf`` set, which the pre-hook reads
  (one host read per step, only in that setup) to treat the step as skipped. Without clipping
  (``max_grad_norm=0``) its gradients are still scaled when it is called: their norms are then stored
  multiplied by the loss scale.
- A step ends at ``on_step_end`` (once per optimizer step: micro-batches of gradient accumulation end at
  ``on_substep_end``). Its loss is what the Trainer itself adds up for its ``loss`` log: the sum of what
  ``training_step`` returned for the step's micro-batches (each divided by the accumulation count unless
  the model normalised by the number of items).
- The callbacks receive no Trainer, and the Trainer has no exception event: at ``on_train_begin`` the
  callback finds the Trainer that calls it (on the call stack) and wraps that instance's
  ``training_step`` (the same call, the same result), which gives the loss, and closes the watcher when
  an exception leaves it. The watcher closes at ``on_train_end``; an exception raised elsewhere (data
  loading, evaluation) closes it at interpreter exit, or call ``callback.close()``. The wrapper is
  removed when the watcher closes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..capture.hooks import HeldHook
from ..model.structure import compiled_modules, unwrap
from . import LossMean, WatchOptions, announce, calling_trainer, guarded, require, scaler_skips

__all__ = ["ModscopeCallback", "TrainerWatch"]

_transformers = require("transformers", "Trainer callback", "transformers", "transformers")
_TrainerCallback: Any = _transformers.TrainerCallback

def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's AcceleratedOptimizer (and any wrapper like it)."""
    seen = 0
    while not _is_torch_optimizer_step(optimizer) and hasattr(optimizer, "optimizer") and seen < 4:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def _is_torch_optimizer_step(optimizer: Any) -> bool:
    """An optimizer whose step() runs torch's step hooks (AcceleratedOptimizer subclasses Optimizer but
    never calls its __init__, so its own step() runs none)."""
    return isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "optimizer")


def _calling_trainer() -> Any:
    """The transformers.Trainer whose method (up the call stack) fired the current callback event."""
    found = calling_trainer()
    return found[1] if found is not None and found[0] == "transformers" else None


def _called_model(model: Any, trainer: Any) -> Any:
    """What the Trainer calls, when it is ``model`` compiled (``torch_compile=True``): the watcher must see the
    compile wrapper to run its sampled steps eagerly rather than inside the compiled graph. Other wrappers
    (DDP) stay outside: the callbacks' ``model`` is watched as it always was."""
    wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
    if isinstance(wrapped, torch.nn.Module) and wrapped is not model and unwrap(wrapped) is model \
            and compiled_modules(wrapped).wrappers:
        return wrapped
    return model


class TrainerWatch:
    """What the callback does, free of the Trainer's classes: the callback is a thin adapter over it."""

    def __init__(self, options: WatchOptions) -> None:
        self.options = options
        self.watcher: Any = None            # probes.Watcher, once training started
        self._losses = LossMean()
        self._trainer: Any = None
        self._wrapper: Any = None
        self._pre_hook: Any = None
        self.model_name = "model"
        self.gave_up = False                # a start failed: not again at every step

    @guarded
    def start(self, model: Any, optimizer: Any, trainer: Any) -> None:
        """``on_train_begin``: watch ``model`` with the torch optimizer inside ``optimizer``."""
        import probes

        self.close()                        # an earlier train()'s watcher
        self.gave_up = True                 # until the watch below is made
        if model is None:
            return
        self.model_name = type(unwrap(model)).__name__
        inner = _torch_optimizer(optimizer) if optimizer is not None else None
        if inner is not None and not isinstance(inner, torch.optim.Optimizer):
            inner = None                    # DeepSpeed's engine steps by itself: no torch optimizer to watch
        self._losses = LossMean()
        model = _called_model(model, trainer)
        w = self.watcher = probes.watch(model, inner, boundaries="external", **self.options.kwargs())
        if inner is not None:
            self._pre_hook = inner.register_step_pre_hook(HeldHook(functools.partial(_gradients_final, w)))
        if trainer is not None:
            self._wrap_training_step(trainer)
        self.gave_up = False
        announce(unwrap(model), w.run_dir, w.rank)

    @guarded
    def step_end(self) -> None:
        """``on_step_end``: one optimizer step (or one a GradScaler skipped) is over."""
        if self.watcher is not None:
            self.watcher.end_step(self._losses.total())

    @guarded
    def close(self) -> None:
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        trainer, wrapper = self._trainer, self._wrapper
        self._trainer = self._wrapper = None
        if trainer is not None and vars(trainer).get("training_step") is wrapper:
            del trainer.training_step       # the class's method again
        if self.watcher is not None:
            self.watcher.close()            # idempotent; the watcher stays readable

    def _wrap_training_step(self, trainer: Any) -> None:
        original = trainer.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                loss = original(*args, **kwargs)
            except BaseException:
                self.close()                # the Trainer has no exception event
                raise
            if isinstance(loss, torch.Tensor):
                self._losses.add(loss)
            return loss

        trainer.training_step = training_step
        self._trainer, self._wrapper = trainer, training_step


@guarded
def _gradients_final(watcher: Any, optimizer: Any, args: Any, kwargs: Any) -> None:
    # a fused optimizer under a GradScaler is called on a skipped step too: its gradients are not final ones
    if not scaler_skips(optimizer):
        watcher.begin_optimizer_step(0)


class ModscopeCallback(_TrainerCallback):  # type: ignore[misc]
    """Watch the model a ``transformers.Trainer`` trains: ``Trainer(..., callbacks=[ModscopeCallback()])``.

    The arguments are :func:`probes.watch`'s, checked here: ``run_dir`` (default ``./runs/<time>``),
    ``every`` (sample every N-th step; default: chosen to keep the overhead under ``overhead``),
    ``overhead``, ``window``, ``run_name``. ``.watcher`` is the :class:`probes.Watcher` once training started.
    """

    def __init__(self, run_dir: Any = None, every: int | None = None, overhead: float = 0.01, window: int = 16,
                 run_name: str | None = None) -> None:
        self._impl = TrainerWatch(WatchOptions(run_dir, every, overhead, window, run_name))

    @property
    def watcher(self) -> Any:
        """The :class:`probes.Watcher` of the current (or last) ``train()``; None before it starts."""
        return self._impl.watcher

    @guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._impl.start(kwargs.get("model"), kwargs.get("optimizer"), _calling_trainer())

    @guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a callback added during train() (``modscope run`` adds it at an optimizer step) starts here
        if self._impl.watcher is None and not self._impl.gave_up:
            self._impl.start(kwargs.get("model"), kwargs.get("optimizer"), _calling_trainer())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._impl.step_end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._impl.close()

    def close(self) -> None:
        """Close the watcher now (``on_train_end`` does it; idempotent)."""
        self._impl.close()
