"""From what was measured to findings: the detectors' window, the event book, the structural and run-time
findings, causes, and the tracker that turns the difference into store operations.

The Watcher hands it the decoded values of sampled steps, the sentinels' forward logs and the losses; it
hands back store operations. No hooks, no I/O.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..capture import decode, tensor_stats
from ..capture.decode import ModuleColumns, TensorColumns, Values
from ..capture.record import StepRecord
from ..capture.sentinels import ForwardLog
from ..model.frozen import BlockState
from ..model.index import ModelIndex
from ..model.runtime import RuntimeSighting
from ..model.structure import ModuleNode
from ..schema import FindingCode, Severity
from ..store import records
from ..store.records import Op
from . import update_size
from .causes import assign_causes
from .detectors import BypassCandidate, DynamicDetectors, GradlessCandidate
from .events import EventBook, SampledEvents
from .finding import Finding
from .rules import NotInOptimizer, UnregisteredModule
from .tracker import FindingTracker


@dataclasses.dataclass(frozen=True)
class DecodedStep:
    """One sampled step's statistics, decoded."""

    step: int
    record: StepRecord
    modules: ModuleColumns
    tensors: TensorColumns
    frozen_blocks: Mapping[int, BlockState]      # norms and dropouts in training mode in frozen blocks


# sampled training steps (an optimizer stepped, a gradient reached the model) in which a parameter no optimizer holds
# had gradient hooks, with no gradient reaching it (none arrived, its .grad unset), before it is called frozen in effect
UNREACHED_SAMPLES = 2


def _nothing() -> None:
    return None


def runtime_finding(seen: RuntimeSighting) -> Finding:
    return UnregisteredModule.at_run_time(seen.path, seen.type_name, seen.called_from, seen_before=seen.seen_before,
                                   same_object=seen.same_object, numel=seen.numel, step=seen.step)


class Evaluator:
    def __init__(self, rank: int, window: int) -> None:
        self.rank = rank
        self.detectors = DynamicDetectors(window)
        self.events = EventBook()
        self.tracker = FindingTracker(rank)
        self.static: list[Finding] = []           # what the structure walk shows
        self.dynamic: list[Finding] = []          # the detectors' view at the last sampled step
        # what the watcher's own checks find, by check: a checkpoint load, a stalled optimizer (loop_checks.py)
        self.outside: dict[str, Sequence[Finding]] = {}
        self.before_preview: Callable[[], object] = _nothing    # those checks, before a step in progress is shown
        self._moved: dict[int, int] = {}
        # tensors no optimizer holds that a gradient reached in a sampled training step (it arrived in that step,
        # or their .grad was set at its end: nothing zeroes such a tensor, so a gradient of an unsampled step stays),
        # and per tensor, the sampled training steps it had gradient hooks in (since it entered the index)
        self._reached: set[int] = set()
        self._orphan_samples: collections.Counter[int] = collections.Counter()
        # per index, weakly: a closed watcher's evaluator must not keep the user's model alive
        self._update_scales: tuple[weakref.ref[ModelIndex] | None, dict[int, float]] = (None, {})

    def active(self) -> list[Finding]:
        return self.tracker.active()

    def update_scales(self, index: ModelIndex) -> dict[int, float]:
        """Tensor id -> the factor from the norm of a sampled update to the whole tensor's, made once per index."""
        ref = self._update_scales[0]
        if ref is None or ref() is not index:
            self._update_scales = (weakref.ref(index), {tid: tensor_stats.update_scale(node.numel)
                                           for tid, node in index.tensors.items()})
        return self._update_scales[1]

    # ------------------------------------------------------------------------------ sampled steps
    def decode(self, step: int, rec: StepRecord, values: Values, index: ModelIndex) -> tuple[DecodedStep, list[Op]]:
        """The step's statistics, fed to the detectors' windows; and their store rows."""
        modules = decode.module_columns(step, rec, values)
        tensors = decode.tensor_columns(step, rec, values, self.update_scales(index))
        self.detectors.observe(modules, tensors)
        ops = [records.module_stats_op(decode.module_stat_rows(self.rank, step, modules)),
               records.param_stats_op(decode.param_stat_rows(self.rank, step, tensors))]
        moved = decode.moved_changes(tensors, self._moved)
        if moved:
            self._moved.update(moved)
            ops.append(records.moved_op(self.rank, moved))
        norms = rec.frozen_blocks.read(values[rec.frozen_blocks.slot]) if rec.frozen_blocks is not None else {}
        return DecodedStep(step, rec, modules, tensors, norms), ops

    def evaluate(self, decoded: DecodedStep, index: ModelIndex, runtime: Sequence[RuntimeSighting],
                 optimizers_watched: bool, optimizers: Sequence[torch.optim.Optimizer] = ()) -> list[Op]:
        """The findings after a sampled step; ``optimizers``: the watched ones, in the index's order (their param
        groups' settings say how far a step moves a value)."""
        step, rec = decoded.step, decoded.record
        self.events.observe_sample(SampledEvents(
            step=step, modes=rec.modes, agreed=rec.agreed,
            called=frozenset(rec.calls),     # a module is counted once called
            arrived=frozenset(rec.arrived), owners=index.owners, bypass=bypass_candidates(rec, index),
            gradless=gradless_candidates(rec, index),
            bad_modules=decoded.modules.nonfinite_in_order(),
            bad_grads=[t for t in decoded.tensors.nonfinite_grads() if index.tensor_known(t)],
            optimizer_skipped=optimizers_watched and not rec.optimizer_stepped,
            stepped=frozenset(rec.stepped), frozen_blocks=decoded.frozen_blocks), index)
        self.dynamic = self.detectors.evaluate(index, step, rec.optimizer_stepped, update_size.group_rules(optimizers))
        if rec.optimizer_stepped and rec.arrived:
            self._count_orphans(rec, rec.index or index)
        return self.publish(step, index, runtime, sampled=True)

    def _count_orphans(self, rec: StepRecord, hooked: ModelIndex) -> None:
        """A sampled training step seen by the tensors no optimizer holds of the index the step was hooked with;
        those whose .grad is set at its end (measured by the step, ``rec.grads``) or that a gradient reached in it
        were reached."""
        orphans = hooked.orphan_tensors()
        if not orphans:
            return
        self._orphan_samples.update(orphans)                # C-level passes: an EMA copy holds every tensor
        self._reached |= rec.arrived.intersection(orphans)
        self._reached |= rec.grads.ids().intersection(orphans)

    def last_modes(self, step: int, rec: StepRecord, index: ModelIndex) -> None:
        """The modes of the step in progress when the watcher closes (an evaluation after the last optimizer
        step: Monte Carlo dropout, a module eval() missed)."""
        if rec.modes:
            self.events.observe_modes(step, rec.modes, rec.agreed, index)

    # ------------------------------------------------------------------------------ every step
    def forwards(self, step: int, log: ForwardLog, mode_sensitive: Sequence[str], step_ended: bool) -> None:
        if not log.empty():
            self.events.observe_forwards(step, log, mode_sensitive, step_ended)

    def loss(self, step: int, value: float | None) -> None:
        self.events.observe_loss(step, value)

    @property
    def changed(self) -> bool:
        return self.events.changed

    def publish(self, step: int, index: ModelIndex, runtime: Sequence[RuntimeSighting], sampled: bool,
                events: EventBook | None = None) -> list[Op]:
        """Findings now: structure, run-time modules, the detectors' last view and the events, each consequence
        naming its cause; the store operations that record the difference."""
        book = events or self.events
        current = assign_causes([*self._static_now(index), *map(runtime_finding, runtime), *self.dynamic,
                                 *book.findings(index), *itertools.chain.from_iterable(self.outside.values())])
        book.changed = False
        return self.tracker.update(step, current, index, sampled)

    def _static_now(self, index: ModelIndex) -> list[Finding]:
        """The structure's findings, with what the sampled steps add: a parameter no optimizer holds that no
        gradient reached in the UNREACHED_SAMPLES sampled training steps since it entered the index is frozen in
        effect (an info)."""
        if not self._orphan_samples:
            return self.static
        ids: dict[str, int] | None = None
        out = []
        for found in self.static:
            if found.code == FindingCode.NOT_IN_OPTIMIZER and found.severity == Severity.ERROR:
                if ids is None:             # made only when the model has such a parameter
                    ids = {t.path: t.param_id for t in index.structure.tensors}
                tid = ids.get(found.path)
                samples = self._orphan_samples.get(tid, 0) if tid is not None else 0
                if samples >= UNREACHED_SAMPLES and tid not in self._reached:
                    found = NotInOptimizer.unreached(found, samples)  # noqa: PLW2901
            out.append(found)
        return out

    def preview(self, step: int, log: ForwardLog, mode_sensitive: Sequence[str], index: ModelIndex,
                runtime: Sequence[RuntimeSighting]) -> list[Op]:
        """The step in progress evaluated without ending it (findings(), snapshot()): nothing is counted
        twice when it ends."""
        self.before_preview()
        book = self.events.copy()
        if not log.empty():
            book.observe_forwards(step, log, mode_sensitive, step_ended=False)
        return self.publish(step, index, runtime, sampled=False, events=book) if book.changed else []


def bypass_candidates(rec: StepRecord, index: ModelIndex) -> list[BypassCandidate]:
    """Tensors that got a gradient in a step in which none of their modules was called through __call__."""
    calls = rec.calls
    if not calls:
        return []
    arrived = sorted(rec.arrived)
    owners_of = list(map(index.owners.get, arrived, itertools.repeat(_NOBODY)))
    # in one C-level pass, whether each tensor's first owner was called: then it is no candidate (the common case)
    first_called = list(map(calls.get, map(_FIRST, owners_of)))
    out = []
    parents_of_called: set[int] | None = None
    for i in [i for i, n in enumerate(first_called) if not n]:
        owners = owners_of[i]
        if owners is _NOBODY or owners == (index.root_id,):
            continue            # the model's own tensors read by a loop that calls its parts (CLIP's logit_scale)
        if not any(calls.get(m) for m in owners) and not any(m in index.bypass_exempt for m in owners) \
                and not any(_inside_script(index, m) for m in owners):
            if parents_of_called is None:          # made once, in the rare step that has a candidate
                parents_of_called = {node.parent_id for m in calls if (node := index.modules.get(m)) is not None
                                     and node.parent_id is not None}
            forward_called = any(m in parents_of_called for m in owners)
            by_design = "" if forward_called else (
                "table" if all(_is_table(index.modules.get(m)) for m in owners)
                else "read-by-parent" if any(_parent_called(index, m, calls) for m in owners) else "")
            out.append(BypassCandidate(arrived[i], owners, forward_called, by_design))
    return out


def gradless_candidates(rec: StepRecord, index: ModelIndex) -> list[GradlessCandidate]:
    """Trained tensors (held by a watched optimizer, requiring grad) whose module ran in training mode within a
    training forward (the model's own call with gradients enabled), in a step that backpropagated and stepped, but
    which no gradient reached. The module's own call may have had gradients off: torch.no_grad() inside forward,
    or a reentrant checkpoint whose inputs do not require grad, are such cuts."""
    if not rec.arrived or not rec.optimizer_stepped:
        return []
    missing = index.trained_tensors - rec.arrived          # one C-level pass; empty in the common case
    if not missing or not any(r.training and r.grad_enabled for r in rec.rows.get(index.root_id, ())):
        return []
    out = []
    for tid in sorted(missing):
        ran = tuple(m for m in index.owners.get(tid, ()) if any(r.training for r in rec.rows.get(m, ())))
        if ran:
            out.append(GradlessCandidate(tid, ran))
    return out


def _inside_script(index: ModelIndex, module_id: int) -> bool:
    """Whether a TorchScript module holds ``module_id``: its children run in TorchScript, never through
    ``__call__``, so no hook sees their calls (only the rare candidate of a step gets here)."""
    node = index.modules.get(module_id)
    while node is not None and node.parent_id is not None:
        node = index.modules.get(node.parent_id)
        if node is not None and isinstance(node.module, torch.jit.ScriptModule):
            return True
    return False


def _parent_called(index: ModelIndex, module_id: int, calls: Mapping[int, Any]) -> bool:
    """Whether the module around leaf ``module_id`` was called: its forward then read the leaf's weights itself (a
    functional call, as torchvision's Swin attention passes ``qkv.weight`` to ``F.linear``)."""
    node = index.modules.get(module_id)
    # not the model itself: `self.proj.forward(x)` in the model's own forward is the bypass this rule is for
    return (node is not None and node.parent_id is not None and node.parent_id != index.root_id
            and bool(calls.get(node.parent_id)))


def _is_table(node: ModuleNode | None) -> bool:
    return node is not None and node.type in ("Embedding", "EmbeddingBag") and node.type_module.startswith("torch.nn")


_NOBODY: tuple[int, ...] = (-1,)      # the owners of a tensor no module owns (no module has id -1)
_FIRST = operator.itemgetter(0)
