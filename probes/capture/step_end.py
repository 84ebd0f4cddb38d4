"""The end of a sampled step: the norms of the small output gradients (in one batch), the gradients of tensors no
optimizer stepped, the values of computed tensors, the change of tensors no optimizer holds, and the frozen blocks'
running statistics and dropouts."""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch

from ..model import frozen
from ..model.index import ModelIndex
from . import tensor_stats
from .optimizer_step import OptimizerStepMeasure, add_per_tensor
from .record import RetainedNorms, StepRecord, TensorSlot

__all__ = ["StepEnd"]

_GRAD = operator.attrgetter("grad")


class StepEnd:
    """Finishes sampled steps; keeps the plan of the small output gradients' norms while their shapes repeat."""

    def __init__(self) -> None:
        # the shapes of the last sampled step's small output gradients and the plan of their norms
        self._grad_plan: tuple[list[tuple[int, ...]], tensor_stats.NormPlan] | None = None

    def clear(self) -> None:
        self._grad_plan = None

    def finish(self, rec: StepRecord, index: ModelIndex, optimizer_step: OptimizerStepMeasure) -> StepRecord:
        """The end of a sampled step: gradients of tensors no optimizer stepped, and the change of the
        tensors no optimizer holds."""
        small = rec.small_grads               # copies made by gradient hooks during backward (slot -1)
        hooked = len(small)
        grads = [g for g, _ in small]
        shapes: list[tuple[int, ...]] = [g.shape for g in grads]
        kept: list[list[int]] = []
        outputs = rec.retained
        if outputs:
            # the outputs stay in rec.retained until the host copy has started (release_outputs)
            taken = list(map(_GRAD, outputs))
            arrived = [i for i, g in enumerate(taken) if g is not None]
            if len(arrived) == len(taken):
                grads += taken
                kept = rec.retained_sharing
                shapes += rec.retained_shapes   # the outputs', read by the hook (a torch.Size costs ~1 us)
            else:
                grads += [taken[i] for i in arrived]
                kept = [rec.retained_sharing[i] for i in arrived]
                shapes += [rec.retained_shapes[i] for i in arrived]
            rec.retained_sharing, rec.retained_shapes = [], []
        if grads:
            slot = rec.measurements.add(self._output_grad_norms(grads, shapes))
            if hooked:
                out_grads = rec.out_grads
                for mid, slots in out_grads.items():
                    out_grads[mid] = [TensorSlot(slot, s.pos) if s.slot == -1 else s for s in slots]
            if kept:
                rec.retained_norms = RetainedNorms(slot, hooked, kept)
            small.clear()
        gradient_tensors, measured = index.gradient_tensors(), rec.grads.ids()
        # every one measured at an optimizer step: the common case, in one C-level pass
        remaining = [] if measured.issuperset(gradient_tensors) else [t for t in gradient_tensors if t not in measured]
        if remaining:
            optimizer_step.measure_grads(rec, index, remaining)
        computed = index.computed_tensors()
        if computed:                # no .grad of their own (reading it makes torch warn): their values alone
            rest = [t for t in computed if t not in rec.data]
            if rest:
                add_per_tensor(rec, rest, tensor_stats.norms([index.tensor(t) for t in rest]), rec.data)
        if rec.orphan_baseline is not None:
            baseline, rec.orphan_baseline = rec.orphan_baseline, None
            optimizer_step.measure_updates(rec, index, baseline)
        norms = index.running_stat_norms.intersection(rec.ran_training) if rec.stepped else None
        drops: Collection[int] | None = index.random_drops.intersection(rec.ran_training) if rec.stepped else None
        if drops:                  # those run in training mode under no_grad: a frozen teacher's targets, noisy
            drops = [m for m in drops if any(r.training and not r.grad_enabled for r in rec.rows.get(m, ()))]
        if norms or drops:
            sampled = frozen.sample_frozen_blocks(index, norms or (), drops or ())
            if sampled is not None:
                rec.frozen_blocks = frozen.FrozenBlockSample(rec.measurements.add(sampled[0]), sampled[1])
        return rec

    def _output_grad_norms(self, grads: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        """The norms of the step's small output gradients, with the plan of the last sampled step while
        their shapes are the same (the same calls in the same order: planning reads every gradient's
        device, dtype and size, several microseconds each)."""
        last = self._grad_plan
        if last is None or last[0] != shapes:
            last = self._grad_plan = (shapes, tensor_stats.plan_norms(grads, shapes))
        try:
            norms = tensor_stats.norms(grads, last[1])
        except RuntimeError:       # a gradient on another device than last step's: plan again
            last = self._grad_plan = (shapes, tensor_stats.plan_norms(grads, shapes))
            norms = tensor_stats.norms(grads, last[1])
        assert norms is not None
        return norms
