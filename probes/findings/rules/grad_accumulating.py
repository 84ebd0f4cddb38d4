"""`grad-accumulating`: gradients that are never zeroed between steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...schema import FindingCode
from ..finding import Finding, Seen, make
from .base import Reads, Rule


class GradAccumulating(Rule):
    code = FindingCode.GRAD_ACCUMULATING
    reads = Reads.SAMPLES
    severities = "warning"
    meaning = (
        "a tensor's `.grad` still holds the previous step's gradient when the step's first backward adds to it, in 2 "
        "sampled steps (unless something zeroes it before `step()`, its optimizer steps with the running sum); when "
        "that is so of ≥ 90% of the tensors an optimizer holds that got gradients (`optimizer.zero_grad()` not "
        "called after its step), one finding at the root says so, none per tensor; gradient accumulation (zeroed "
        "after each optimizer step) is not, nor a tensor zeroed before a later backward of the same step (a GAN "
        "trained generator first: its backward reaches the discriminator before `opt_d.zero_grad()`)")
    example = "loss.backward(); opt.step()   # optimizer.zero_grad() never called"

    @staticmethod
    def build(path: str, stale_norms: Sequence[float | None], grad_norms: Sequence[float | None],
              step: int, optimizer: int | None = None, zeroed: int | None = None,
              judged: int | None = None) -> Finding:
        """``optimizer``: the watched optimizer holding the tensor (None: none does). A tensor no optimizer holds grows
        a buffer nobody uses; one an optimizer holds is stepped with the growing sum unless something zeroes it before
        the step. ``zeroed`` of the ``judged`` tensors that optimizer holds that got gradients in as many sampled steps
        did not accumulate (None: not known; fewer than 90% of them accumulate, or the finding would be at the root)."""
        evidence: dict[str, Any] = {"stale_grad_norms": list(stale_norms), "grad_norms": list(grad_norms)}
        before = f"norm before the new one: {stale_norms[-1]:.3g}"
        if optimizer is None:
            return make(FindingCode.GRAD_ACCUMULATING, path,
                        f"{path}.grad was not zeroed between steps: each backward adds to the previous gradient "
                        f"({before}), so it grows for the whole run and holds a gradient buffer nobody uses (no "
                        "watched optimizer holds the tensor, so optimizer.zero_grad() never reaches it).",
                        evidence={**evidence, "in_optimizer": False}, seen=Seen(step),
                        fix="Register the tensor (nn.Parameter in a registered module, nn.ModuleList) and give it to "
                            "the optimizer, so that optimizer.zero_grad() reaches it; or zero it yourself every step "
                            "(model.zero_grad()).")
        if zeroed is not None and judged is not None:
            others = (f"{zeroed:,} of the {judged:,} tensors it holds that got gradients are zeroed between steps: "
                      "whatever zeroes them misses this one.")
            evidence.update({"tensors_zeroed": zeroed, "tensors_with_gradients": judged})
        else:
            others = "Whatever zeroes some of the other tensors it holds misses this one."
        return make(FindingCode.GRAD_ACCUMULATING, path,
                    f"{path}.grad still held the previous step's gradient when this step's first backward added to it "
                    f"({before}), in each of the last sampled steps: unless something zeroes it before step(), the "
                    f"optimizer that holds it steps with that growing sum instead of the step's gradient. {others}",
                    evidence={**evidence, "in_optimizer": True, "optimizer": optimizer}, seen=Seen(step),
                    fix="Zero it once per optimizer step, after optimizer.step(): optimizer.zero_grad() reaches every "
                        "tensor the optimizer holds (a zero_grad() of part of the model does not).")

    @staticmethod
    def never_zeroed(optimizers: Sequence[int], n_optimizers: int, tensors: Sequence[str], judged: int,
                     step: int) -> Finding:
        """(Nearly) every tensor that each of ``optimizers`` holds and that got gradients (``judged`` of them)
        accumulated its gradient (``tensors``): nothing zeroes them between the optimizer's step and the next step's
        first backward. Judged at that backward: zero_grad() may still run before the optimizer's own step (a GAN's
        discriminator zeroed right before its backward, after the generator's backward went through it), so the
        consequence is conditional. One finding at the root, not one per tensor."""
        if n_optimizers <= 1:
            who = "the optimizer"
        elif len(optimizers) == 1:
            who = f"optimizer {optimizers[0]}"
        else:
            who = "optimizers " + ", ".join(str(o) for o in optimizers)
        n = len(tensors)
        every = f"all {judged:,}" if n == judged else f"{n:,} of the {judged:,}"
        shown = ", ".join(tensors[:3]) + (f" and {n - 3:,} more" if n > 3 else "")
        return make(FindingCode.GRAD_ACCUMULATING, "",
                    f"The gradients {who} steps with are not zeroed before the next step's first backward: {every} "
                    f"tensors it holds that got gradients ({shown}) still held the previous step's gradient when this "
                    "step's first backward added to it, in each of the last sampled steps. Unless zero_grad() runs "
                    f"before each step() of {who} (a GAN's discriminator zeroed right before its own backward), they "
                    "are never zeroed: every backward adds to the sum of all before it, and each optimizer.step() "
                    "follows the running sum of the run's gradients instead of the step's.",
                    evidence={"optimizers": list(optimizers), "tensors": n, "tensors_with_gradients": judged,
                              "examples": list(tensors[:20])},
                    seen=Seen(step),
                    fix="Call optimizer.zero_grad() (or model.zero_grad()) every step, after optimizer.step() (with "
                        "gradient accumulation: after each optimizer step, so that the micro-batches' gradients add up "
                        "in between); if it already runs before this optimizer's own backward, zeroing right after "
                        "step() as well keeps another loss's backward from leaving gradients in it.")
