"""How far an optimizer step moves each value of a tensor, estimated from what a sampled step measured (the
learning rate, the gradient's and the tensor's norms) and the param group's settings (read on the host, never from a
device), compared with the spacing of floating-point numbers at the tensor's values: an update below half that
spacing rounds away (``p - u == p`` exactly), so the tensor does not change although the optimizer stepped it.

Per value, with g the gradient's rms and p the tensor's:

- SGD: lr x (g + weight_decay x p), the step of this gradient. Momentum adds the velocity of the earlier ones, which
  the host cannot see (reading the buffers would cost a device sync): of a steady gradient it is at most
  1 + momentum + momentum**2 ... over the steps so far (1 / (1 - momentum) in the end), but the gradients that round
  away are noise that cancels (a bias before BatchNorm) or grow from zero (behind a zero-initialised layer), whose
  velocity is far less. The message gives that bound beside the estimate;
- Adam and its kin (a group with ``betas`` and ``eps``: Adam, AdamW, NAdam, RAdam, Adamax): about lr x g / (g + eps)
  (lr once the gradient is well above eps; far less below it), plus lr x weight_decay x p when the decay is decoupled
  (AdamW's), the decay added to the gradient when it is not;
- any other optimizer: about lr x max(1, g) (Adam's lr or SGD's lr x g, the larger), which only a learning rate far
  too small for the tensor's values rounds away.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from ..model.tensors import host_number
from .rules.not_updating import RoundedAway

# the relative spacing of the floating types a tensor is updated in: float32's for the low-precision ones too (the
# master weights of mixed precision), whose own rounding the not-updating message names apart
_EPS = {"float64": 2.0 ** -52}
_EPS32 = 2.0 ** -23


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """What a param group's settings make of a gradient, per value: ``kind`` 'sgd' or 'adam'."""

    kind: str
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    decoupled: bool = False          # weight decay applied to the values, not added to the gradient (AdamW)
    eps: float = 0.0

    def accumulation(self, steps: int) -> float:
        """What SGD's momentum multiplies a steady gradient by after ``steps`` optimizer steps."""
        if not 0 < self.momentum < 1 or steps <= 1:
            return 1.0
        mu = self.momentum
        velocity = max(1.0, 1 + (1 - self.dampening) * mu * (1 - mu ** (steps - 1)) / (1 - mu))
        return 1 + mu * velocity if self.nesterov else velocity

    def per_value(self, lr: float, grad_rms: float, data_rms: float) -> float:
        """About how far a step moves a value by its own gradient."""
        decay = self.weight_decay * data_rms
        if self.kind == "sgd":
            return lr * (grad_rms + decay)
        grad = grad_rms if self.decoupled else grad_rms + decay
        adam = lr * grad / (grad + self.eps) if grad > 0 else 0.0
        return adam + (lr * decay if self.decoupled else 0.0)

    def describe(self, steps: int) -> str:
        """The estimate of the ``steps``-th step, in words."""
        decay = f", weight decay {self.weight_decay:g}" if self.weight_decay else ""
        if self.kind == "sgd":
            if self.accumulation(steps) == 1:
                return f"SGD: lr x the gradient{decay}"
            return (f"SGD: lr x the gradient{decay}; momentum {self.momentum:g}"
                    + (" (Nesterov)" if self.nesterov else "")
                    + f" adds at most x{self.accumulation(steps):.3g} of a steady gradient by this step")
        return f"Adam: lr x g / (g + eps), eps {self.eps:g}{decay}"


def update_rule(group: Mapping[str, object]) -> UpdateRule | None:
    """A param group's rule, from its settings (SGD's have ``momentum`` and ``dampening``, Adam's ``betas`` and
    ``eps``); None for any other optimizer and for a setting the host cannot read without a device sync."""
    decay = _number(group.get("weight_decay", 0.0))
    if decay is None:
        return None
    if "dampening" in group and "momentum" in group:
        momentum, dampening = _number(group.get("momentum")), _number(group.get("dampening"))
        if momentum is None or dampening is None:
            return None
        return UpdateRule("sgd", momentum=momentum, dampening=dampening, nesterov=bool(group.get("nesterov")),
                          weight_decay=decay)
    if "betas" in group and "eps" in group:
        eps = _number(group.get("eps"))
        if eps is None:
            return None
        decoupled = bool(group.get("decoupled_weight_decay"))
        return UpdateRule("adam", weight_decay=decay, decoupled=decoupled, eps=eps)
    return None


def _number(value: object) -> float | None:
    x = host_number(value)
    return x if x is not None and math.isfinite(x) and x >= 0 else None


def spacing(rms: float, dtype: str) -> float:
    """The spacing of the numbers at ``rms`` of the type ``dtype`` is updated in (float32 for 16-bit ones)."""
    return math.ldexp(_EPS.get(dtype, _EPS32), math.frexp(rms)[1] - 1)


def rounded_away(lrs: Sequence[float], grad_norms: Sequence[float], data_norms: Sequence[float],
                 steps: Sequence[int], numel: int, dtype: str, rule: UpdateRule | None) -> RoundedAway | None:
    """Why a tensor the optimizer stepped did not change, when in every one of the steps (``lrs``, ``grad_norms``,
    ``data_norms``, the latest first; ``steps``: the optimizer steps taken by each, counted from the watch's start)
    its update is below half the spacing of its numbers: the learning rate
    itself (even a step of about lr per value rounds away: a scheduler decayed it), or, under a known ``rule``, the
    update that rule makes of its gradient. None when some step's update does not round away."""
    if numel <= 0 or not lrs:
        return None
    reference = "float64" if dtype == "float64" else "float32"
    by_lr, by_update = True, rule is not None
    first: tuple[float, float, float, float] | None = None
    for lr, grad_norm, data_norm in zip(lrs, grad_norms, data_norms, strict=True):
        if not (math.isfinite(lr) and lr > 0 and math.isfinite(grad_norm) and grad_norm >= 0
                and math.isfinite(data_norm) and data_norm > 0):
            return None
        rms, grad_rms = data_norm / math.sqrt(numel), grad_norm / math.sqrt(numel)
        half = spacing(rms, dtype) / 2
        by_lr &= lr * max(1.0, grad_rms) < half
        update = rule.per_value(lr, grad_rms, rms) if rule is not None else lr * max(1.0, grad_rms)
        by_update &= update < half
        if first is None:
            first = (update, rms, spacing(rms, dtype), grad_rms)
    if first is None or not (by_lr or by_update):
        return None
    update, rms, space, grad_rms = first
    return RoundedAway(lrs[0], rms, space, reference, update=update, grad_rms=grad_rms, by_lr=by_lr,
                       estimate=rule.describe(steps[0]) if rule is not None else "lr x max(1, the gradient)")


def group_rules(optimizers: Sequence[torch.optim.Optimizer]) -> Callable[[tuple[int, int]], UpdateRule | None]:
    """The update rule of a param group (optimizer, group) of ``optimizers`` (the watched ones, in the index's
    order), read from its settings when asked."""
    def rule(group: tuple[int, int]) -> UpdateRule | None:
        opt, index = group
        if not 0 <= opt < len(optimizers):
            return None
        groups = optimizers[opt].param_groups
        return update_rule(groups[index]) if 0 <= index < len(groups) else None
    return rule


def no_rules(group: tuple[int, int]) -> UpdateRule | None:
    """No optimizer's settings known: only a learning rate far too small is seen to round away."""
    return None
