"""`not-updating`: a tensor that receives gradients but whose value does not change across optimizer steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ...schema import FindingCode
from ..finding import Finding, Seen, make
from .base import Reads, Rule

# significant bits of the low-precision floating types a parameter may be kept in
_PRECISION_BITS = {"bfloat16": 8, "float16": 11}


@dataclasses.dataclass(frozen=True)
class TinyLearningRate:
    """A learning rate so small that an optimizer step rounds away: about lr per value is below half the spacing of
    the ``reference`` floating type at the tensor's ``rms``."""

    lr: float                      # the latest step's
    rms: float
    spacing: float
    reference: str                 # 'float32' | 'float64'


class NotUpdating(Rule):
    code = FindingCode.NOT_UPDATING
    reads = Reads.SAMPLES
    severities = "error"
    meaning = (
        "a tensor receives gradients but its value did not change over the last 2 observed optimizer steps; the "
        "message says why when it can: its param group's lr is 0, or so small (a scheduler decayed it) that a step "
        "of lr × max(1, the gradient's rms) per value is below half the spacing of float32 numbers at the tensor's "
        "rms in both steps; for a bfloat16/float16 tensor that its precision rounds the update away")
    example = 'opt = torch.optim.SGD([{"params": model.head.parameters(), "lr": 0.0}])   # gradients, no change'

    @staticmethod
    def build(path: str, grad_norm: float, steps: Sequence[int], in_optimizer: bool, step: int,
              zero_lr_group: tuple[int, int] | None = None, dtype: str | None = None,
              tiny_lr: TinyLearningRate | None = None) -> Finding:
        """``zero_lr_group``: (optimizer, param group) whose learning rate was 0 (or, with ``tiny_lr``, so small that a
        step rounds away) in every one of ``steps``; ``dtype``: the tensor's."""
        fix = None
        if zero_lr_group is not None:
            opt, group = zero_lr_group
            where = f"param group {group}" + (f" of optimizer {opt}" if opt else "")
            if tiny_lr is None:
                reason = f"its {where} has lr=0 in every one of them, so no optimizer step can move it"
            else:
                reason = (f"its {where}'s lr is {tiny_lr.lr:.1e} (a scheduler decayed it?): an optimizer step of about "
                          f"lr per value (Adam's; SGD's is lr x the gradient) is below half the spacing of "
                          f"{tiny_lr.reference} numbers at the tensor's values (rms {tiny_lr.rms:.2g}: spacing "
                          f"{tiny_lr.spacing:.2g}), so every step rounds away")
                fix = ("Check the learning-rate schedule: a StepLR/ExponentialLR stepped every batch instead of every "
                       "epoch divides lr by its factor every step_size batches; give it a floor (eta_min, min_lr) well "
                       "above 1e-7 of the weights' size, or step it per epoch.")
        elif not in_optimizer:
            reason = "no watched optimizer holds it"
        elif dtype in _PRECISION_BITS:
            bits = _PRECISION_BITS[dtype]
            reason = (f"the optimizer holds it, but it is {dtype}, whose {bits} significant bits round away an update "
                      f"smaller than about 1/{2 ** bits:,} of a value: keep float32 master weights (train in float32 "
                      "under autocast) or use a larger learning rate")
        else:
            reason = "the optimizer holds it but did not change it"
        evidence: dict[str, Any] = {"grad_norm": grad_norm, "steps": list(steps), "in_optimizer": in_optimizer}
        if dtype is not None:
            evidence["dtype"] = dtype
        if zero_lr_group is not None:
            evidence.update({"optimizer": zero_lr_group[0], "param_group": zero_lr_group[1],
                             "lr": tiny_lr.lr if tiny_lr is not None else 0.0})
        return make(FindingCode.NOT_UPDATING, path,
                    f"{path} receives gradients (norm {grad_norm:.3g}) but its value did not change over the last "
                    f"{len(steps)} observed optimizer steps: {reason}. A gradient only proves autograd reached it.",
                    evidence=evidence, seen=Seen(step), fix=fix)
