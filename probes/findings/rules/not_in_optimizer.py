"""`not-in-optimizer`: a trainable registered parameter that no watched optimizer holds."""

from __future__ import annotations

import dataclasses

from ...schema import FindingCode, Severity
from ..finding import Finding, Seen, make
from .base import Explains, Reads, Relation, Rule


class NotInOptimizer(Rule):
    code = FindingCode.NOT_IN_OPTIMIZER
    reads = Reads.STRUCTURE
    severities = "error"
    meaning = (
        "a registered parameter with `requires_grad=True` that no param group of the watched optimizer(s) holds "
        "(identity); not inside an averaged copy (torch's `AveragedModel`, timm's `ModelEma`: an EMA that "
        "`update_parameters()` updates); an info once the 2 sampled training steps since it appeared showed that no "
        "gradient reaches it (none arrived and its `.grad` is unset, which a gradient of an unsampled step would "
        "have set; a teacher or a frozen feature extractor run under `no_grad` with `requires_grad` left True), an "
        "error again if one does")
    example = "opt = torch.optim.AdamW(model.parameters()); model.head = nn.Linear(64, 10)   # the new head: no opt"
    explains = (Explains(FindingCode.NOT_UPDATING, Relation.SAME_PATH),
                Explains(FindingCode.GRAD_ACCUMULATING, Relation.SAME_PATH),
                Explains(FindingCode.STALE_OPTIMIZER_PARAM, Relation.POINTS_AT))

    @staticmethod
    def build(path: str, shape: list[int] | None, numel: int, step: int | None) -> Finding:
        return make(FindingCode.NOT_IN_OPTIMIZER, path,
                    f"{path} requires grad, but no param group of the watched optimizer(s) holds it (membership is "
                    "by object identity): its gradient is computed, but optimizer.step() never updates it and "
                    "zero_grad() never clears it.", evidence={"shape": shape, "numel": numel}, seen=Seen(step))

    @staticmethod
    def unreached(found: Finding, samples: int) -> Finding:
        """``not-in-optimizer`` of a tensor no gradient reached in ``samples`` sampled training steps: it runs under
        no_grad or detached (a frozen feature extractor, a target network, a teacher), so nothing trains it and
        nothing accumulates in it; an info (an error again once a gradient reaches it)."""
        path = found.path
        return dataclasses.replace(
            found, severity=str(Severity.INFO),
            message=f"{path} requires grad and no param group of the watched optimizer(s) holds it, but no gradient "
                    f"has reached it in the {samples:,} sampled training steps since it appeared, and its .grad is "
                    "unset (it runs under no_grad or detached: a frozen feature extractor, a target network, a "
                    "teacher): nothing trains it, as intended if it is frozen.",
            fix="Say it is frozen: requires_grad_(False) on it (or on its module). If it should train, the graph to "
                "the loss is cut (a .detach() or torch.no_grad()), and the optimizer must hold it too.",
            evidence={**found.evidence, "gradient_reached": False, "sampled_training_steps": samples})
