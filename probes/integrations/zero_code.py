"""Zero code (``modscope run``) under a framework's Trainer.

:mod:`probes.launch.autowatch` finds a model at an optimizer step. When that step runs inside a Lightning or
Hugging Face ``Trainer`` (one is on the call stack, stepping that optimizer), :func:`attach` adds the
matching callback to that Trainer instead of a plain watch: the framework's machinery then says when
gradients are final and when a step ends (Lightning runs forward and backward inside
``optimizer.step(closure)``, where the optimizer's own step hooks cannot tell), exactly as with the
callback passed by hand. Added in the middle of a step, the callback starts at the next batch
(Lightning: ``on_train_batch_start``) or step (Trainer: ``on_step_begin``).

Only frameworks the script imported are looked for: nothing is imported to look.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from . import calling_trainer

__all__ = ["Attached", "attach"]


@dataclasses.dataclass
class Attached:
    """A framework callback that autowatch added (or found) on a Trainer."""

    callback: Any
    optimizers: list[torch.optim.Optimizer]      # the torch optimizers that Trainer steps

    @property
    def watcher(self) -> Any:
        return self.callback.watcher

    @property
    def model_name(self) -> str:
        return str(getattr(self.callback._impl, "model_name", "model"))


def attach(optimizer: torch.optim.Optimizer, run_dir: str | os.PathLike[str], *, every: int | None,
           overhead: float) -> Attached | None:
    """Add the callback to the Trainer that steps ``optimizer`` now, or None when no Trainer does."""
    found = calling_trainer()
    if found is None:
        return None
    framework, trainer = found
    if framework == "lightning":
        from .lightning import ModscopeCallback as LightningCallback
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        callbacks = trainer.callbacks
        cls: Any = LightningCallback
    else:
        from .transformers import ModscopeCallback as TrainerCallback
        from .transformers import _torch_optimizer
        optimizers = [_torch_optimizer(trainer.optimizer)] if trainer.optimizer is not None else []
        callbacks = trainer.callback_handler.callbacks
        cls = TrainerCallback
    if not any(o is optimizer for o in optimizers):
        return None                               # an optimizer of its own, stepped under the Trainer
    for cb in callbacks:
        if isinstance(cb, cls):                   # the script passed one already: it watches
            return Attached(cb, optimizers)
    cb = cls(run_dir=run_dir, every=every, overhead=overhead)
    if framework == "lightning":
        callbacks.append(cb)
    else:
        trainer.add_callback(cb)
    return Attached(cb, optimizers)
