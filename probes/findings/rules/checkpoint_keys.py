"""`checkpoint-keys`: a ``load_state_dict()`` of the watched model that left keys of the model unloaded or keys of the
state dict unused (what ``strict=False`` returns and nothing shows). Observed by :mod:`probes.findings.checkpoint_keys`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ...schema import FindingCode, KeyPrefix, Severity
from ..finding import Finding, Seen, make
from .base import Reads, Rule

SHOWN = 5            # keys named in the message
KEPT = 50            # keys kept in the evidence


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What one load_state_dict() left out, by the model's own tensors."""

    missing: tuple[str, ...]             # keys the model needs that the state dict lacked (tied names excluded)
    trained: tuple[str, ...]             # of which parameters that require grad
    unexpected: tuple[str, ...]          # keys of the state dict the model has no place for
    tied: tuple[str, ...]                # missing names of tensors that loaded under another (tied) name
    prefix: KeyPrefix | None

    @property
    def complete(self) -> bool:
        return not self.missing and not self.unexpected


def _names(keys: Sequence[str]) -> str:
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN:,} more" if len(keys) > SHOWN else "")


class CheckpointKeys(Rule):
    code = FindingCode.CHECKPOINT_KEYS
    reads = Reads.CHECKPOINT
    severities = (
        "error (event) when trained weights are missing; a warning for buffers, frozen parameters or unused keys "
        "alone")
    meaning = (
        "a `load_state_dict()` of the watched model (or of a wrapper around it) left keys of the model unloaded or "
        "keys of the file unused (`strict=False`, or a strict load whose error was caught), named with the prefix "
        "that explains them and its fix ([checkpoints.md](checkpoints.md)); it stays until a later load leaves "
        "nothing out")
    example = "model.load_state_dict(torch.load('ddp.pt'), strict=False)   # every key starts with 'module.'"

    @staticmethod
    def build(result: LoadResult, step: int, first_step: int, count: int) -> Finding:
        """``count`` loads since ``first_step`` left something out; ``result`` is the latest's."""
        parts = []
        if result.missing:
            held = (f"{len(result.trained):,} of them trained parameters that keep the values they had (their "
                    "initialisation, unless loaded before) while the rest of the model is the checkpoint's"
                    if result.trained else "buffers or frozen parameters that keep the values they had")
            parts.append(f"left {len(result.missing):,} keys of the model unloaded ({held}: {_names(result.missing)})")
        if result.unexpected:
            parts.append(f"did not use {len(result.unexpected):,} keys of the state dict "
                         f"({_names(result.unexpected)})")
        message = f"load_state_dict() at step {step} " + " and ".join(parts) + "."
        fix = None
        if result.prefix is not None:
            message += f" A prefix explains it: {result.prefix.describe()}."
            fix = f"Fix the prefix, then load with strict=True: {result.prefix.fix()}."
        if count > 1:
            message += f" ({count} such loads since step {first_step}.)"
        evidence: dict[str, Any] = {
            "missing": list(result.missing[:KEPT]), "n_missing": len(result.missing),
            "trained_missing": list(result.trained[:KEPT]), "n_trained_missing": len(result.trained),
            "unexpected": list(result.unexpected[:KEPT]), "n_unexpected": len(result.unexpected),
            "tied": list(result.tied[:KEPT])}
        if result.prefix is not None:
            evidence.update(prefix=result.prefix.prefix, prefix_in_file=result.prefix.in_file)
        return make(FindingCode.CHECKPOINT_KEYS, "", message, evidence,
                    severity=Severity.ERROR if result.trained else Severity.WARNING,
                    seen=Seen(step, first_step=first_step, count=count), fix=fix)
