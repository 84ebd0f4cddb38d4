"""What a sampled step holds: the hooks it attached (:class:`StepHooks`, removed at ``detach``) and what it
observed (:class:`StepRecord`: where each value is among the step's device measurements, and the modes modules ran
in), read by :mod:`probes.capture.decode` and the finding rules through these named fields."""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..model import frozen
from ..model.index import ModelIndex
from ..model.runtime import ForwardSightings
from . import measure, tensor_stats
from .hooks import Removable

__all__ = ["MAX_CALLS_MEASURED", "CallRecord", "GradHookDict", "IndexTensors", "OutputKey", "PerTensor",
           "RetainedNorms", "StepHooks", "StepRecord", "TensorSlot", "UpdateBaseline", "release_outputs"]

MAX_CALLS_MEASURED = 4          # calls of one module measured per step (all are counted)
GradHookDict = dict[int, Callable[[torch.Tensor], Any]]     # a tensor's _backward_hooks
OutputKey = tuple[int, int, int, tuple[int, ...]]       # id, _version, data_ptr, shape of a module output
UpdateTaken = list[tuple[list[int], torch.Tensor, tuple[int, ...]]]   # tensor_stats.UpdateSampler.take()


class CallRecord(NamedTuple):
    """One measured call of a module: where its statistics are, and the modes it ran in."""

    slot: int
    order: int                  # execution order among the step's measured calls
    training: bool
    grad_enabled: bool
    numel: int
    per_unit: int               # values per unit of the output (dead units' evidence); 0: no units tracked


class IndexTensors(NamedTuple):
    """One of the index's lists of tensor ids, with what its sampled steps read of it every time: the tensors
    (local values), their optimizer param groups, and the plan of their norms (probes.capture.tensor_stats)."""

    ids: list[int]                  # the index's own list: kept, so its id() (the cache key) stays its own
    tensors: list[torch.Tensor]
    opt_groups: list[int | None]
    plan: tensor_stats.NormPlan


class TensorSlot(NamedTuple):
    """Where one tensor's value is among the fetched vectors: vector ``slot``, element ``pos``."""

    slot: int
    pos: int


class PerTensor:
    """Where each tensor's value of one kind (gradient norm, data norm...) is among the fetched vectors: kept
    vector by vector, as (slot, the tensor ids of its elements), not an object per tensor; a later vector
    overrides an earlier one for a tensor in both."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, list[int]]] = []
        self._ids: set[int] = set()

    def add(self, slot: int, tensor_ids: list[int]) -> None:
        """Element i of vector ``slot`` is the value of tensor ``tensor_ids[i]``."""
        self.blocks.append((slot, tensor_ids))
        self._ids.update(tensor_ids)

    def __contains__(self, tensor_id: object) -> bool:
        return tensor_id in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)

    def ids(self) -> set[int]:
        return self._ids

    def values(self, plain: Sequence[Sequence[float]]) -> dict[int, float]:
        """Tensor id -> its value, from the fetched vectors (``plain[slot]``)."""
        out: dict[int, float] = {}
        for slot, tensor_ids in self.blocks:
            out.update(zip(tensor_ids, plain[slot], strict=True))
        return out


class RetainedNorms(NamedTuple):
    """The gradient norms of the small outputs whose gradient autograd kept: element ``start + i`` of vector
    ``slot`` is the norm for the modules ``sharing[i]`` (each module's norms come after its ``out_grads``;
    MAX_CALLS_MEASURED at most)."""

    slot: int
    start: int
    sharing: list[list[int]]


@dataclasses.dataclass
class UpdateBaseline:
    """Sampled values of some tensors taken before an optimizer step, compared after it."""

    tensor_ids: list[int]
    taken: UpdateTaken


@dataclasses.dataclass
class StepHooks:
    """The hooks a sampled step attached, all removed at ``StepCapture.detach`` (the compiled model's eager scope
    keeps its own: :class:`probes.capture.eager.EagerScope`)."""

    handles: list[Removable] = dataclasses.field(default_factory=list)
    hooked: list[torch.Tensor] = dataclasses.field(default_factory=list)     # tensors without hooks before
    # leaves given a gradient-hook dict of our own (they had none): (tensor, the dict)
    own_hook_dicts: list[tuple[torch.Tensor, GradHookDict]] = dataclasses.field(default_factory=list)
    live: bool = False           # the real hooks are attached (after the step's first forward)


@dataclasses.dataclass
class StepRecord:
    """What one sampled step observed, and the hooks it holds (``hooks``)."""

    # the index its ids were taken from (it is decoded with it: a rebuild may have dropped some of them since)
    index: ModelIndex | None = None

    measurements: measure.StepMeasurements = dataclasses.field(default_factory=measure.StepMeasurements)
    calls: dict[int, int] = dataclasses.field(default_factory=dict)            # module id -> calls
    rows: dict[int, list[CallRecord]] = dataclasses.field(default_factory=dict)  # module id -> measured calls
    out_grads: dict[int, list[TensorSlot]] = dataclasses.field(default_factory=dict)  # module id -> grad norms
    retained_norms: RetainedNorms | None = None   # the norms of the gradients autograd kept, after out_grads'
    small_grads: list[tuple[torch.Tensor, list[int]]] = dataclasses.field(default_factory=list)  # (copy, modules)
    # small outputs whose gradient autograd keeps, the modules sharing each and its shape (one list per field: see
    # StepMeasurements' small outputs)
    retained: list[torch.Tensor] = dataclasses.field(default_factory=list)
    retained_sharing: list[list[int]] = dataclasses.field(default_factory=list)
    retained_shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    order: int = 0
    stack: list[int] = dataclasses.field(default_factory=list)                  # modules in a call now
    root_training: bool | None = None
    arrived: set[int] = dataclasses.field(default_factory=set)                  # tensors a gradient reached
    stale: dict[int, int] = dataclasses.field(default_factory=dict)             # tensor -> slot of old .grad norm
    # tensor -> slots of its .grad's norm when later gradients of the step arrived (a stale tensor's only): 0 says it
    # was zeroed in place in between, so what its optimizer steps on is this step's own
    rezeroed: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    grads: PerTensor = dataclasses.field(default_factory=PerTensor)
    data: PerTensor = dataclasses.field(default_factory=PerTensor)
    updates: PerTensor = dataclasses.field(default_factory=PerTensor)             # sampled, not scaled yet
    post: PerTensor = dataclasses.field(default_factory=PerTensor)                # data norm after the step
    baselines: dict[int, UpdateBaseline] = dataclasses.field(default_factory=dict)  # optimizer -> before
    # optimizer -> the rows its embedding tables' gradient reached, before the step
    touched: dict[int, tensor_stats.TouchedRows] = dataclasses.field(default_factory=dict)
    table_updates: PerTensor = dataclasses.field(default_factory=PerTensor)      # change in those rows
    orphan_baseline: UpdateBaseline | None = None      # tensors no optimizer holds
    stepped: set[int] = dataclasses.field(default_factory=set)     # the watched optimizers that stepped (their index)
    orphans_checked: bool = False
    # mid -> (own flag, the model's: None when no forward of the step told it)
    modes: dict[int, tuple[bool, bool | None]] = dataclasses.field(default_factory=dict)
    # mode-relevant modules that ran in training mode in any call of the step (a later call in eval, a part evaluated
    # within the step, does not undo what the training one did to running statistics)
    ran_training: set[int] = dataclasses.field(default_factory=set)
    # mid -> the model's modes it ran in step with in some call (1: eval, 2: train, 3: both): a mismatch's fix shows
    # in any call, not only in the step's last
    agreed: dict[int, int] = dataclasses.field(default_factory=dict)
    frozen_blocks: frozen.FrozenBlockSample | None = None   # norms, dropouts in training mode in frozen blocks
    lrs: dict[int, float | None] = dataclasses.field(default_factory=dict)          # tensor -> its group's lr
    # tensor -> where its group's lr is among the fetched vectors, for an lr held as a tensor on a device whose reads
    # cost a sync (fused optimizers take one): read with the step's one host copy, not in the optimizer hook
    device_lrs: dict[int, TensorSlot] = dataclasses.field(default_factory=dict)
    fingerprints: PerTensor = dataclasses.field(default_factory=PerTensor)        # replicas must agree
    local_grads: dict[int, int] = dataclasses.field(default_factory=dict)           # tensor -> slot (own grad)
    sightings: ForwardSightings = dataclasses.field(default_factory=ForwardSightings)
    # id() of every module of the model as it is now, made once a step when a module the index does not know runs
    registered: set[int] | None = None
    # output -> (slot, the output itself, weakly): wrappers returning a child's very output share its row; the
    # weak reference tells that tensor apart from a later one that reuses its address after it was freed
    measured: dict[OutputKey, tuple[int, weakref.ref[torch.Tensor], int]] = dataclasses.field(default_factory=dict)
    grad_targets: dict[OutputKey, list[int]] = dataclasses.field(default_factory=dict)
    hooks: StepHooks = dataclasses.field(default_factory=StepHooks)

    @property
    def optimizer_stepped(self) -> bool:
        return bool(self.updates)


# what sys.getrefcount says, through map(), of an object that a list holds and nothing else: measured, not assumed
# (Python versions differ by one)
_HELD_BY_LIST_ONLY = next(map(sys.getrefcount, [object()]))


def release_outputs(rec: StepRecord) -> None:
    """Let go of the small outputs whose gradient autograd kept for us (``retain_grad``), once their gradients
    were read and the step's measurements hold them no more (after ``start_fetch``; ``detach`` makes sure). One
    that something else still holds keeps the ``.grad`` autograd gave it: the user may have asked to retain it
    too (``out.retain_grad()`` after our hook saw the output is a no-op), and setting it back to None would take
    it from them. The others are freed here, their ``.grad`` dropped first as before (a one-off script freed 15,000
    such outputs in 17 ms so and in 45 ms with their gradients; bench.many_modules shows no difference)."""
    outputs, rec.retained = rec.retained, []
    for x, count in zip(outputs, list(map(sys.getrefcount, outputs)), strict=True):
        if count <= _HELD_BY_LIST_ONLY:
            x.grad = None

