"""`dead-units`: a layer a part of whose units never activate."""

from __future__ import annotations

from typing import Any

from ...schema import FindingCode, display_path
from ..finding import Finding, Links, Seen, make
from .base import Reads, Rule
from .dead_layer import of_calls, with_dead_input


class DeadUnits(Rule):
    code = FindingCode.DEAD_UNITS
    reads = Reads.SAMPLES
    severities = "warning"
    meaning = "25% to 90% of the units never activate over the window (as `dead-layer`)"
    example = "nn.Sequential(nn.Linear(8, 64), nn.ReLU())   # a large learning rate pushed half of the units below 0"

    @staticmethod
    def build(path: str, type_name: str, dead: float, samples: int, evidence: dict[str, Any],
              step: int, dead_input: tuple[str, str] | None = None, call: tuple[int, int] | None = None) -> Finding:
        msg, evidence, fix = with_dead_input(
            f"{dead:.0%} of the units of {display_path(path)} ({type_name}){of_calls(call)} never activated over the "
            f"last {samples} sampled steps: capacity is wasted.", evidence, dead_input)
        return make(FindingCode.DEAD_UNITS, path, msg, evidence=evidence, seen=Seen(step), fix=fix,
                    links=Links(related=dead_input[1] if dead_input else None))
