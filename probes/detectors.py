"""Dynamic detectors: host-side rules over the statistics of sampled steps. Pure Python.

Definitions (also in README):
- a unit is a channel (dim 1) of conv-like outputs, else the last dimension; it is *active* in a sample
  when any of its values is non-zero. The *window* is the last ``window`` sampled steps (default 16).
  A unit is dead when it was not active in any call of the window.
- dead-layer: >= 90% dead units, or the output is constant (std == 0) in every sample of the window;
  dead-units: 25% to 90%. Both need at least ``MIN_SAMPLES`` samples of the module.
- saturated: Tanh/Hardtanh/Softsign outputs with |x| > 0.99, Sigmoid/Hardsigmoid outputs below 0.01 or
  above 0.99; flagged when more than half of the values sit in those tails on average over the last
  MIN_SAMPLES samples.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Protocol

from . import findings
from .findings import Finding

DEAD_LAYER = 0.90
DEAD_UNITS = 0.25
SATURATED = 0.5
MIN_SAMPLES = 3
NOT_UPDATING_STEPS = 2
# a gradient below this fraction of the tensor's norm is numerically zero (a bias before BatchNorm): no
# optimizer step is expected to move the tensor by it
NEGLIGIBLE_GRAD = 1e-6
ACCUMULATING_STEPS = 2


@dataclasses.dataclass(frozen=True)
class ModuleSample:
    step: int
    calls: int
    numel: int
    mean: float | None
    std: float | None
    absmax: float | None
    zero_frac: float | None
    dead_frac: float | None
    sat_frac: float | None
    nonfinite: int
    out_grad_norm: float | None
    order: int                      # execution order of its first completed call in the step


@dataclasses.dataclass(frozen=True)
class TensorSample:
    step: int
    grad_norm: float | None
    data_norm: float | None
    update_norm: float | None
    stale_grad_norm: float | None   # .grad found already non-zero when the first new gradient arrived
    arrived: bool
    lr: float | None = None         # its param group's learning rate at the optimizer step (read live)
    fingerprint: float | None = None        # replicas: a sum of fixed strided values
    local_grad_norm: float | None = None    # replicas: this rank's own gradient, before all-reduce


@dataclasses.dataclass(frozen=True)
class BypassCandidate:
    """A tensor that received a gradient in a step in which none of its modules was called."""

    tensor_id: int
    module_ids: tuple[int, ...]


class ModelView(Protocol):
    """What the detectors read about the model (implemented by :class:`probes.model_index.ModelIndex`)."""

    def has_module(self, module_id: int) -> bool: ...
    def module_path(self, module_id: int) -> str: ...
    def module_type(self, module_id: int) -> str: ...
    def tensor_known(self, tensor_id: int) -> bool: ...
    def tensor_path(self, tensor_id: int) -> str: ...
    def tensor_module(self, tensor_id: int) -> int | None: ...
    def tensor_in_optimizer(self, tensor_id: int) -> bool: ...
    def tensor_group(self, tensor_id: int) -> tuple[int, int] | None: ...


@dataclasses.dataclass(frozen=True)
class StepEvidence:
    """What one sampled step showed, for the detectors."""

    step: int
    modules: Mapping[int, ModuleSample]
    tensors: Mapping[int, TensorSample]
    optimizer_stepped: bool


class DynamicDetectors:
    def __init__(self, window: int = 16) -> None:
        self.window = window
        self.modules: dict[int, collections.deque[ModuleSample]] = {}
        self.tensors: dict[int, collections.deque[TensorSample]] = {}

    def observe(self, module_samples: Mapping[int, ModuleSample], tensor_samples: Mapping[int, TensorSample]) -> None:
        for mid, s in module_samples.items():
            self.modules.setdefault(mid, collections.deque(maxlen=self.window)).append(s)
        for tid, ts in tensor_samples.items():
            self.tensors.setdefault(tid, collections.deque(maxlen=self.window)).append(ts)

    def evaluate(self, view: ModelView, ev: StepEvidence) -> list[Finding]:
        """The findings about states (dead units, saturation, tensors that do not update or accumulate
        gradients) the window shows now. Events (modes, NaN/Inf, bypassed forwards) are the EventBook's."""
        out: list[Finding] = []
        out += self._activations(ev.step, view)
        if ev.optimizer_stepped:
            out += self._not_updating(ev.step, view)
        out += self._accumulating(ev.step, view)
        return out

    def _activations(self, step: int, view: ModelView) -> list[Finding]:
        out: list[Finding] = []
        for mid, hist in self.modules.items():
            if not view.has_module(mid) or len(hist) < MIN_SAMPLES:
                continue
            last = hist[-1]
            if last.nonfinite:
                continue            # NaN/Inf make dead/constant/saturated meaningless: non-finite says it
            path, typ = view.module_path(mid), view.module_type(mid)
            constant = last.numel > 1 and all(s.std is not None and s.std == 0.0 for s in hist)
            dead = last.dead_frac
            ev = {"dead_fraction": dead, "window_samples": len(hist), "zero_fraction": last.zero_frac,
                  "std": last.std, "type": typ}
            if constant:
                out.append(findings.dead_constant(path, typ, last.mean, len(hist), ev, step))
            elif dead is not None and dead >= DEAD_LAYER:
                out.append(findings.dead_layer(path, typ, dead, len(hist), ev, step))
            elif dead is not None and dead >= DEAD_UNITS:
                out.append(findings.dead_units(path, typ, dead, len(hist), ev, step))
            sats = [s.sat_frac for s in list(hist)[-MIN_SAMPLES:] if s.sat_frac is not None]
            if len(sats) == MIN_SAMPLES:
                avg = sum(sats) / len(sats)
                if avg > SATURATED:
                    out.append(findings.saturated(path, typ, avg, len(sats), step))
        return out

    def _not_updating(self, step: int, view: ModelView) -> list[Finding]:
        out: list[Finding] = []
        for tid, hist in self.tensors.items():
            if not view.tensor_known(tid):
                continue
            recent = [s for s in hist if s.update_norm is not None][-NOT_UPDATING_STEPS:]
            if len(recent) < NOT_UPDATING_STEPS:
                continue
            if all(s.arrived and s.grad_norm and math.isfinite(s.grad_norm)
                   and s.grad_norm > NEGLIGIBLE_GRAD * (s.data_norm or 0.0) and s.update_norm == 0.0 for s in recent):
                grad = recent[-1].grad_norm
                assert grad is not None
                # a learning rate of 0 in every one of the steps (not a warmup's single first step) says why
                zero_lr = all(s.lr == 0.0 for s in recent)
                out.append(findings.not_updating(view.tensor_path(tid), grad, [s.step for s in recent],
                                                 view.tensor_in_optimizer(tid), step,
                                                 view.tensor_group(tid) if zero_lr else None))
        return out

    def _accumulating(self, step: int, view: ModelView) -> list[Finding]:
        out: list[Finding] = []
        for tid, hist in self.tensors.items():
            if not view.tensor_known(tid):
                continue
            recent = [s for s in hist if s.arrived][-ACCUMULATING_STEPS:]
            if len(recent) < ACCUMULATING_STEPS:
                continue
            if all(s.stale_grad_norm is not None and s.stale_grad_norm > 0 for s in recent):
                out.append(findings.grad_accumulating(view.tensor_path(tid), [s.stale_grad_norm for s in recent],
                                                      [s.grad_norm for s in recent], step))
        return out
