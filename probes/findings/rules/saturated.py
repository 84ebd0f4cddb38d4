"""`saturated`: a tanh- or sigmoid-like output stuck in its flat tails."""

from __future__ import annotations

from ...schema import FindingCode, Severity, display_path
from ..finding import Finding, Seen, make
from .base import Reads, Rule


class Saturated(Rule):
    code = FindingCode.SATURATED
    reads = Reads.SAMPLES
    severities = (
        "warning; info for a sigmoid-like output layer (no trained layer runs after it: a confident classifier's "
        "final Sigmoid; never a Tanh, nor anything when no optimizer is watched)")
    meaning = (
        "a tanh/sigmoid-like output with more than half of its values in the saturated tails, reported at the "
        "activation, not at the wrappers returning its output")
    example = "nn.Sequential(nn.Linear(8, 64), nn.Tanh())   # inputs scaled by 100: tanh sits at +-1"

    @staticmethod
    def build(path: str, type_name: str, fraction: float, samples: int, step: int,
              output_layer: bool = False) -> Finding:
        """``output_layer``: no trained layer ran after it (a multi-label classifier's final Sigmoid): a confident
        model, an info."""
        evidence = {"saturated_fraction": fraction, "samples": samples, "type": type_name, "output_layer": output_layer}
        if output_layer:
            return make(FindingCode.SATURATED, path,
                        f"{fraction:.0%} of the outputs of {display_path(path)} ({type_name}), the model's output "
                        "layer (no trained layer runs after it), sit in the saturated tails: the model is confident. "
                        "That stalls nothing under a log-likelihood loss (binary_cross_entropy: its gradient, p - y, "
                        "vanishes only where the prediction is right); under mse_loss the gradient vanishes where it "
                        "is wrong too, and BCEWithLogitsLoss on the logits is the fix.",
                        evidence=evidence, severity=Severity.INFO, seen=Seen(step))
        return make(FindingCode.SATURATED, path,
                    f"{fraction:.0%} of the outputs of {display_path(path)} ({type_name}) sit in the saturated "
                    "tails, where the gradient is nearly zero: learning through it stalls.",
                    evidence=evidence, seen=Seen(step))
