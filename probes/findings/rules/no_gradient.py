"""`no-gradient`: a layer that ran in the training forward but whose parameters get no gradient."""

from __future__ import annotations

from collections.abc import Sequence

from ...schema import FindingCode, display_path
from ..finding import Finding, Links, Seen, make
from .base import Explains, Reads, Relation, Rule


class NoGradient(Rule):
    code = FindingCode.NO_GRADIENT
    reads = Reads.EVENTS
    severities = "warning (event)"
    meaning = (
        "a layer ran in the training forward, but no gradient reached its parameters, which the optimizer holds and "
        "which require grad, in 2 sampled steps in which its optimizer stepped (a step in which only another "
        "optimizer stepped, as a WGAN critic's, does not count): the graph to the loss is cut (a `.detach()`, "
        "`torch.no_grad()` inside `forward`, a reentrant checkpoint whose inputs do not require grad, an output the "
        "loss does not use); the rest of the model trains, the loss falls")
    example = "with torch.no_grad(): h = self.encoder(x)   # inside forward: the encoder trains on nothing"
    explains = (Explains(FindingCode.NOT_UPDATING, Relation.NAMED_BY),)

    @staticmethod
    def build(module_path: str, tensor_paths: Sequence[str], first_step: int, step: int, count: int) -> Finding:
        names = ", ".join(tensor_paths[:5]) + (f" and {len(tensor_paths) - 5:,} more" if len(tensor_paths) > 5 else "")
        return make(FindingCode.NO_GRADIENT, module_path,
                    f"{display_path(module_path)} ran in the training forward, but no gradient reached "
                    f"{names}, which the optimizer holds and which require grad: its output does not reach the loss, "
                    f"so the optimizer never changes them (in {count:,} sampled steps since step {first_step}).",
                    evidence={"tensors": list(tensor_paths[:50]), "n_tensors": len(tensor_paths)},
                    seen=Seen(step, first_step=first_step, count=count), links=Links(members=tuple(tensor_paths)))
