"""`not-updating`: a tensor that receives gradients but whose value does not change across optimizer steps, and every
other way a parameter the optimizer holds does not move (observed by :mod:`probes.findings.not_moving`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ...schema import FindingCode, Severity
from ..finding import Finding, Seen, make
from .base import Reads, Rule

# significant bits of the low-precision floating types a parameter may be kept in
_PRECISION_BITS = {"bfloat16": 8, "float16": 11}


@dataclasses.dataclass(frozen=True)
class RoundedAway:
    """An optimizer step that rounds away: the update of about ``update`` per value (``estimate`` says how it is
    estimated) is below half the spacing of the ``reference`` floating type at the tensor's ``rms``. ``by_lr``: the
    learning rate is why (even a step of about lr per value rounds away); else the optimizer's update of a small
    gradient is (:mod:`probes.findings.update_size`)."""

    lr: float                      # the latest step's
    rms: float
    spacing: float
    reference: str                 # 'float32' | 'float64'
    update: float = 0.0
    grad_rms: float = 0.0
    by_lr: bool = True
    estimate: str = ""

@dataclasses.dataclass(frozen=True)
class Tensors:
    """The tensors one finding names: one (at its path), or several (one finding at the root: every parameter, when
    the gradients are cleared or zeroed for all of them, or more than ``not_moving.GROUP_AT``)."""

    ids: Sequence[int]
    paths: Sequence[str]

    @property
    def path(self) -> str:
        return self.paths[0] if len(self.paths) == 1 else ""

    def subject(self) -> str:
        if len(self.paths) == 1:
            return self.paths[0]
        return (f"{len(self.paths):,} tensors ({', '.join(self.paths[:5])}"
                + (f" and {len(self.paths) - 5:,} more" if len(self.paths) > 5 else "") + ")")

    @property
    def one(self) -> bool:
        return len(self.paths) == 1

    def words(self) -> tuple[str, str, str]:
        """(it, its, is) or (them, their, are)."""
        return ("it", "its", "is") if self.one else ("them", "their", "are")

    def evidence(self) -> dict[str, Any]:
        return {} if len(self.paths) == 1 else {"tensors": list(self.paths[:50]), "n_tensors": len(self.paths)}


def _steps(steps: Sequence[int]) -> str:
    return f"steps {', '.join(str(s) for s in steps)}"


class NotUpdating(Rule):
    code = FindingCode.NOT_UPDATING
    reads = Reads.SAMPLES
    severities = ("error (a warning for a tensor no gradient ever reaches; an info for a zero gradient on a few "
                  "tensors, and for an update below the float32 spacing, a warning when so for every tensor an "
                  "optimizer steps)")
    meaning = (
        "a tensor receives gradients but its value did not change over the last 2 observed optimizer steps; the "
        "message says why when it can: its param group's lr is 0, or so small (a scheduler decayed it) that a step "
        "of lr × max(1, the gradient's rms) per value is below half the spacing of float32 numbers at the tensor's "
        "rms in both steps; for a bfloat16/float16 tensor that its precision rounds the update away; and, for a "
        "tensor an SGD or Adam-like optimizer steps, when the update that optimizer makes of its gradient (SGD: "
        "lr × (the gradient's rms + weight decay × the values'), the step of this gradient; Adam: lr × g / (g + eps), "
        "plus decoupled decay) is below half that spacing in both steps: nothing is broken, it learns more slowly "
        "than float32 can show (a conv's bias before BatchNorm, a branch behind a zero-initialised layer, with SGD "
        "at a small lr), an info. Also, for a "
        "parameter a watched optimizer steps (`probes/findings/not_moving.py`): a gradient arrived but `.grad` is "
        "None at the step in the last 2 observed steps (`zero_grad()` between `backward()` and `step()`); `.grad` "
        "exactly zero at the step in the last 2 after its first (moved by weight decay or momentum alone, or not at "
        "all): an error, one at the root, when so for every tensor of an optimizer (`zero_grad(set_to_none=False)` "
        "misplaced, `clip_grad_norm_` to 0), an info for a few (a hook or mask, a loss that does not depend on it: a "
        "WGAN critic's last bias); no gradient ever and no change in 8 observed steps, a warning (an unused layer; a "
        "consequence of `no-gradient` when it ran); and, at the root, training forwards going on without an "
        "optimizer step (at least 8, and 4× the most a step had: a forgotten `optimizer.step()`, a GradScaler that "
        "skips every step)")
    example = 'opt = torch.optim.SGD([{"params": model.head.parameters(), "lr": 0.0}])   # gradients, no change'

    @staticmethod
    def build(path: str, grad_norm: float, steps: Sequence[int], in_optimizer: bool, step: int,
              zero_lr_group: tuple[int, int] | None = None, dtype: str | None = None,
              tiny_lr: RoundedAway | None = None) -> Finding:
        """``zero_lr_group``: (optimizer, param group) whose learning rate was 0 (or, with ``tiny_lr``, so small that a
        step rounds away) in every one of ``steps``; ``dtype``: the tensor's."""
        fix = None
        if zero_lr_group is not None:
            opt, group = zero_lr_group
            where = f"param group {group}" + (f" of optimizer {opt}" if opt else "")
            if tiny_lr is None:
                reason = f"its {where} has lr=0 in every one of them, so no optimizer step can move it"
            else:
                reason = (f"its {where}'s lr is {tiny_lr.lr:.1e} (a scheduler decayed it?): an optimizer step of about "
                          f"lr per value (Adam's; SGD's is lr x the gradient) is below half the spacing of "
                          f"{tiny_lr.reference} numbers at the tensor's values (rms {tiny_lr.rms:.2g}: spacing "
                          f"{tiny_lr.spacing:.2g}), so every step rounds away")
                fix = ("Check the learning-rate schedule: a StepLR/ExponentialLR stepped every batch instead of every "
                       "epoch divides lr by its factor every step_size batches; give it a floor (eta_min, min_lr) well "
                       "above 1e-7 of the weights' size, or step it per epoch.")
        elif not in_optimizer:
            reason = "no watched optimizer holds it"
        elif dtype in _PRECISION_BITS:
            bits = _PRECISION_BITS[dtype]
            reason = (f"the optimizer holds it, but it is {dtype}, whose {bits} significant bits round away an update "
                      f"smaller than about 1/{2 ** bits:,} of a value: keep float32 master weights (train in float32 "
                      "under autocast) or use a larger learning rate")
        else:
            reason = "the optimizer holds it but did not change it"
        evidence: dict[str, Any] = {"grad_norm": grad_norm, "steps": list(steps), "in_optimizer": in_optimizer}
        if dtype is not None:
            evidence["dtype"] = dtype
        if zero_lr_group is not None:
            evidence.update({"optimizer": zero_lr_group[0], "param_group": zero_lr_group[1],
                             "lr": tiny_lr.lr if tiny_lr is not None else 0.0})
        return make(FindingCode.NOT_UPDATING, path,
                    f"{path} receives gradients (norm {grad_norm:.3g}) but its value did not change over the last "
                    f"{len(steps)} observed optimizer steps: {reason}. A gradient only proves autograd reached it.",
                    evidence=evidence, seen=Seen(step), fix=fix)

    @staticmethod
    def below_spacing(path: str, grad_norm: float, steps: Sequence[int], group: tuple[int, int], dtype: str,
                      rounded: RoundedAway, step: int, every: bool) -> Finding:
        """The optimizer stepped it, and its update (``rounded``, not ``by_lr``) is below half the spacing of its
        numbers in every one of ``steps``: an info; a warning when ``every`` tensor its optimizer steps that a
        gradient reached is so (nothing of the model learns)."""
        r, (opt, param_group) = rounded, group
        where = f"param group {param_group}" + (f" of optimizer {opt}" if opt else "")
        every_text = (" So is every tensor its optimizer steps that a gradient reached: the model does not learn "
                      "at this lr (a loss scaled far down, an lr far too small for SGD)." if every else "")
        return make(FindingCode.NOT_UPDATING, path,
                    f"{path} receives gradients (norm {grad_norm:.3g}) and the optimizer steps it, but its value did "
                    f"not change over the last {len(steps)} observed optimizer steps: its update is below the "
                    f"{r.reference} spacing at its values. An update of about {r.update:.2g} per value ({r.estimate}; "
                    f"lr {r.lr:.1e} of its {where}, the gradient's rms {r.grad_rms:.2g}) is below half the spacing of "
                    f"{r.reference} numbers at its values (rms {r.rms:.2g}: spacing {r.spacing:.2g}), so each step "
                    f"rounds to the same value. Nothing is broken: it learns more slowly than {r.reference} can "
                    "show. A gradient this small comes from a bias before a normalisation that removes it (a conv's "
                    "bias before BatchNorm) or a branch behind a zero-initialised layer (ControlNet's zero "
                    f"convolutions) early in training.{every_text}",
                    evidence={"grad_norm": grad_norm, "steps": list(steps), "in_optimizer": True, "dtype": dtype,
                              "optimizer": opt, "param_group": param_group, "lr": r.lr,
                              "reason": "below-spacing", "update_per_value": r.update, "spacing": r.spacing,
                              "rms": r.rms, "grad_rms": r.grad_rms, "reference": r.reference,
                              "estimate": r.estimate, "every_tensor": every},
                    severity=Severity.WARNING if every else Severity.INFO, seen=Seen(step),
                    fix="Nothing needs fixing if it may learn slowly. To make it move: drop a bias a normalisation "
                        "removes (bias=False before BatchNorm); give its param group a larger lr, or use Adam/AdamW, "
                        "whose step is about lr per value whatever the gradient's size.")

    @staticmethod
    def zero_gradient(what: Tensors, steps: Sequence[int], moved: bool, step: int, every: bool) -> Finding:
        """``every``: of the tensors a gradient reached, all have a zero gradient (something in the loop zeroes them:
        an error); else these only (a hook or mask on them, or a loss that does not depend on them, such as a WGAN
        critic's last bias under a difference of means: an info)."""
        it, its, is_ = what.words()
        how = (f"{it} moves only by weight decay or momentum, never by what {it} learns" if moved
               else f"so the optimizer never moves {it}")
        return make(FindingCode.NOT_UPDATING, what.path,
                    f"{what.subject()} {is_} held by the optimizer and gradients reach {it}, but {its} .grad is "
                    f"exactly zero at the optimizer step ({_steps(steps)}): {how}. Something zeroes the gradient "
                    "between the loss and the step: a gradient hook or mask, clip_grad_norm_ with max_norm=0, "
                    "optimizer.zero_grad(set_to_none=False) called between backward() and step(), or a loss that "
                    "does not depend on it (multiplied by zero; a bias a difference of means cancels, as a WGAN "
                    "critic's last one).",
                    evidence={"steps": list(steps), "grad_norm": 0.0, "moved_by_decay_or_momentum": moved,
                              "in_optimizer": True, "reason": "zero-gradient", "every_tensor": every,
                              **what.evidence()},
                    severity=None if every else Severity.INFO, seen=Seen(step),
                    fix="Find what zeroes the gradient: call optimizer.zero_grad() before backward(), not between "
                        "backward() and step(); give clip_grad_norm_ a max_norm above 0; remove the hook or mask; if "
                        "it is meant to stay fixed, set requires_grad_(False) and leave it out of the optimizer.")

    @staticmethod
    def gradient_cleared(what: Tensors, steps: Sequence[int], step: int) -> Finding:
        it, its, _ = what.words()
        return make(FindingCode.NOT_UPDATING, what.path,
                    f"{what.subject()}: gradients reach {it} in backward(), but {its} .grad is None when the "
                    f"optimizer steps ({_steps(steps)}), so the optimizer skips {it} and {its} values never change: "
                    "something clears the gradients between backward() and step() (optimizer.zero_grad() or "
                    "model.zero_grad() called after backward(), or .grad set to None).",
                    evidence={"steps": list(steps), "in_optimizer": True, "reason": "gradient-cleared",
                              **what.evidence()},
                    seen=Seen(step),
                    fix="Call optimizer.zero_grad() before backward() (or after step()), never between backward() "
                        "and step().")

    @staticmethod
    def no_gradient_at_all(what: Tensors, quiet: int, group: tuple[int, int] | None, step: int) -> Finding:
        evidence: dict[str, Any] = {"observed_steps": quiet, "in_optimizer": True, "reason": "no-gradient",
                                    **what.evidence()}
        if group is not None:
            evidence.update(optimizer=group[0], param_group=group[1])
        it, its, is_ = what.words()
        return make(FindingCode.NOT_UPDATING, what.path,
                    f"{what.subject()} {is_} held by the optimizer and require{'s' if what.one else ''} grad, but no "
                    f"gradient has reached {it} in any of the {quiet} optimizer steps observed, and {its} values "
                    "never changed: it takes no part in the loss (a layer built but never called in forward, an "
                    "output the loss does not use, an expert the router never picks).",
                    evidence=evidence, severity=Severity.WARNING, seen=Seen(step),
                    fix="Use the layer in forward, or remove it (and leave it out of the optimizer); if it is meant "
                        "to stay fixed, set requires_grad_(False). DistributedDataParallel needs "
                        "find_unused_parameters=True for a parameter no loss uses.")

    @staticmethod
    def stalled_optimizer(forwards: int, most_per_step: int, since_step: int) -> Finding:
        """The watched optimizers have not stepped for ``forwards`` training forwards of the model since step
        ``since_step`` began (``most_per_step``: the most forwards a finished step had)."""
        last = f"since step {since_step - 1} ended" if since_step > 0 else "since the watch began"
        had = f" (a step had at most {most_per_step} before)" if most_per_step else ""
        return make(FindingCode.NOT_UPDATING, "",
                    f"The model ran {forwards:,} training forwards{had} {last} without an optimizer step: no "
                    "parameter moves. optimizer.step() is not called: forgotten, or a GradScaler skips every step "
                    "because the gradients are inf or NaN each time (scaler.step(optimizer) does not call "
                    "optimizer.step() then).",
                    evidence={"forwards": forwards, "most_forwards_per_step": most_per_step, "since_step": since_step,
                              "reason": "optimizer-stalled"},
                    seen=Seen(since_step),
                    fix="Call optimizer.step() after backward() (scaler.step(optimizer) with a GradScaler); when a "
                        "GradScaler skips every step, find the inf/NaN in the loss or the gradients "
                        "(scaler.get_scale() falls step after step; torch.autograd.detect_anomaly() names the "
                        "operation).")
