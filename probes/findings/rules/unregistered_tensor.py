"""`unregistered-tensor`: a tensor attribute of a registered module that is neither a Parameter nor a buffer."""

from __future__ import annotations

from ...schema import FindingCode, Severity
from ..finding import Finding, Seen, make
from .base import Explains, Reads, Relation, Rule


class UnregisteredTensor(Rule):
    code = FindingCode.UNREGISTERED_TENSOR
    reads = Reads.STRUCTURE
    severities = "error if `requires_grad`, else warning"
    meaning = "a tensor attribute of a registered module that is neither a Parameter nor a buffer"
    example = "self.scale = torch.ones(64, requires_grad=True)       # not an nn.Parameter"
    explains = (Explains(FindingCode.NOT_UPDATING, Relation.SAME_PATH),
                Explains(FindingCode.GRAD_ACCUMULATING, Relation.SAME_PATH))

    @staticmethod
    def build(path: str, *, is_parameter: bool, requires_grad: bool, shape: list[int] | None,
              dtype: str, device: str, step: int | None) -> Finding:
        what = "an nn.Parameter" if is_parameter else "a plain tensor"
        if requires_grad:
            msg = (f"{path} is {what} with requires_grad=True stored as an ordinary attribute: it gets gradients, "
                   "but the optimizer, state_dict(), .to() and .cuda() never see it.")
        else:
            msg = (f"{path} is a plain tensor attribute, neither a Parameter nor a buffer: .to() does not move it "
                   "and state_dict() does not save it.")
        return make(FindingCode.UNREGISTERED_TENSOR, path, msg,
                    severity=Severity.ERROR if requires_grad else Severity.WARNING,
                    evidence={"shape": shape, "dtype": dtype, "device": device, "requires_grad": requires_grad,
                              "is_parameter": is_parameter}, seen=Seen(step))
