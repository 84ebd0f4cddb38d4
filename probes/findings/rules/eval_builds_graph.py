"""`eval-builds-graph`: a forward in eval mode that records an autograd graph nobody backpropagates."""

from __future__ import annotations

from ...schema import FindingCode
from ..finding import Finding, Seen, fmt_times, make
from .base import Reads, Rule


class EvalBuildsGraph(Rule):
    code = FindingCode.EVAL_BUILDS_GRAPH
    reads = Reads.EVENTS
    severities = "info (event)"
    meaning = (
        "a forward in eval mode with grad enabled whose graph nobody backpropagates (validation without "
        "`torch.no_grad()`: memory and time for nothing)")
    example = "model.eval(); val_loss = loss_fn(model(x_val), y_val)   # no torch.no_grad(): a graph nobody uses"

    @staticmethod
    def build(count: int, numel: int, first_step: int, step: int) -> Finding:
        return make(FindingCode.EVAL_BUILDS_GRAPH, "",
                    f"The model ran forward in eval mode with gradients enabled {fmt_times(count)} (first in step "
                    f"{first_step}, last in step {step}) and the output ({numel:,} values) was never backpropagated: "
                    "autograd recorded a graph, and kept the activations it needs, for nothing.",
                    evidence={"forwards": count, "output_numel": numel},
                    seen=Seen(step, first_step=first_step, count=count))
