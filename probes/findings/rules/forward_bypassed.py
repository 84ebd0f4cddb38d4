"""`forward-bypassed`: parameters that got gradients in a step their module was never called through __call__."""

from __future__ import annotations

from collections.abc import Sequence

from ...schema import FindingCode, Severity
from ..finding import Finding, Seen, make
from .base import Reads, Rule


class ForwardBypassed(Rule):
    code = FindingCode.FORWARD_BYPASSED
    reads = Reads.EVENTS
    severities = (
        "warning (event; info for a leaf module whose weights the module around it reads itself, a functional call as "
        "torchvision's Swin attention makes with `qkv.weight`, and for an `nn.Embedding` table read directly, as "
        "DETR's queries or sliced position tables are)")
    meaning = (
        "a module's parameters got gradients in a step in which it was never called through `__call__`: its "
        "`.forward()` was called directly (certain when its children ran without it), or, for a leaf module, its "
        "weight was read directly; a module with no forward of its own (`ParameterList`, `ParameterDict`, a holder "
        "of stacked expert weights) never is, nor the model itself (a loop that calls its parts reads its own "
        "tensors directly, as CLIP's `logit_scale`)")
    example = "h = self.block.forward(x)   # instead of self.block(x): its hooks never run"

    @staticmethod
    def build(module_path: str, tensor_path: str, modules: Sequence[str], first_step: int, step: int,
              count: int, forward_called: bool = True, by_design: str = "") -> Finding:
        """``forward_called``: the module's children were called and it was not, so its .forward() was called
        directly. Otherwise (a leaf module) its parameters may as well have been read directly; for an embedding table
        that is usually by design (DETR's query embeddings, a position table sliced in forward): an info."""
        seen = f"seen in {count:,} sampled step{'s' if count != 1 else ''} since step {first_step}"
        if forward_called:
            how = "someone called .forward() directly, so hooks (pruning masks, probes, FSDP) never ran"
        else:
            how = ("its .forward() was called directly or its parameters were read directly (module.weight, a "
                   "functional call), so its hooks (pruning masks, probes, FSDP's unsharding) did not run")
            if by_design == "table":
                how += "; expected for a table kept to hold its weight"
            elif by_design == "read-by-parent":
                how += ("; the module around it was called, so its forward most likely read the weights itself (a "
                        "functional call such as F.linear(x, self.qkv.weight), as torchvision's Swin attention does): "
                        "by design unless you rely on hooks of this module")
        return make(FindingCode.FORWARD_BYPASSED, module_path,
                    f"{tensor_path} received a gradient in step {step}, but its module {modules[0]} was never called "
                    f"through __call__ in that step: {how} ({seen}).",
                    evidence={"parameter": tensor_path, "modules": list(modules), "forward_called": forward_called,
                              "by_design": by_design or None},
                    severity=Severity.INFO if by_design else None,
                    seen=Seen(step, first_step=first_step, count=count))
