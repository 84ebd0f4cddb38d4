"""`dead-layer`: a layer whose output units (nearly) never activate, or whose output is constant."""

from __future__ import annotations

from typing import Any

from ...schema import FindingCode, display_path
from ..finding import Finding, Links, Seen, make
from .base import Explains, Reads, Relation, Rule

_ORDINALS = ("first", "second", "third", "fourth")


def of_calls(call: tuple[int, int] | None) -> str:
    """`` in the first of its 2 calls a step`` for a module called several times a step (``call``: the call judged,
    0 for the first, and its calls a step), whose calls are judged apart; nothing for one called once."""
    if call is None:
        return ""
    k, n = call
    which = _ORDINALS[k] if k < len(_ORDINALS) else f"call {k + 1}"
    return f" in the {which} of its {n} calls a step"


def with_dead_input(message: str, evidence: dict[str, Any], dead_input: tuple[str, str] | None
                ) -> tuple[str, dict[str, Any], str | None]:
    """``dead_input``: (the module whose dead output is this one's input, the first dead layer of the chain): the
    message says so, the evidence names both, and the fix is the first dead layer's."""
    if dead_input is None:
        return message, evidence, None
    given, first = (display_path(p) for p in dead_input)
    message += (f" Its input, the output of {given} before it, is dead too: this follows from the dead layer at "
                f"{first}" if given != first else f" Its input, the output of {given} before it, is dead: this "
                "follows from that dead layer")
    return (message + ".", {**evidence, "dead_input": dead_input[0], "dead_upstream": dead_input[1]},
            f"Fix the dead layer at {first} (its own finding says how): this module only passes its dead output "
            "on.")


class DeadLayer(Rule):
    code = FindingCode.DEAD_LAYER
    reads = Reads.SAMPLES
    severities = "error"
    meaning = (
        "≥ 90% of the output units never activate over the window, or the output is constant; judged at the "
        "innermost module (not again at the blocks returning its very output), at a dropout module in training only "
        "when the chance that a live unit's values were all dropped over the window (p to the power of its values "
        "per unit; per channel or sample for `Dropout2d`/drop-path) is below 1e-6 (in eval mode a dropout is the "
        "identity, judged as any module), and not when the module before it is flagged: the units that die upstream "
        "are reported at the activation that kills them; its units are judged only once its outputs held 16 values "
        "per unit over the window (a Squeeze-and-Excitation ReLU on pooled features holds one a sample), 64 for a "
        "module skipped in some sampled steps of the window (a mixture-of-experts expert the router did not pick); a "
        "constant output (no spread in any sample, and the same value in every one: a zero-initialised gate, as "
        "NFNet's or a ControlNet's, moves as it learns) needs 16 values per unit over 3 or more calls, whichever "
        "steps they were in, and one of a single value per call the same value over 16 calls (a loss module's changes "
        "every step); a module called several times a step (one ReLU after a block's first conv and again after its "
        "residual add) is judged call by call, and the finding names the call, while its dead units are those dead "
        "in every call (RAFT's motion encoder meets a zero flow in its first call only); a module "
        "dead or constant because its input is (the module that ended just before it started, in the latest sampled "
        "step's execution order, through a dropout, is dead or constant) is a consequence of the first dead layer of "
        "that chain, whose fix it shows")
    example = "nn.Sequential(nn.Linear(8, 64), nn.ReLU())   # with a bias initialised to -10: every unit stays at zero"
    explains = (Explains(FindingCode.DEAD_LAYER, Relation.POINTS_AT),
                Explains(FindingCode.DEAD_UNITS, Relation.POINTS_AT))

    @staticmethod
    def constant(path: str, type_name: str, mean: float | None, samples: int, evidence: dict[str, Any],
                 step: int, dead_input: tuple[str, str] | None = None, call: tuple[int, int] | None = None) -> Finding:
        msg, evidence, fix = with_dead_input(
            f"The output of {display_path(path)} ({type_name}){of_calls(call)} is constant ({mean!r}) in every one "
            f"of the last {samples} samples: it carries no information and passes no useful gradient.", evidence,
            dead_input)
        return make(FindingCode.DEAD_LAYER, path, msg, evidence=evidence, seen=Seen(step), fix=fix,
                    links=Links(related=dead_input[1] if dead_input else None))

    @staticmethod
    def build(path: str, type_name: str, dead: float, samples: int, evidence: dict[str, Any],
              step: int, dead_input: tuple[str, str] | None = None, call: tuple[int, int] | None = None) -> Finding:
        msg, evidence, fix = with_dead_input(
            f"{dead:.0%} of the units of {display_path(path)} ({type_name}){of_calls(call)} never activated (always "
            f"zero) over the last {samples} sampled steps: the layer is dead and its inputs get no gradient through "
            "it.", evidence, dead_input)
        return make(FindingCode.DEAD_LAYER, path, msg, evidence=evidence, seen=Seen(step), fix=fix,
                    links=Links(related=dead_input[1] if dead_input else None))
