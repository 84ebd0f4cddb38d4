"""The watcher's own checks, outside the sampled steps and the structure walk: a ``load_state_dict()`` of the watched
model (:class:`probes.findings.checkpoint_keys.CheckpointLoads`, ``checkpoint-keys``) and optimizers that stopped
stepping while forwards go on (:class:`probes.findings.not_moving.StalledOptimizer`, ``not-updating`` at the root).
Their findings join the evaluator's (``Evaluator.outside``), published as soon as they change."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..capture.guard import ProbeRuntime
from ..capture.sentinels import RootSentinel
from .checkpoint_keys import CheckpointLoads
from .evaluation import Evaluator
from .not_moving import StalledOptimizer


class LoopChecks:
    """``sentinel``: the model's forwards since the step in progress began; ``publish(step, sampled)``: record the
    findings now; ``stepping``: the watcher ends steps at the optimizers' steps (it watches optimizers and no
    framework says where steps end), the only case in which a stalled optimizer can be told."""

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

    def _loaded(self) -> None:
        """A load_state_dict() of the model changed the checkpoint-keys finding."""
        self._evaluator.outside["checkpoint-loads"] = self._loads.findings()
        self._publish(self._probe.step, False)

    def reported(self) -> None:
        """The loop called ``w.step()`` (after its optimizer step, or while no optimizer steps)."""
        self._stall.reports += 1
        self.check_stalled()

    def check_stalled(self) -> None:
        if self._stepping and self._stall.check(self._sentinel.log.train_forwards, self._probe.step):
            self._evaluator.outside["stalled"] = self._stall.findings()
            self._publish(self._probe.step, False)

    def boundary(self, *, closing: bool) -> None:
        """The step in progress ends here, before the sentinel's forwards are taken: at a step's end the optimizer
        steps again (what went is published with the step); at the watcher's close a stall in it is said, and the
        load hook removed."""
        if not closing:
            if self._stall.step_ended(self._sentinel.log.train_forwards):
                self._evaluator.outside["stalled"] = []
                self._evaluator.events.changed = True
            return
        with self._probe.guard("close"):
            self.check_stalled()
        self._loads.detach()
