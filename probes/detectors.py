"""Dynamic detectors: host-side rules over the statistics of sampled steps. Pure Python.

Definitions (also in README):
- a unit is a channel (dim 1) of conv-like outputs, else the last dimension; it is *active*
  in a sample when any of its values is non-zero. The *window* is the last ``window``
  sampled steps (default 16). A unit is dead when it was not active in any call of the window.
- dead-layer: >= 90% dead units, or the output is constant (std == 0) in every sample of the
  window; dead-units: 25% to 90%. Both need at least ``MIN_SAMPLES`` samples of the module.
- saturated: Tanh/Hardtanh/Softsign outputs with |x| > 0.99, Sigmoid/Hardsigmoid outputs
  below 0.01 or above 0.99; flagged when more than half of the values sit in those tails on
  average over the last MIN_SAMPLES samples.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

from . import findings as F
from .findings import Finding

DEAD_LAYER = 0.90
DEAD_UNITS = 0.25
SATURATED = 0.5
MIN_SAMPLES = 3
NOT_UPDATING_STEPS = 2
ACCUMULATING_STEPS = 2


@dataclasses.dataclass
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


@dataclasses.dataclass
class TensorSample:
    step: int
    grad_norm: float | None
    data_norm: float | None
    update_norm: float | None
    stale_grad_norm: float | None   # .grad found already non-zero when the first new gradient arrived
    arrived: bool


@dataclasses.dataclass
class ModeEvents:
    mismatch: dict[int, tuple[bool, bool]]     # module_id -> (module.training, root.training)
    nograd_train: list[int]                    # mode-sensitive modules in train mode under no_grad
    inference_mode: bool


class DynamicDetectors:
    def __init__(self, window: int = 16) -> None:
        self.window = window
        self.modules: dict[int, collections.deque[ModuleSample]] = {}
        self.tensors: dict[int, collections.deque[TensorSample]] = {}

    def observe(self, module_samples: dict[int, ModuleSample], tensor_samples: dict[int, TensorSample]) -> None:
        for mid, s in module_samples.items():
            self.modules.setdefault(mid, collections.deque(maxlen=self.window)).append(s)
        for tid, s in tensor_samples.items():
            self.tensors.setdefault(tid, collections.deque(maxlen=self.window)).append(s)

    def forget_module(self, mid: int) -> None:
        self.modules.pop(mid, None)

    # ---------------------------------------------------------------------------------------
    def evaluate(self, step: int, module_path: dict[int, str], module_type: dict[int, str],
                 tensor_path: dict[int, str], tensor_module: dict[int, int | None],
                 tensor_info: dict[int, dict[str, Any]], current: dict[int, ModuleSample],
                 current_t: dict[int, TensorSample], modes: ModeEvents,
                 optimizer_stepped: bool, bypass_candidates: list[tuple[int, list[int]]]) -> list[Finding]:
        out: list[Finding] = []
        out += self._activations(step, module_path, module_type)
        out += self._nonfinite(step, module_path, tensor_path, tensor_module, current, current_t)
        if optimizer_stepped:
            out += self._not_updating(step, tensor_path, tensor_info)
        out += self._accumulating(step, tensor_path)
        out += self._modes(step, module_path, module_type, modes)
        for tid, mids in bypass_candidates:
            names = [module_path[m] or "<root>" for m in mids]
            out.append(F.make("forward-bypassed", module_path[mids[0]],
                              f"{tensor_path[tid]} received a gradient in step {step}, but its module "
                              f"{names[0]} was never called through __call__ in that step: someone called "
                              ".forward() directly, so hooks (pruning masks, probes, FSDP) never ran.",
                              evidence={"parameter": tensor_path[tid], "modules": names}, step=step))
        return out

    def _activations(self, step, module_path, module_type) -> list[Finding]:
        out: list[Finding] = []
        for mid, hist in self.modules.items():
            if mid not in module_path or len(hist) < MIN_SAMPLES:
                continue
            last = hist[-1]
            if last.nonfinite:
                continue            # NaN/Inf make dead/constant/saturated meaningless: non-finite says it
            path, typ = module_path[mid], module_type.get(mid, "")
            stds = [s.std for s in hist]
            constant = last.numel > 1 and all(s is not None and s == 0.0 for s in stds)
            dead = last.dead_frac
            ev = {"dead_fraction": dead, "window_samples": len(hist), "zero_fraction": last.zero_frac,
                  "std": last.std, "type": typ}
            where = path or "<root>"
            if constant:
                out.append(F.make("dead-layer", path,
                                  f"The output of {where} ({typ}) is constant ({last.mean!r}) in every one of "
                                  f"the last {len(hist)} samples: it carries no information and passes no "
                                  "useful gradient.", evidence=ev, step=step))
            elif dead is not None and dead >= DEAD_LAYER:
                out.append(F.make("dead-layer", path,
                                  f"{dead:.0%} of the units of {where} ({typ}) never activated (always "
                                  f"zero) over the last {len(hist)} sampled steps: the layer is dead and "
                                  "its inputs get no gradient through it.", evidence=ev, step=step))
            elif dead is not None and dead >= DEAD_UNITS:
                out.append(F.make("dead-units", path,
                                  f"{dead:.0%} of the units of {where} ({typ}) never activated over the last "
                                  f"{len(hist)} sampled steps: capacity is wasted.", evidence=ev, step=step))
            sats = [s.sat_frac for s in list(hist)[-MIN_SAMPLES:] if s.sat_frac is not None]
            if sats and len(sats) == MIN_SAMPLES:
                avg = sum(sats) / len(sats)
                if avg > SATURATED:
                    out.append(F.make("saturated", path,
                                      f"{avg:.0%} of the outputs of {where} ({typ}) sit in the saturated "
                                      "tails, where the gradient is nearly zero: learning through it stalls.",
                                      evidence={"saturated_fraction": avg, "samples": len(sats), "type": typ},
                                      step=step))
        return out

    def _nonfinite(self, step, module_path, tensor_path, tensor_module, current, current_t) -> list[Finding]:
        out: list[Finding] = []
        bad = [(s.order, mid, s) for mid, s in current.items() if s.nonfinite]
        if bad:
            bad.sort()
            _, mid, s = bad[0]
            out.append(F.make("non-finite", module_path.get(mid, ""),
                              f"{module_path.get(mid) or '<root>'} produced {s.nonfinite} NaN/Inf values in step "
                              f"{step}; it is the first module in execution order to do so "
                              f"({len(bad)} modules affected).",
                              evidence={"nonfinite": s.nonfinite, "modules_affected": len(bad),
                                        "first_modules": [module_path.get(m, "") for _, m, _ in bad[:5]],
                                        "kind": "activation"}, step=step))
        grads = [tid for tid, s in current_t.items()
                 if s.grad_norm is not None and not _finite(s.grad_norm)]
        if grads:
            tid = max(grads)          # the last tensor in forward order gets its gradient first
            mid = tensor_module.get(tid)
            path = module_path.get(mid, tensor_path[tid]) if mid is not None else tensor_path[tid]
            if not bad or path != module_path.get(bad[0][1]):
                out.append(F.make("non-finite", path,
                                  f"The gradient of {tensor_path[tid]} is NaN/Inf in step {step} "
                                  f"({len(grads)} tensors affected).",
                                  evidence={"tensors": [tensor_path[t] for t in sorted(grads)[:5]],
                                            "kind": "gradient"}, step=step))
        return out

    def _not_updating(self, step, tensor_path, tensor_info) -> list[Finding]:
        out: list[Finding] = []
        for tid, hist in self.tensors.items():
            info = tensor_info.get(tid)
            if info is None:
                continue
            recent = [s for s in hist if s.update_norm is not None][-NOT_UPDATING_STEPS:]
            if len(recent) < NOT_UPDATING_STEPS:
                continue
            if info.get("lr") == 0.0:
                continue
            if all(s.arrived and s.grad_norm and _finite(s.grad_norm) and s.grad_norm > 0 and
                   s.update_norm == 0.0 for s in recent):
                reason = ("no watched optimizer holds it" if not info.get("in_optimizer")
                          else "the optimizer holds it but did not change it")
                out.append(F.make("not-updating", tensor_path[tid],
                                  f"{tensor_path[tid]} receives gradients (norm {recent[-1].grad_norm:.3g}) but "
                                  f"its value did not change over the last {len(recent)} observed optimizer "
                                  f"steps: {reason}. A gradient only proves autograd reached it.",
                                  evidence={"grad_norm": recent[-1].grad_norm, "steps": [s.step for s in recent],
                                            "in_optimizer": bool(info.get("in_optimizer"))}, step=step))
        return out

    def _accumulating(self, step, tensor_path) -> list[Finding]:
        out: list[Finding] = []
        for tid, hist in self.tensors.items():
            recent = [s for s in hist if s.arrived][-ACCUMULATING_STEPS:]
            if len(recent) < ACCUMULATING_STEPS:
                continue
            if all(s.stale_grad_norm is not None and s.stale_grad_norm > 0 for s in recent):
                out.append(F.make("grad-accumulating", tensor_path[tid],
                                  f"{tensor_path[tid]}.grad was not zeroed between steps: each backward adds "
                                  f"to the previous gradient (norm before the new one: "
                                  f"{recent[-1].stale_grad_norm:.3g}), so it grows for the whole run and "
                                  "holds a gradient buffer nobody uses.",
                                  evidence={"stale_grad_norms": [s.stale_grad_norm for s in recent],
                                            "grad_norms": [s.grad_norm for s in recent]}, step=step))
        return out

    def _modes(self, step, module_path, module_type, modes: ModeEvents) -> list[Finding]:
        out: list[Finding] = []
        for mid, (training, root_training) in modes.mismatch.items():
            path = module_path.get(mid, "")
            out.append(F.make("training-mode-mismatch", path,
                              f"{path or '<root>'} ({module_type.get(mid, '')}) ran with training={training} "
                              f"while the model is in {'train' if root_training else 'eval'} mode: "
                              "model.train()/eval() did not reach it.",
                              evidence={"module_training": training, "root_training": root_training},
                              step=step))
        if modes.nograd_train:
            names = [module_path.get(m, "") for m in modes.nograd_train]
            ctx = "inference_mode()" if modes.inference_mode else "no_grad()"
            out.append(F.make("train-mode-under-no-grad", "",
                              f"A forward ran under {ctx} while {len(names)} Dropout/BatchNorm modules were in "
                              "training mode (e.g. " + ", ".join(n or "<root>" for n in names[:3]) + "): "
                              "validation in train mode applies dropout and overwrites BatchNorm running "
                              "statistics with validation data.",
                              evidence={"modules": names[:20], "count": len(names), "context": ctx}, step=step))
        return out


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))
