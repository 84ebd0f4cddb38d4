"""`stale-optimizer-param`: an optimizer entry that is no longer part of the model."""

from __future__ import annotations

from ...schema import FindingCode
from ..finding import Finding, Links, Seen, make
from .base import Reads, Rule


class StaleOptimizerParam(Rule):
    code = FindingCode.STALE_OPTIMIZER_PARAM
    reads = Reads.STRUCTURE
    severities = "warning"
    meaning = "an optimizer holds a tensor that is not part of the model (a head swapped after the optimizer was built)"
    example = "opt = torch.optim.SGD(model.parameters(), lr=0.1); model.head = nn.Linear(64, 10)   # steps the old one"

    @staticmethod
    def build(where: str, shape: list[int] | None, opt_index: int, group: int, index: int,
              looks_like: str | None, step: int | None) -> Finding:
        hint = (f" It has the shape of {looks_like}, which the optimizer does not hold: the module was probably "
                "replaced after the optimizer was built.") if looks_like else ""
        return make(FindingCode.STALE_OPTIMIZER_PARAM, where,
                    f"The optimizer holds a tensor of shape {shape} that is not part of the model: it updates a "
                    f"tensor the model no longer uses.{hint}",
                    evidence={"optimizer": opt_index, "group": group, "index": index, "shape": shape,
                              "replaced": looks_like}, seen=Seen(step), links=Links(related=looks_like))
