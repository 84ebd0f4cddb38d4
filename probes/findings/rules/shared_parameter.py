"""`shared-parameter`: one Parameter under several names."""

from __future__ import annotations

from collections.abc import Sequence

from ...schema import FindingCode
from ..finding import Finding, Seen, make
from .base import Reads, Rule


class SharedParameter(Rule):
    code = FindingCode.SHARED_PARAMETER
    reads = Reads.STRUCTURE
    severities = "info"
    meaning = "one Parameter reachable under several names (tied weights)"
    example = "model.lm_head.weight = model.embed.weight              # tied weights"

    @staticmethod
    def build(path: str, aliases: Sequence[str], shape: list[int] | None, step: int | None) -> Finding:
        return make(FindingCode.SHARED_PARAMETER, path,
                    f"{path} is the same Parameter as {', '.join(aliases)} (tied weights).",
                    evidence={"aliases": list(aliases), "shape": shape}, seen=Seen(step))
