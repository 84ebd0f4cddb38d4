"""`non-finite`: naN or Inf values in an activation, a gradient or the loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...schema import FindingCode, Severity, display_path
from ..finding import Finding, Seen, make
from .base import Reads, Rule


@dataclasses.dataclass(frozen=True)
class NonFiniteOrigin:
    """Where an episode of non-finite values began: the first module in execution order of its first
    step (activation), the first gradient (gradient), or the loss of an unsampled step (loss)."""

    kind: str                      # 'activation' | 'gradient' | 'loss'
    path: str                      # where it is drawn: the module ('' for the loss)
    step: int
    values: int = 0                # NaN/Inf count of the origin (activation)
    affected: tuple[str, ...] = ()
    tensor: str = ""               # gradient: the tensor
    values_text: str = "NaN"       # loss: its value
    masking: bool = False          # activation: -inf alone, finite gradients, and no NaN or Inf since


class NonFinite(Rule):
    code = FindingCode.NON_FINITE
    reads = Reads.EVENTS
    severities = (
        "error (event); info for `-inf` alone with finite gradients (masking: `masked_fill(mask, float('-inf'))` "
        "before a softmax or a loss), an error again once NaN or Inf follow")
    meaning = (
        "NaN/Inf in an activation or gradient; the path is the first module, in execution order, that produced it; "
        "one finding per episode")
    example = "torch.log(x - x.max())   # log(0) = -inf in forward, NaN in the gradients after it"

    @staticmethod
    def build(origin: NonFiniteOrigin, *, last_step: int, count: int, later: Sequence[str]) -> Finding:
        """The first non-finite values of an episode, at their origin; ``later``: what later steps added."""
        first = origin.step
        if origin.kind == "activation" and origin.masking:
            what = (f"{display_path(origin.path)} produced {origin.values:,} -inf values in step {first}, and no "
                    "NaN or +inf, with finite gradients: masking (masked_fill(mask, float('-inf')) before a softmax "
                    "or a loss), harmless while no NaN or Inf follow")
        elif origin.kind == "activation":
            what = (f"{display_path(origin.path)} produced {origin.values:,} NaN/Inf values in step {first}, the first "
                    f"module in execution order to do so ({len(origin.affected)} modules affected)")
        elif origin.kind == "gradient":
            what = (f"The gradient of {origin.tensor} was NaN/Inf in step {first} ({len(origin.affected)} tensors "
                    "affected)")
        else:
            what = f"The loss was {origin.values_text} in step {first}, a step whose modules were not sampled"
        went_on = "-inf values went on" if origin.masking else "non-finite values went on"
        tail = f"; {went_on} until step {last_step} ({count:,} observations)" if last_step != first else ""
        return make(FindingCode.NON_FINITE, origin.path, what + tail + ".",
                    evidence={"kind": origin.kind, "first_step": first, "nonfinite": origin.values,
                              "modules_affected" if origin.kind == "activation" else "affected": len(origin.affected),
                              "first_modules" if origin.kind == "activation" else "first": list(origin.affected[:5]),
                              "later": list(later[:5]), "masking": origin.masking},
                    severity=Severity.INFO if origin.masking else None,
                    seen=Seen(last_step, first_step=first, count=count))
