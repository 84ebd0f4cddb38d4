"""`unregistered-tensor`: a tensor attribute of a registered module that is neither a Parameter nor a buffer."""

from __future__ import annotations

from collections.abc import Sequence

from ...schema import FindingCode, Severity
from ..finding import Finding, Seen, make
from .base import Explains, Reads, Relation, Rule


class UnregisteredTensor(Rule):
    code = FindingCode.UNREGISTERED_TENSOR
    reads = Reads.STRUCTURE
    severities = ("error if `requires_grad`; else a warning when it is on another device than the model's parameters "
                  "and buffers (a `.to()` left it behind), an info otherwise (a constant that forward moves where it "
                  "is used, as torchvision's `AnchorGenerator` keeps its cell anchors)")
    meaning = "a tensor attribute of a registered module that is neither a Parameter nor a buffer"
    example = "self.scale = torch.ones(64, requires_grad=True)       # not an nn.Parameter"
    explains = (Explains(FindingCode.NOT_UPDATING, Relation.SAME_PATH),
                Explains(FindingCode.GRAD_ACCUMULATING, Relation.SAME_PATH))

    @staticmethod
    def build(path: str, *, is_parameter: bool, requires_grad: bool, shape: list[int] | None,
              dtype: str, device: str, step: int | None, model_devices: Sequence[str] = ()) -> Finding:
        """``model_devices``: the devices of the model's parameters and buffers; a tensor on none of them was left
        behind by ``.to()``."""
        what = "an nn.Parameter" if is_parameter else "a plain tensor"
        left_behind = bool(model_devices) and device not in model_devices
        if requires_grad:
            severity = Severity.ERROR
            msg = (f"{path} is {what} with requires_grad=True stored as an ordinary attribute: it gets gradients, "
                   "but the optimizer, state_dict(), .to() and .cuda() never see it.")
        elif left_behind:
            severity = Severity.WARNING
            msg = (f"{path} is a plain tensor attribute, neither a Parameter nor a buffer, and it is on {device} while "
                   f"the model is on {', '.join(model_devices)}: .to() did not move it, and state_dict() does not "
                   "save it.")
        else:
            severity = Severity.INFO
            msg = (f"{path} is a plain tensor attribute, neither a Parameter nor a buffer: .to() does not move it "
                   "and state_dict() does not save it. That is fine for a constant that forward moves to where it "
                   "is used (as torchvision's AnchorGenerator does with its cell anchors); model state belongs in "
                   "register_buffer.")
        return make(FindingCode.UNREGISTERED_TENSOR, path, msg, severity=severity,
                    evidence={"shape": shape, "dtype": dtype, "device": device, "requires_grad": requires_grad,
                              "is_parameter": is_parameter, "model_devices": list(model_devices)}, seen=Seen(step))
