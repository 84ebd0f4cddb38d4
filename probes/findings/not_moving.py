"""Parameters that do not move. Every way a training loop leaves a parameter without a learning update is a
``not-updating`` finding that says which way (built by :class:`probes.findings.rules.NotUpdating`):

- **unchanged**: a gradient arrives and the optimizer step leaves the value unchanged (the plain rule, whose window
  is detectors.py's): see :func:`unchanged`. Its param group's lr is 0, or so small that an update of about lr per
  value rounds away (a scheduler decayed it); no optimizer holds it; it is bfloat16/float16, whose precision rounds
  the update away (each an error); or the update its optimizer makes of a small gradient is below half the spacing
  of its float32 numbers (:mod:`probes.findings.update_size`): stepped, not broken, an info (a warning when so of
  every tensor of the optimizer a gradient reached). Otherwise an error that says the optimizer did not change it.

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
  then does not call ``optimizer.step()``): see :class:`StalledOptimizer`. An error at the root.

Frozen parameters (``requires_grad=False``) an optimizer still holds are ``frozen-parameter`` (an info that says
the optimizer holds them); a parameter replaced after the optimizer was built (or an optimizer built on a copy of the
model) is ``not-in-optimizer`` with ``stale-optimizer-param``; a tensor that receives gradients and that no optimizer
holds is ``not-in-optimizer`` or ``unregistered-tensor``, with ``not-updating`` as their consequence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from . import update_size
from .finding import Finding
from .rules.not_updating import NotUpdating, RoundedAway, Tensors
from .update_size import UpdateRule

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


class _TensorNode(Protocol):
    @property
    def dtype(self) -> str: ...
    @property
    def numel(self) -> int: ...


class TensorView(Protocol):
    @property
    def trained_tensors(self) -> frozenset[int]: ...
    @property
    def tensors(self) -> Mapping[int, _TensorNode]: ...

    def tensor_in_optimizer(self, tensor_id: int) -> bool: ...

    def tensor_known(self, tensor_id: int) -> bool: ...
    def tensor_path(self, tensor_id: int) -> str: ...
    def tensor_group(self, tensor_id: int) -> tuple[int, int] | None: ...


def quiet_steps(arrived: torch.Tensor, update: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Observed optimizer steps without a gradient arriving or the value changing, since the tensor was first observed
    (REACHED, far below zero, once either happened)."""
    return torch.where((arrived == 0) & (update == 0), before + 1, torch.full_like(before, REACHED))


# the types whose own precision rounds an update away (their message says so), not the float32 spacing
_LOW_PRECISION = ("bfloat16", "float16")


def unchanged(w: UpdateWindow, ids: Sequence[int], view: TensorView, step: int, n: int,
              rules: Callable[[tuple[int, int]], UpdateRule | None]) -> list[Finding]:
    """The plain rule's findings: ``ids`` received a gradient and did not change in the last ``n`` observed optimizer
    steps; ``rules``: the update rule of a param group (optimizer, group), from its settings."""
    out: list[Finding] = []
    below: list[tuple[int, RoundedAway, tuple[int, int]]] = []
    for tid in ids:
        # a learning rate of 0 in every one of the steps (not a warmup's single first step) says why
        lrs = [float(w.last("lr", k)[tid]) for k in range(n)]
        zero_lr = all(lr == 0.0 for lr in lrs)
        node, group = view.tensors.get(tid), view.tensor_group(tid)
        rounded = None
        if not zero_lr and node is not None:
            rounded = update_size.rounded_away(lrs, [float(w.last("grad", k)[tid]) for k in range(n)],
                                               [float(w.last("data", k)[tid]) for k in range(n)],
                                               [int(w.last("step", k)[tid]) + 1 for k in range(n)], node.numel,
                                               node.dtype, rules(group) if group is not None else None)
        if rounded is not None and not rounded.by_lr:      # the optimizer's update of a small gradient
            if group is not None and node is not None and node.dtype not in _LOW_PRECISION:
                below.append((tid, rounded, group))
                continue
            rounded = None
        out.append(NotUpdating.build(view.tensor_path(tid), float(w.last("grad")[tid]), _step_list(w, tid, n),
                                     view.tensor_in_optimizer(tid), step, group if zero_lr or rounded else None,
                                     node.dtype if node is not None else None, tiny_lr=rounded))
    if below:
        reached = Counter(_optimizer(view, t) for t in (w.last("arrived") == 1).nonzero().flatten().tolist()
                          if t in view.trained_tensors and view.tensor_known(t))
        per_opt = Counter(group[0] for _, _, group in below)
        out += [NotUpdating.below_spacing(
                    view.tensor_path(tid), float(w.last("grad")[tid]), _step_list(w, tid, n), group,
                    view.tensors[tid].dtype, rounded, step,
                    every=per_opt[group[0]] > 1 and per_opt[group[0]] >= EVERY * reached.get(group[0], 0))
                for tid, rounded, group in below]
    return out


def _step_list(w: UpdateWindow, tid: int, n: int) -> list[int]:
    return [int(w.last("step", k)[tid]) for k in reversed(range(n))]


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
    out = [NotUpdating.zero_gradient(group, steps_of(group.ids[0]), any(moved[t] for t in group.ids), step, every)
           for every, group in _by_coverage(zeroed, reached, view)]
    out += [NotUpdating.gradient_cleared(group, steps_of(group.ids[0]), step)
            for _, group in _by_coverage(skipped, reached, view)]
    if quiet.numel():
        out += [NotUpdating.no_gradient_at_all(group, min(int(quiet[t]) for t in group.ids),
                                               view.tensor_group(group.ids[0]), step)
                for group in _groups(judged(quiet >= QUIET_STEPS), view)]
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


def _groups(ids: Sequence[int], view: TensorView) -> list[Tensors]:
    if len(ids) > GROUP_AT:
        return [Tensors(ids, [view.tensor_path(t) for t in ids])]
    return [Tensors([t], [view.tensor_path(t)]) for t in ids]


def stalled(forwards: int, most_per_step: int) -> bool:
    return forwards >= STALLED_FORWARDS and forwards > STALLED_FACTOR * most_per_step


class StalledOptimizer:
    """Forwards go on and the watched optimizers do not step: said at once (the watcher publishes it), resolved when a
    step ends. The loop must say its steps go on (``w.step()`` called twice since the last optimizer step), unless no
    step ever ended: forwards in training mode after the last step may be an evaluation. Said again as the count of
    forwards doubles."""

    def __init__(self) -> None:
        self.most_forwards = 0          # the most training forwards a finished step had
        self.reports = 0                # w.step() calls since the last step ended
        self.finding: Finding | None = None

    def findings(self) -> list[Finding]:
        return [self.finding] if self.finding is not None else []

    def check(self, forwards: int, step: int) -> bool:
        """``forwards``: training forwards of the model since step ``step`` began. Whether the finding is new."""
        if self.reports < 2 and step > 0:
            return False
        said = self.finding
        if not stalled(forwards, self.most_forwards) or (said is not None and forwards < 2 * said.evidence["forwards"]):
            return False
        self.finding = NotUpdating.stalled_optimizer(forwards, self.most_forwards, step)
        return True

    def step_ended(self, forwards: int) -> bool:
        """A step ended after ``forwards`` training forwards: the optimizer steps again. Whether a finding went."""
        self.most_forwards = max(self.most_forwards, forwards)
        self.reports = 0
        resolved, self.finding = self.finding is not None, None
        return resolved
