"""The watcher's own checks, outside the sampled steps and the structure walk: a ``load_state_dict()`` of the watched
model (:class:`probes.findings.checkpoint_keys.CheckpointLoads`, ``checkpoint-keys``) and optimizers that stopped
stepping while forwards go on (:class:`probes.findings.not_moving.StalledOptimizer`, ``not-updating`` at the root).
Their findings join the evaluator's (``Evaluator.outside``) as soon as they change."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..capture.guard import ProbeRuntime
from ..capture.sentinels import ForwardLog, RootSentinel
from .checkpoint_keys import CheckpointLoads
from .evaluation import Evaluator
from .not_moving import StalledOptimizer


class LoopChecks:
    """``sentinel``: the model's forwards since the step in progress began; ``publish(step, sampled)``: record the
    findings now; ``stepping``: the watcher ends steps at the optimizers' steps (it watches optimizers and no
    framework says where steps end), the only case in which a stalled optimizer can be told. The watcher tells it
    when the loop calls ``w.step()`` (:meth:`reported`) and takes the forwards of a step that ends through it
    (:meth:`take`); a preview of the step in progress (``findings()``, ``snapshot()``) checks first."""

    def __init__(self, probe: ProbeRuntime, evaluator: Evaluator, sentinel: RootSentinel, model: nn.Module,
                 publish: Callable[[int, bool], None], *, stepping: bool) -> None:
        self._probe = probe
        self._evaluator = evaluator
        self._sentinel = sentinel
        self._publish = publish
        self._stepping = stepping
        self._stall = StalledOptimizer()
        self._loads = CheckpointLoads(probe, self._loaded)
        self._loads.attach(model)
        evaluator.before_preview = self._stalled_now

    def _loaded(self) -> None:
        """A load_state_dict() of the model changed the checkpoint-keys finding: published at once."""
        self._evaluator.outside["checkpoint-loads"] = self._loads.findings()
        self._publish(self._probe.step, False)

    def _stalled_now(self) -> bool:
        """Forwards without an optimizer step in the step in progress: said (the evaluator publishes what changed).
        Whether the finding is new."""
        if not (self._stepping and self._stall.check(self._sentinel.log.train_forwards, self._probe.step)):
            return False
        self._evaluator.outside["stalled"] = self._stall.findings()
        self._evaluator.events.changed = True
        return True

    def reported(self) -> None:
        """The loop called ``w.step()`` (after its optimizer step, or while no optimizer steps): a stall is published
        at once, as no step ends while it lasts."""
        self._stall.reports += 1
        if self._stalled_now():
            self._publish(self._probe.step, False)

    def take(self, closing: bool) -> ForwardLog:
        """The sentinel's forwards of the step that ends here (``closing``: with the watcher). At a step's end the
        optimizer steps again (a stall goes); at the watcher's close a stall in the step in progress is said, and the
        load hook removed."""
        if not closing:
            if self._stall.step_ended(self._sentinel.log.train_forwards):
                self._evaluator.outside["stalled"] = []
                self._evaluator.events.changed = True
        else:
            with self._probe.guard("close"):
                self._stalled_now()
            self._loads.detach()
        return self._sentinel.take()
