"""modscope inside the training frameworks: one line in each, right under each one's step machinery.

    from probes.integrations.lightning import ModscopeCallback        # Lightning (lightning.pytorch or
    trainer = L.Trainer(callbacks=[ModscopeCallback()])                # pytorch_lightning)

    from probes.integrations.transformers import ModscopeCallback     # Hugging Face Trainer
    trainer = Trainer(model, args, callbacks=[ModscopeCallback()])

    from probes.integrations.accelerate import watch                  # an accelerate loop
    w = watch(accelerator, model, optimizer)

Each submodule imports its framework when it is imported (``import probes`` imports none of them); a
missing framework raises ImportError with a one-line install hint. What each measures, at which hook,
and the known limits: docs/integrations.md.

This module holds what the three share: the options (checked when the callback is made, not at the
start of training), the ``modscope: watching <Model> -> <run dir>`` line, and a per-step loss mean.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from ..limits import check_dense, check_every, check_overhead, check_run_name, check_window

__all__ = ["LossMean", "WatchOptions", "announce", "calling_trainer", "guarded", "handles_unscaling", "require",
           "say_once", "scaler_skips"]

P = ParamSpec("P")
R = TypeVar("R")
_said: set[str] = set()


def say_once(line: str) -> None:
    """One line on stderr, once per process (a failure inside a hook repeats every step)."""
    if line in _said:
        return
    _said.add(line)
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:          # a closed stderr must not stop training
        pass


def guarded(fn: Callable[P, R]) -> Callable[P, R | None]:
    """An integration's hook: what fails inside it is said once, in one line, and training goes on (the
    Watcher guards its own work; this covers the adapters' reading of the framework's objects)."""

    @functools.wraps(fn)
    def hook(*args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            say_once(f"modscope: {fn.__qualname__}: {type(exc).__name__}: {first}")
            return None
    return hook


def require(module: str, what: str, extra: str, package: str) -> ModuleType:
    """Import ``module`` or raise ImportError with one line: which modscope feature needs which package."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"modscope's {what} needs {package} (pip install 'modscope[{extra}]')",
                          name=module) from None


@dataclasses.dataclass(frozen=True)
class WatchOptions:
    """The arguments of :func:`probes.watch` a callback takes, checked as ``probes.watch`` checks them, but
    when the callback is made: a bad value fails before training starts, not at its first hook."""

    run_dir: str | os.PathLike[str] | None = None
    every: int | None = None
    overhead: float = 0.01
    window: int = 16
    run_name: str | None = None
    dense: bool | int = True

    def __post_init__(self) -> None:
        if self.run_dir is not None and not isinstance(self.run_dir, (str, os.PathLike)):
            raise TypeError(f"run_dir must be a str, os.PathLike or None, got {type(self.run_dir).__qualname__}: "
                            f"{self.run_dir!r:.80}")
        if self.run_dir is not None and Path(self.run_dir).exists() and not Path(self.run_dir).is_dir():
            raise ValueError(f"run_dir {str(self.run_dir)!r} exists and is not a directory")
        check_every(self.every)
        check_overhead(self.overhead)
        check_window(self.window)
        check_run_name(self.run_name)
        check_dense(self.dense)

    def kwargs(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "every": self.every, "overhead": float(self.overhead),
                "window": self.window, "run_name": self.run_name, "dense": self.dense}


def announce(model: nn.Module, run_dir: str | os.PathLike[str], rank: int) -> None:
    """``modscope: watching <Model> -> <run dir>`` on stderr, once per watch, on rank 0 only."""
    if rank != 0:
        return
    try:
        print(f"modscope: watching {type(model).__name__} -> {run_dir}", file=sys.stderr, flush=True)
    except Exception:
        pass


def loss_tensor(value: Any) -> torch.Tensor | None:
    """The loss in what a framework hands over: a tensor, or a mapping / model output with ``loss``."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        loss = value.get("loss") if hasattr(value, "get") else getattr(value, "loss", None)
    except Exception:
        return None
    return loss if isinstance(loss, torch.Tensor) else None


def handles_unscaling(optimizer: Any) -> bool:
    """A fused optimizer: a GradScaler calls it with ``grad_scale`` and ``found_inf`` set, and it unscales and
    skips by itself (torch.amp.GradScaler.step), so it is called, and its step hooks fire, on skipped steps."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def scaler_skips(optimizer: Any) -> bool:
    """Inside the step of an optimizer that handles unscaling: whether the GradScaler found inf/NaN gradients,
    so that the optimizer will leave its parameters as they are. One host read of ``found_inf``, made only
    under a GradScaler with such an optimizer."""
    found = getattr(optimizer, "found_inf", None)
    return isinstance(found, torch.Tensor) and bool(found.item() != 0)


class LossMean:
    """The mean of the losses of one optimizer step's micro-batches, kept on their device (no host sync:
    the Watcher reads device losses with a sampled step's single copy)."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._n = 0

    def add(self, loss: torch.Tensor | None) -> None:
        if loss is None or loss.numel() == 0:
            return
        value = loss.detach().reshape(-1)[0].float()
        self._sum = value if self._sum is None else self._sum + value
        self._n += 1

    def total(self) -> torch.Tensor | None:
        """The sum (for losses a framework already divided by the accumulation count); then empty."""
        out, self._sum, self._n = self._sum, None, 0
        return out

    def mean(self) -> torch.Tensor | None:
        """The mean; then empty."""
        n = self._n
        out = self.total()
        return None if out is None else out / n


# (module defining the Trainer, framework): only looked up in sys.modules
_TRAINERS = (("lightning.pytorch.trainer.trainer", "lightning"),
             ("pytorch_lightning.trainer.trainer", "lightning"),
             ("transformers.trainer", "transformers"))
MAX_FRAMES = 200


def calling_trainer() -> tuple[str, Any] | None:
    """(framework, Trainer) of the innermost Lightning or transformers Trainer on the call stack."""
    classes = []
    for module, framework in _TRAINERS:
        cls = getattr(sys.modules.get(module), "Trainer", None)
        if isinstance(cls, type):
            classes.append((cls, framework))
    if not classes:
        return None
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        for cls, framework in classes:
            if issubclass(type(obj), cls):       # type(), not isinstance: proxies compute __class__
                return framework, obj
        frame = frame.f_back  # type: ignore[assignment]
    return None
