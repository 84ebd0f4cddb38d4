"""`train-mode-under-no-grad`: a forward under no_grad while mode-sensitive modules are in training mode
(validation in train mode)."""

from __future__ import annotations

from collections.abc import Sequence

from ...schema import FindingCode, display_path
from ..finding import Finding, Seen, fmt_times, make
from .base import Reads, Rule


class TrainModeUnderNoGrad(Rule):
    code = FindingCode.TRAIN_MODE_UNDER_NO_GRAD
    reads = Reads.EVENTS
    severities = "warning (event)"
    meaning = (
        "a forward under `no_grad`/`inference_mode` while Dropout/BatchNorm modules are in training mode (validation "
        "in train mode); a Dropout at p=0 and a BatchNorm without running statistics are not mode-sensitive, a "
        "drop-path (`DropPath`, `StochasticDepth`) with p > 0 is; in a loop that calls the model's parts, a part no "
        "watched optimizer trains (a frozen or EMA teacher, a frozen text encoder) is neither such a forward nor the "
        "evaluation that ends the finding; not a pass that recomputes BatchNorm statistics (`momentum` None or 1.0: "
        "`swa_utils.update_bn`, PreciseBN)")
    example = "with torch.no_grad(): val_loss = loss_fn(model(x_val), y_val)   # model.eval() forgotten"

    @staticmethod
    def build(modules: Sequence[str], inference_mode: bool, first_step: int, step: int,
              count: int) -> Finding:
        ctx = "inference_mode()" if inference_mode else "no_grad()"
        return make(FindingCode.TRAIN_MODE_UNDER_NO_GRAD, "",
                    f"The model ran forward under {ctx} in training mode {fmt_times(count)} (first in step "
                    f"{first_step}, "
                    f"last in step {step}) while {len(modules)} Dropout/BatchNorm modules were in training mode "
                    "(e.g. " + ", ".join(display_path(n) for n in modules[:3]) + "): validation in train mode "
                    "applies dropout and overwrites BatchNorm running statistics with validation data (a pass that "
                    "guesses labels inside a training step, as MixMatch's, does so on purpose).",
                    evidence={"modules": list(modules[:20]), "modules_in_train_mode": len(modules), "context": ctx,
                              "forwards": count},
                    seen=Seen(step, first_step=first_step, count=count))
