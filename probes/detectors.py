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
from collections.abc import Mapping, Sequence
from typing import Protocol

from . import findings
from .findings import Finding
from .schema import display_path

DEAD_LAYER = 0.90
DEAD_UNITS = 0.25
SATURATED = 0.5
MIN_SAMPLES = 3
NOT_UPDATING_STEPS = 2
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


@dataclasses.dataclass(frozen=True)
class ModeEvents:
    mismatch: Mapping[int, tuple[bool, bool]]   # module_id -> (module.training, root.training)
    nograd_train: Sequence[int]                 # mode-sensitive modules in train mode under no_grad
    inference_mode: bool


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
    def tensor_lr(self, tensor_id: int) -> float | None: ...


@dataclasses.dataclass(frozen=True)
class StepEvidence:
    """What one sampled step showed, for the detectors."""

    step: int
    modules: Mapping[int, ModuleSample]
    tensors: Mapping[int, TensorSample]
    modes: ModeEvents
    optimizer_stepped: bool
    bypass: Sequence[BypassCandidate]


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
        out: list[Finding] = []
        out += self._activations(ev.step, view)
        out += self._nonfinite(ev.step, view, ev.modules, ev.tensors)
        if ev.optimizer_stepped:
            out += self._not_updating(ev.step, view)
        out += self._accumulating(ev.step, view)
        out += self._modes(ev.step, view, ev.modes)
        for c in ev.bypass:
            names = [display_path(view.module_path(m)) for m in c.module_ids]
            out.append(findings.forward_bypassed(view.module_path(c.module_ids[0]), view.tensor_path(c.tensor_id),
                                                 names, ev.step))
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

    def _nonfinite(self, step: int, view: ModelView, current: Mapping[int, ModuleSample],
                   current_t: Mapping[int, TensorSample]) -> list[Finding]:
        out: list[Finding] = []
        bad = sorted((s.order, mid) for mid, s in current.items() if s.nonfinite)
        if bad:
            first = bad[0][1]
            out.append(findings.non_finite_activation(view.module_path(first), current[first].nonfinite, step,
                                                      [view.module_path(m) for _, m in bad]))
        grads = [tid for tid, s in current_t.items()
                 if s.grad_norm is not None and not math.isfinite(s.grad_norm) and view.tensor_known(tid)]
        if grads:
            tid = max(grads)          # the last tensor in forward order gets its gradient first
            mid = view.tensor_module(tid)
            path = view.module_path(mid) if mid is not None and view.has_module(mid) else view.tensor_path(tid)
            if not bad or path != view.module_path(bad[0][1]):
                out.append(findings.non_finite_gradient(path, view.tensor_path(tid), step,
                                                        [view.tensor_path(t) for t in sorted(grads)], len(grads)))
        return out

    def _not_updating(self, step: int, view: ModelView) -> list[Finding]:
        out: list[Finding] = []
        for tid, hist in self.tensors.items():
            if not view.tensor_known(tid):
                continue
            recent = [s for s in hist if s.update_norm is not None][-NOT_UPDATING_STEPS:]
            if len(recent) < NOT_UPDATING_STEPS or view.tensor_lr(tid) == 0.0:
                continue
            if all(s.arrived and s.grad_norm and math.isfinite(s.grad_norm) and s.grad_norm > 0
                   and s.update_norm == 0.0 for s in recent):
                grad = recent[-1].grad_norm
                assert grad is not None
                out.append(findings.not_updating(view.tensor_path(tid), grad, [s.step for s in recent],
                                                 view.tensor_in_optimizer(tid), step))
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

    def _modes(self, step: int, view: ModelView, modes: ModeEvents) -> list[Finding]:
        out = [findings.training_mode_mismatch(view.module_path(mid), view.module_type(mid), training,
                                               root_training, step)
               for mid, (training, root_training) in modes.mismatch.items()]
        if modes.nograd_train:
            out.append(findings.train_mode_under_no_grad([view.module_path(m) for m in modes.nograd_train],
                                                         modes.inference_mode, step))
        return out
