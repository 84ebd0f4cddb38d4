"""`train-step-in-eval-mode`: an optimizer step trained on forwards run in eval mode."""

from __future__ import annotations

from collections.abc import Sequence

from ...schema import FindingCode, display_path
from ..finding import Finding, Links, Seen, make
from .base import Reads, Rule


class TrainStepInEvalMode(Rule):
    code = FindingCode.TRAIN_STEP_IN_EVAL_MODE
    reads = Reads.EVENTS
    severities = "warning (event)"
    meaning = (
        "an optimizer step after a forward in which the mode-sensitive modules were in eval mode and no forward in "
        "training mode (`model.train()` forgotten after validation; an adversarial attack run in eval beside the "
        "training forward, as PGD and TRADES do, is not; a Dropout at p=0 is not mode-sensitive); a consequence of "
        "the `training-mode-mismatch` of a part left in eval that holds those modules; found also when the loop "
        "calls the model's parts only (`model.decoder(model.encoder(x))`, a `training_step` calling submodules): "
        "after a step without a forward of the model, its children's calls are watched as well, as for the two "
        "checks beside it")
    example = "model.eval(); validate(model); train_one_epoch(model)   # model.train() forgotten"

    @staticmethod
    def build(modules: Sequence[str], first_step: int, step: int, count: int) -> Finding:
        return make(FindingCode.TRAIN_STEP_IN_EVAL_MODE, "",
                    f"{count:,} optimizer step{'s' if count != 1 else ''} (first {first_step}, last {step}) trained on "
                    "gradients of forwards run with the model in eval mode, while it holds "
                    f"{len(modules)} Dropout/BatchNorm modules (e.g. " + ", ".join(display_path(n) for n in modules[:3])
                    + "): dropout was off and BatchNorm used frozen running statistics. model.eval() for validation "
                    "was probably never followed by model.train().",
                    evidence={"modules": list(modules[:20]), "steps": count},
                    seen=Seen(step, first_step=first_step, count=count), links=Links(members=tuple(modules)))
