"""Parameters that do not move, beyond the plain ``not-updating`` rule (a gradient arrives, the optimizer step leaves
the value unchanged: detectors.py). Every way a training loop leaves a parameter the optimizer holds without a
learning update is a ``not-updating`` finding that says which way:

- **zero gradient**: ``.grad`` is exactly zero at the optimizer step (after a gradient arrived) in the last
  NOT_UPDATING_STEPS observed steps, none of them the first a tensor was observed in (a zero-initialised gate, as
  LoRA's B or adaLN-Zero, gives zero gradients in the first step only). Weight decay or momentum may still move it
  (AdamW's decay, SGD's velocity): it does not learn, and the message says it moves by those alone. An error, one
  finding, when it is so of (nearly, EVERY) all the tensors of an optimizer a gradient reached: the loop zeroes them
  (``zero_grad(set_to_none=False)`` between ``backward()`` and ``step()``, ``clip_grad_norm_`` with ``max_norm=0``);
  an info for a few: a hook or mask on them, or a loss that does not depend on them (a WGAN critic's last bias,
  which a difference of means cancels).
- **gradient cleared**: a gradient arrived in ``backward()`` but ``.grad`` is None at the step, so the optimizer
  skips it (``zero_grad()`` between ``backward()`` and ``step()``), in the last NOT_UPDATING_STEPS observed steps.
  An error (one finding for all of an optimizer's tensors, as above).
- **no gradient at all**: the optimizer holds it and it requires grad, but no gradient ever reached it and its
  value never changed, in at least QUIET_STEPS observed optimizer steps: an unused layer, a branch the loss does
  not use, an expert the router never picks (an expert picked now and then is not). A warning (a parameter in no
  loss harms nothing but time and memory; DistributedDataParallel refuses it unless ``find_unused_parameters=True``);
  a module that ran without a gradient reaching it is ``no-gradient``, its cause.
- **the optimizer stopped stepping**: forwards and backward passes go on, ``optimizer.step()`` is not called
  (forgotten, or a GradScaler that skips every step: its gradients are inf/NaN each time, and ``scaler.step()``
  then does not call ``optimizer.step()``): see :func:`stalled_optimizer`. An error at the root.

Frozen parameters (``requires_grad=False``) an optimizer still holds are ``frozen-parameter`` (an info that says
the optimizer holds them); a parameter replaced after the optimizer was built (or an optimizer built on a copy of the
model) is ``not-in-optimizer`` with ``stale-optimizer-param``; a tensor that receives gradients and that no optimizer
holds is ``not-in-optimizer`` or ``unregistered-tensor``, with ``not-updating`` as their consequence.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .findings import Finding, make
from .schema import FindingCode, Severity

EVERY = 0.9                   # this share of the tensors a gradient reached: every one (the loop's doing)
REACHED = -(2 ** 30)          # a tensor a gradient reached once: never "no gradient at all"
GROUP_AT = 10                 # more tensors than this flagged by one rule are one finding at the root
QUIET_STEPS = 8               # observed optimizer steps without a gradient or a change before "no gradient at all"
# forwards of the model since the last optimizer step before it is called stalled: at least STALLED_FORWARDS, and
# STALLED_FACTOR times the most a finished step had (gradient accumulation runs several per step)
STALLED_FORWARDS = 8
STALLED_FACTOR = 4


class UpdateWindow(Protocol):
    """The detectors' window of observed optimizer steps (detectors._Window)."""

    count: torch.Tensor

    def last(self, field: str, back: int = 0) -> torch.Tensor: ...


class TensorView(Protocol):
    @property
    def trained_tensors(self) -> frozenset[int]: ...

    def tensor_known(self, tensor_id: int) -> bool: ...
    def tensor_path(self, tensor_id: int) -> str: ...
    def tensor_group(self, tensor_id: int) -> tuple[int, int] | None: ...


def quiet_steps(arrived: torch.Tensor, update: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Observed optimizer steps without a gradient arriving or the value changing, since the tensor was first observed
    (REACHED, far below zero, once either happened)."""
    return torch.where((arrived == 0) & (update == 0), before + 1, torch.full_like(before, REACHED))


def not_moving(w: UpdateWindow, quiet: torch.Tensor, view: TensorView, step: int, n: int,
               flagged: Callable[[int], bool]) -> list[Finding]:
    """The findings of the rules above, over the last ``n`` observed optimizer steps; ``flagged``: a tensor the plain
    rule reported already."""
    if not w.count.numel():
        return []
    zero = w.count >= n + 1                 # never the first observed step
    cleared = w.count >= n
    for k in range(n):
        arrived, held, grad, update = w.last("arrived", k) == 1, w.last("held", k) == 1, w.last("grad", k), \
            w.last("update", k)
        zero &= arrived & held & (grad == 0)
        cleared &= arrived & ~held & (update == 0)
    trained = view.trained_tensors

    def judged(mask: torch.Tensor) -> list[int]:
        ids = mask.nonzero().flatten().tolist()
        return [t for t in ids if t in trained and view.tensor_known(t) and not flagged(t)]

    def steps_of(tid: int) -> list[int]:
        return [int(w.last("step", k)[tid]) for k in reversed(range(n))]
    # per optimizer, the trained tensors a gradient reached in the latest observed step: a rule that holds for (nearly)
    # all of them is the loop's doing (zero_grad() or clipping between backward() and step()), one finding
    zeroed, skipped = judged(zero), judged(cleared)
    reached = Counter(_optimizer(view, t) for t in judged(w.last("arrived", 0) == 1)) if zeroed or skipped \
        else Counter()
    moved = {t: any(float(w.last("update", k)[t]) > 0 for k in range(n)) for t in zeroed}
    out = []
    for every, group in _by_coverage(zeroed, reached, view):
        out.append(zero_gradient(group, steps_of(group.ids[0]), any(moved[t] for t in group.ids), step, every))
    out += [gradient_cleared(group, steps_of(group.ids[0]), step) for _, group in _by_coverage(skipped, reached, view)]
    if quiet.numel():
        out += [no_gradient_at_all(group, min(int(quiet[t]) for t in group.ids), view.tensor_group(group.ids[0]),
                                   step) for group in _groups(judged(quiet >= QUIET_STEPS), view)]
    return out


def _optimizer(view: TensorView, tid: int) -> int | None:
    group = view.tensor_group(tid)
    return group[0] if group is not None else None


def _by_coverage(ids: Sequence[int], reached: Counter[int | None], view: TensorView) -> list[tuple[bool, Tensors]]:
    """``ids`` as the findings that name them: (True, all of them) per optimizer for which they are EVERY of the
    tensors a gradient reached (more than one: at the root), and (False, the others) one by one (or more than
    GROUP_AT at the root)."""
    by_opt: dict[int | None, list[int]] = {}
    for t in ids:
        by_opt.setdefault(_optimizer(view, t), []).append(t)
    out: list[tuple[bool, Tensors]] = []
    rest: list[int] = []
    for opt, tids in by_opt.items():
        if len(tids) >= EVERY * reached.get(opt, 0):
            out.append((True, Tensors(tids, [view.tensor_path(t) for t in tids])))
        else:
            rest += tids
    return out + [(False, group) for group in _groups(rest, view)]


@dataclasses.dataclass(frozen=True)
class Tensors:
    """The tensors one finding names: one (at its path), or more than GROUP_AT (one finding at the root: every
    parameter, when the gradients are cleared or zeroed for all of them)."""

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


def _groups(ids: Sequence[int], view: TensorView) -> list[Tensors]:
    if len(ids) > GROUP_AT:
        return [Tensors(ids, [view.tensor_path(t) for t in ids])]
    return [Tensors([t], [view.tensor_path(t)]) for t in ids]


def _steps(steps: Sequence[int]) -> str:
    return f"steps {', '.join(str(s) for s in steps)}"


def zero_gradient(what: Tensors, steps: Sequence[int], moved: bool, step: int, every: bool) -> Finding:
    """``every``: of the tensors a gradient reached, all have a zero gradient (something in the loop zeroes them: an
    error); else these only (a hook or mask on them, or a loss that does not depend on them, such as a WGAN critic's
    last bias under a difference of means: an info)."""
    it, its, is_ = what.words()
    how = (f"{it} moves only by weight decay or momentum, never by what {it} learns" if moved
           else f"so the optimizer never moves {it}")
    return make(FindingCode.NOT_UPDATING, what.path,
                f"{what.subject()} {is_} held by the optimizer and gradients reach {it}, but {its} .grad is exactly "
                f"zero at the optimizer step ({_steps(steps)}): {how}. Something zeroes the gradient between the "
                "loss and the step: a gradient hook or mask, clip_grad_norm_ with max_norm=0, "
                "optimizer.zero_grad(set_to_none=False) called between backward() and step(), or a loss that does "
                "not depend on it (multiplied by zero; a bias a difference of means cancels, as a WGAN critic's "
                "last one).",
                evidence={"steps": list(steps), "grad_norm": 0.0, "moved_by_decay_or_momentum": moved,
                          "in_optimizer": True, "reason": "zero-gradient", "every_tensor": every, **what.evidence()},
                severity=None if every else Severity.INFO, step=step,
                fix="Find what zeroes the gradient: call optimizer.zero_grad() before backward(), not between "
                    "backward() and step(); give clip_grad_norm_ a max_norm above 0; remove the hook or mask; if it "
                    "is meant to stay fixed, set requires_grad_(False) and leave it out of the optimizer.")


def gradient_cleared(what: Tensors, steps: Sequence[int], step: int) -> Finding:
    it, its, _ = what.words()
    return make(FindingCode.NOT_UPDATING, what.path,
                f"{what.subject()}: gradients reach {it} in backward(), but {its} .grad is None when the optimizer "
                f"steps ({_steps(steps)}), so the optimizer skips {it} and {its} values never change: something "
                "clears the gradients between backward() and step() (optimizer.zero_grad() or model.zero_grad() "
                "called after backward(), or .grad set to None).",
                evidence={"steps": list(steps), "in_optimizer": True, "reason": "gradient-cleared", **what.evidence()},
                step=step,
                fix="Call optimizer.zero_grad() before backward() (or after step()), never between backward() and "
                    "step().")


def no_gradient_at_all(what: Tensors, quiet: int, group: tuple[int, int] | None, step: int) -> Finding:
    evidence: dict[str, Any] = {"observed_steps": quiet, "in_optimizer": True, "reason": "no-gradient",
                                **what.evidence()}
    if group is not None:
        evidence.update(optimizer=group[0], param_group=group[1])
    it, its, is_ = what.words()
    return make(FindingCode.NOT_UPDATING, what.path,
                f"{what.subject()} {is_} held by the optimizer and require{'s' if what.one else ''} grad, but no "
                f"gradient has reached {it} in any of the {quiet} optimizer steps observed, and {its} values never "
                "changed: it takes no part in the loss (a layer built but never called in forward, an output the loss "
                "does not use, an expert the router never picks).",
                evidence=evidence, severity=Severity.WARNING, step=step,
                fix="Use the layer in forward, or remove it (and leave it out of the optimizer); if it is meant to "
                    "stay fixed, set requires_grad_(False). DistributedDataParallel needs find_unused_parameters=True "
                    "for a parameter no loss uses.")


def stalled_optimizer(forwards: int, most_per_step: int, since_step: int) -> Finding:
    """The watched optimizers have not stepped for ``forwards`` training forwards of the model since step
    ``since_step`` began (``most_per_step``: the most forwards a finished step had)."""
    last = f"since step {since_step - 1} ended" if since_step > 0 else "since the watch began"
    had = f" (a step had at most {most_per_step} before)" if most_per_step else ""
    return make(FindingCode.NOT_UPDATING, "",
                f"The model ran {forwards:,} training forwards{had} {last} without an optimizer step: no parameter "
                "moves. optimizer.step() is not called: forgotten, or a GradScaler skips every step because the "
                "gradients are inf or NaN each time (scaler.step(optimizer) does not call optimizer.step() then).",
                evidence={"forwards": forwards, "most_forwards_per_step": most_per_step, "since_step": since_step,
                          "reason": "optimizer-stalled"},
                step=since_step,
                fix="Call optimizer.step() after backward() (scaler.step(optimizer) with a GradScaler); when a "
                    "GradScaler skips every step, find the inf/NaN in the loss or the gradients (scaler.get_scale() "
                    "falls step after step; torch.autograd.detect_anomaly() names the operation).")


def stalled(forwards: int, most_per_step: int) -> bool:
    return forwards >= STALLED_FORWARDS and forwards > STALLED_FACTOR * most_per_step
