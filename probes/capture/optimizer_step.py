"""The optimizer-step measure of a sampled step: gradient and data norms once gradients are final, the learning
rates, and the change each optimizer step made (a sampled baseline before it, compared after), plus the replicas'
fingerprints. Everything is launched on the device and lands in the step's measurements
(:class:`probes.capture.record.StepRecord`); nothing is read on the host here."""

from __future__ import annotations

import torch

from ..model import tensors
from ..model.index import ModelIndex
from ..schema import TensorKind
from . import tensor_stats
from .record import IndexTensors, PerTensor, StepRecord, TensorSlot, UpdateBaseline

__all__ = ["OptimizerStepMeasure", "add_per_tensor"]


class OptimizerStepMeasure:
    """Measures around each watched optimizer's step, into the step's record. Keeps, per model index, the tensors
    of the index's lists and the plan of their norms, and the sampler of updates."""

    def __init__(self) -> None:
        self.updates = tensor_stats.UpdateSampler()
        self._index_tensors: dict[int, IndexTensors] = {}   # id(list of the index) -> its tensors (this index)

    def forget_index(self) -> None:
        """A new index: its lists are other objects (a module id may now name another module)."""
        self._index_tensors.clear()

    def clear(self) -> None:
        self.updates.clear()
        self._index_tensors.clear()

    def before(self, rec: StepRecord, index: ModelIndex, opt_index: int, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are final: their norms, the learning rates (schedulers change them every step), and
        the update baseline of this optimizer's tensors."""
        if opt_index in rec.baselines or opt_index in rec.stepped:
            return       # said already this step (a closure evaluated again: its first evaluation's gradients count)
        if not rec.orphans_checked and not rec.updates:
            # tensors no optimizer holds: their change across this step proves (non-)updates
            rec.orphans_checked = True
            orphans = index.orphan_tensors()
            if orphans:
                self.measure_grads(rec, index, orphans, self.tensors_of(index, orphans))
                rec.orphan_baseline = UpdateBaseline(orphans, self.updates.take([index.tensor(t) for t in orphans]))
        tids = index.optimizer_tensors(opt_index)
        if not tids:
            return
        known = self.tensors_of(index, tids)
        group_lrs = [_group_lr(rec, g.get("lr")) for g in optimizer.param_groups]
        numbers = [None if isinstance(lr, TensorSlot) else lr for lr in group_lrs]
        n_groups = len(group_lrs)
        groups = [g if g is not None and g < n_groups else None
                  for g in (known.opt_groups if known is not None else [index.tensors[t].opt_group for t in tids])]
        rec.lrs.update(zip(tids, [None if g is None else numbers[g] for g in groups], strict=True))
        if None in numbers:           # some held on a device, or not a number: those on a device come with the copy
            rec.device_lrs.update((t, lr) for t, g in zip(tids, groups, strict=True)
                                  if g is not None and isinstance(lr := group_lrs[g], TensorSlot))
        self.measure_grads(rec, index, tids, known)
        rec.baselines[opt_index] = UpdateBaseline(tids, self.updates.take(
            known.tensors if known is not None else [index.tensor(t) for t in tids]))
        tables = index.optimizer_tables(opt_index)
        if tables:
            touched = tensor_stats.touched_rows([index.tensor(t) for t in tables])
            if touched is not None:
                rec.touched[opt_index] = touched

    def tensors_of(self, index: ModelIndex, ids: list[int]) -> IndexTensors | None:
        """The tensors of one of the index's own lists of ids (the same list object every step), read once
        per index; None where some are DTensors (their local shards are read each time)."""
        known = self._index_tensors.get(id(ids))
        if known is not None and known.ids is ids:
            return known
        nodes = [index.tensors[t] for t in ids]
        if any(n.tensor is None or type(n.tensor).__name__ == "DTensor" for n in nodes):
            return None
        tensors = [n.tensor for n in nodes if n.tensor is not None]
        known = self._index_tensors[id(ids)] = IndexTensors(ids, tensors, [n.opt_group for n in nodes],
                                                            tensor_stats.plan_norms(tensors))
        return known

    def after(self, rec: StepRecord, index: ModelIndex, opt_index: int) -> None:
        rec.stepped.add(opt_index)
        baseline = rec.baselines.pop(opt_index, None)
        if baseline is not None:
            self.measure_updates(rec, index, baseline)
        touched = rec.touched.pop(opt_index, None)
        if touched is not None:
            tables = index.optimizer_tables(opt_index)
            changes = tensor_stats.touched_changes([index.tensor(t) for t in tables], touched)
            rec.table_updates.add(rec.measurements.add(changes), [tables[i] for i in touched.taken])

    def measure_fingerprints(self, rec: StepRecord, index: ModelIndex) -> None:
        """At the step's first forward (after DDP has broadcast the buffers): a fingerprint of every
        parameter and buffer, and the data norm of the buffers (the parameters' comes at the optimizer step)."""
        tids = index.fingerprint_tensors()
        for group in _by_device(index, tids):
            add_per_tensor(rec, group, tensor_stats.fingerprints([index.tensor(t) for t in group]),
                            rec.fingerprints)
        buffers = [t for t in tids if index.tensors[t].kind == TensorKind.BUFFER]
        if buffers:
            add_per_tensor(rec, buffers, tensor_stats.norms([index.tensor(t) for t in buffers]), rec.data)

    def measure_grads(self, rec: StepRecord, index: ModelIndex, tensor_ids: list[int],
                      known: IndexTensors | None = None) -> None:
        """Gradient and data norms of the tensors not measured yet this step; ``known``: the tensors of
        ``tensor_ids`` when it is one of the index's own lists (:meth:`tensors_of`)."""
        if known is not None and not any(t in rec.grads or t in rec.data for t in tensor_ids):
            current = [p.grad for p in known.tensors]
            complete = not any(g is None or g.is_sparse for g in current)     # all there: their parameters' plan
            try:
                grad_norms = tensor_stats.norms(current, known.plan) if complete else None  # type: ignore[arg-type]
                data_norms = tensor_stats.norms(known.tensors, known.plan)
            except RuntimeError:       # a shape changed in place (p.data = a tensor of another shape): plan again
                self._index_tensors.pop(id(tensor_ids), None)
            else:
                if complete:
                    add_per_tensor(rec, tensor_ids, grad_norms, rec.grads)
                else:
                    with_grad = [t for t, g in zip(tensor_ids, current, strict=True)
                                 if g is not None and not g.is_sparse]
                    if with_grad:
                        add_per_tensor(rec, with_grad, tensor_stats.norms(
                            [g for g in current if g is not None and not g.is_sparse]), rec.grads)
                add_per_tensor(rec, tensor_ids, data_norms, rec.data)
                return
        have = [t for t in tensor_ids if t not in rec.grads]
        grads = {t: index.grad(t) for t in have}
        with_grad = [t for t in have if grads[t] is not None]
        if with_grad:
            add_per_tensor(rec, with_grad, tensor_stats.norms([grads[t] for t in with_grad]),  # type: ignore[misc]
                            rec.grads)
        rest = [t for t in have if t not in rec.data]
        if rest:
            add_per_tensor(rec, rest, tensor_stats.norms([index.tensor(t) for t in rest]), rec.data)

    def measure_updates(self, rec: StepRecord, index: ModelIndex, baseline: UpdateBaseline) -> None:
        """Sampled change across the step, plus the data norm after it (which catches a change the
        sample missed)."""
        tids = baseline.tensor_ids
        known = self._index_tensors.get(id(tids))
        after = known.tensors if known is not None and known.ids is tids else [index.tensor(t) for t in tids]
        vec = self.updates.delta_norms(after, baseline.taken)
        if vec is None:
            return
        rec.updates.add(rec.measurements.add(vec), tids)
        if tensors.reads_free(vec.device):
            # reading it costs no sync: the full-tensor check only where the sample saw no change
            check = torch.nonzero(vec == 0).flatten().tolist()
        else:
            check = list(range(len(tids)))
        if check:
            post = tensor_stats.norms([after[pos] for pos in check])
            assert post is not None
            rec.post.add(rec.measurements.add(post), [tids[pos] for pos in check])


def _group_lr(rec: StepRecord, lr: object) -> float | TensorSlot | None:
    """A param group's learning rate as a number, or, when it is a tensor on a device whose reads cost a sync, a
    copy of it added to the step's measurements (a scheduler may change it in place before the copy starts)."""
    if isinstance(lr, torch.Tensor) and lr.numel() == 1 and not tensors.reads_free(lr.device):
        return TensorSlot(rec.measurements.add(lr.detach().reshape(1).float().clone()), 0)
    return tensors.host_number(lr)


def _by_device(index: ModelIndex, tensor_ids: list[int]) -> list[list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for tid in tensor_ids:
        groups.setdefault(index.tensor(tid).device, []).append(tid)
    return list(groups.values())


def add_per_tensor(rec: StepRecord, tensor_ids: list[int], vec: torch.Tensor | None, into: PerTensor) -> None:
    """One device vector with a value per tensor: where each tensor's value will be."""
    assert vec is not None
    into.add(rec.measurements.add(vec), tensor_ids)
