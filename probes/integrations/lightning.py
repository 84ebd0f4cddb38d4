"""modscope in Lightning: ``Trainer(callbacks=[ModscopeCallback()])``, for ``lightning.pytorch`` and
``pytorch_lightning`` alike.

    from probes.integrations.lightning import ModscopeCallback
    trainer = L.Trainer(max_epochs=3, callbacks=[ModscopeCallback(run_dir="runs/exp1")])
    trainer.fit(model, loader)                       # prints: modscope: watching MyModule -> runs/exp1

How it sits under Lightning's step machinery (automatic optimization):

- The watch starts at ``on_fit_start`` (the optimizers exist from there) on ``trainer.lightning_module``,
  the user's module (paths carry no ``_forward_module.`` or ``module.`` prefix), with
  ``boundaries="external"``: by default training_step and backward run *inside* ``optimizer.step(closure)``,
  so the torch optimizer's step pre-hook fires before the batch's forward and cannot say when gradients
  are final. ``on_before_optimizer_step`` says it (after the closure and the AMP unscale, before
  gradient clipping): gradient norms are of the accumulated, synced, unscaled, unclipped gradients.
  A fused optimizer under a GradScaler (16-mixed) is the exception: Lightning does not unscale it, and the
  scaler calls it on skipped steps too; its gradients are read at its own step pre-hook, where the
  scaler's ``found_inf`` tells a skipped step (one host read per step), still scaled (norms times the
  loss scale).
- A step ends at ``on_train_batch_end`` when ``trainer.global_step`` moved: micro-batches of gradient
  accumulation are not steps, and a step a GradScaler skipped is one (global_step counts it; no update
  is expected of it). The loss stored on it is what Lightning backpropagated for the step: the sum of its
  micro-batches' ``outputs["loss"]``, each divided by ``accumulate_grad_batches`` (their mean, when the
  accumulation window is full).
- Manual optimization (``automatic_optimization = False``): training_step calls ``opt.step()`` itself,
  after its backward, so the optimizers' own step hooks mark the steps (``boundaries="optimizer"``).
- The watcher closes at ``teardown`` of the fit and at ``on_exception``.

One class serves both packages: it derives from ``lightning.pytorch.Callback`` and from
``pytorch_lightning.Callback``, whichever are installed, so either Trainer accepts it.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ..capture.hooks import HeldHook
from . import LossMean, WatchOptions, announce, guarded, handles_unscaling, loss_tensor, require, scaler_skips

__all__ = ["LightningWatch", "ModscopeCallback"]

HINT_EXTRA = "lightning"


def _callback_bases() -> tuple[type, ...]:
    """The Callback classes of the installed Lightning packages (a Trainer checks isinstance against its own)."""
    bases: list[type] = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(name).Callback)
        except ImportError:
            continue
    if not bases:
        require("lightning.pytorch", "Lightning callback", HINT_EXTRA, "lightning")
    return tuple(bases)


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a LightningOptimizer (``_optimizer``)."""
    return getattr(optimizer, "_optimizer", optimizer)


class LightningWatch:
    """What the callback does, free of Lightning's classes: the callback is a thin adapter over it."""

    def __init__(self, options: WatchOptions) -> None:
        self.options = options
        self.watcher: Any = None            # probes.Watcher, once a fit started
        self._optimizers: list[Any] = []
        self._manual = False
        self._global_step = 0
        self._losses = LossMean()
        self._in_step: set[int] = set()      # optimizers whose gradients are final inside their own step
        self._handles: list[Any] = []
        self.model_name = "model"
        self._gave_up = False                # a start failed: not again before the next fit

    @guarded
    def start(self, trainer: Any) -> None:
        """``on_fit_start``: watch the LightningModule with the trainer's optimizers."""
        import probes

        self.close()                        # an earlier fit's watcher (fit called again)
        self._gave_up = True                # until the watch below is made
        module = trainer.lightning_module
        self.model_name = type(module).__name__
        self._optimizers = [_torch_optimizer(o) for o in trainer.optimizers]
        self._manual = not getattr(module, "automatic_optimization", True)
        self._global_step = int(trainer.global_step)
        self._losses = LossMean()
        w = self.watcher = probes.watch(module, self._optimizers or None,
                                        boundaries="optimizer" if self._manual else "external",
                                        **self.options.kwargs())
        w.root_sets_mode()                  # the fit and validation loops set the LightningModule's mode
        if not self._manual and getattr(trainer.precision_plugin, "scaler", None) is not None:
            # a fused optimizer under a GradScaler: Lightning does not unscale it before on_before_optimizer_step
            # and the scaler calls it on skipped steps too; its gradients are final inside its own step
            for i, opt in enumerate(self._optimizers):
                if handles_unscaling(opt):
                    self._in_step.add(i)
                    self._handles.append(opt.register_step_pre_hook(HeldHook(functools.partial(_in_step, w, i))))
        self._gave_up = False
        announce(module, w.run_dir, w.rank)

    @guarded
    def train_start(self, trainer: Any) -> None:
        """``on_train_start``: a checkpoint restored after ``on_fit_start`` may have moved global_step."""
        self._global_step = int(trainer.global_step)

    @guarded
    def train_batch_start(self, trainer: Any) -> None:
        """``on_train_batch_start``: a callback added during the fit (``modscope run`` adds it at an optimizer
        step) starts here, between two batches."""
        if self.watcher is None and not self._gave_up:
            self.start(trainer)

    @guarded
    def before_optimizer_step(self, optimizer: Any) -> None:
        """``on_before_optimizer_step``: the gradients of ``optimizer`` are final for this step."""
        w = self.watcher
        if w is None or self._manual:
            return
        inner = _torch_optimizer(optimizer)
        for i, opt in enumerate(self._optimizers):
            if opt is inner:
                if i not in self._in_step:
                    w.begin_optimizer_step(i)
                return

    @guarded
    def train_batch_end(self, trainer: Any, outputs: Any) -> None:
        """``on_train_batch_end``: a batch is over; the step is, when global_step moved."""
        w = self.watcher
        if w is None:
            return
        self._losses.add(loss_tensor(outputs))
        step = int(trainer.global_step)
        if step == self._global_step:
            return                          # a micro-batch of gradient accumulation
        self._global_step = step
        if self._manual:
            w.step(self._losses.mean())      # the optimizers' hooks ended the step: the loss goes on it
        else:
            w.end_step(self._losses.total())

    @guarded
    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._in_step.clear()
        w, self.watcher = self.watcher, None
        self._optimizers = []
        if w is not None:
            w.close()
            self.watcher = w                # stays readable (findings, store_path) after the fit


@guarded
def _in_step(watcher: Any, index: int, optimizer: Any, args: Any, kwargs: Any) -> None:
    if not scaler_skips(optimizer):
        watcher.begin_optimizer_step(index)


class _Callback:
    """The hooks: each hands over to :class:`LightningWatch`. Made a subclass of the installed Lightning
    packages' ``Callback`` classes below."""

    def __init__(self, run_dir: Any = None, every: int | None = None, overhead: float = 0.01, window: int = 16,
                 run_name: str | None = None) -> None:
        self._impl = LightningWatch(WatchOptions(run_dir, every, overhead, window, run_name))

    @property
    def watcher(self) -> Any:
        """The :class:`probes.Watcher` of the current (or last) fit; None before the first fit starts."""
        return self._impl.watcher

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._impl.start(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._impl.train_start(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._impl.train_batch_start(trainer)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._impl.before_optimizer_step(optimizer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._impl.train_batch_end(trainer, outputs)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._impl.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._impl.close()

    def close(self) -> None:
        """Close the watcher now (the fit's teardown does it; idempotent)."""
        self._impl.close()


class ModscopeCallback(_Callback, *_callback_bases()):  # type: ignore[misc]
    """Watch the model a Lightning Trainer fits: ``Trainer(callbacks=[ModscopeCallback()])``.

    The arguments are :func:`probes.watch`'s, checked here: ``run_dir`` (default ``./runs/<time>``),
    ``every`` (sample every N-th step; default: chosen to keep the overhead under ``overhead``),
    ``overhead``, ``window``, ``run_name``. ``.watcher`` is the :class:`probes.Watcher` once a fit started.
    """
