"""`frozen-parameter`: registered parameters that do not require gradients."""

from __future__ import annotations

from collections.abc import Sequence

from ...schema import FindingCode, display_path
from ..finding import Finding, Seen, fmt_size, make
from .base import Reads, Rule


class FrozenParameter(Rule):
    code = FindingCode.FROZEN_PARAMETER
    reads = Reads.STRUCTURE
    severities = "info"
    meaning = (
        "registered parameters with `requires_grad=False`: one info per frozen module (the highest whose registered "
        "parameters are all frozen and none of whose tensors trains: `backbone: 23.5M parameters in 161 tensors, all "
        "requires_grad=False`), one per frozen tensor of a module that trains (a frozen bias); more than 10 of those "
        "(LoRA around every projection) are one info at the root that counts them")
    example = "model.backbone.requires_grad_(False)"

    @staticmethod
    def build(path: str, shape: list[int] | None, in_optimizer: bool, step: int | None) -> Finding:
        return make(FindingCode.FROZEN_PARAMETER, path,
                    f"{path} has requires_grad=False: it is saved and moved, and no gradient trains it while it stays "
                    "so.",
                    evidence={"shape": shape, "in_optimizer": in_optimizer}, seen=Seen(step))

    @staticmethod
    def module(path: str, type_name: str, n_tensors: int, numel: int, in_optimizer: int,
               step: int | None) -> Finding:
        """A subtree whose registered parameters are all frozen (a frozen backbone): one info, not one per tensor."""
        held = (f" ({in_optimizer:,} of them held by an optimizer, which skips them)" if in_optimizer else "")
        return make(FindingCode.FROZEN_PARAMETER, path,
                    f"{display_path(path)} ({type_name}): {fmt_size(numel)} parameters in {n_tensors:,} tensor"
                    f"{'s' if n_tensors != 1 else ''}, all requires_grad=False{held}: saved and moved, and no gradient "
                    "trains them while they stay so.",
                    evidence={"tensors": n_tensors, "parameters": numel, "tensors_in_optimizer": in_optimizer,
                              "type": type_name}, seen=Seen(step))

    @staticmethod
    def many(names: Sequence[str], n_modules: int, n_tensors: int, numel: int, in_optimizer: int,
             step: int | None) -> Finding:
        """Many frozen subtrees and tensors (LoRA around every projection of an LLM): one info at the root."""
        more = f" and {len(names) - 5:,} more" if len(names) > 5 else ""
        shown = ", ".join(display_path(n) for n in names[:5]) + more
        return make(FindingCode.FROZEN_PARAMETER, "",
                    f"{fmt_size(numel)} parameters in {n_tensors:,} tensors have requires_grad=False, in {n_modules:,} "
                    f"frozen modules and {len(names) - n_modules:,} frozen tensors of modules that train ({shown}): "
                    "saved and moved, and no gradient trains them while they stay so (a frozen base around adapters, "
                    "as LoRA's).",
                    evidence={"tensors": n_tensors, "parameters": numel, "tensors_in_optimizer": in_optimizer,
                              "modules": n_modules, "examples": list(names[:50])}, seen=Seen(step))
