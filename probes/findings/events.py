"""Findings about things that happened. Each stays active, with its count and first and last step, until
there is evidence of the fix, or to the end of the run:

- train-mode-under-no-grad: the model ran forward under no_grad/inference_mode in training mode while it
  holds Dropout/BatchNorm-like modules; fixed by a later no_grad forward in eval mode.
- eval-builds-graph: a forward in eval mode with gradients enabled whose output was never backpropagated
  before the step ended; fixed by a later eval forward under no_grad.
- train-step-in-eval-mode: an optimizer step trained on gradients of eval-mode forwards, with no training-mode
  forward in the step (an adversarial attack runs in eval beside them), while the model holds Dropout/BatchNorm-like
  modules; fixed by a later step with a training-mode forward.
- training-mode-mismatch: a module ran with a training flag other than the model's; fixed when it is seen
  again in step with the model in that mode. Also (one warning) normalization layers with frozen parameters inside
  frozen blocks that ran in training mode in a step that trained: their running statistics still move; fixed when
  seen in eval mode (or trainable) in such a step.
- forward-bypassed: a module's parameters got gradients in a step its ``__call__`` never ran in; fixed
  when they get gradients in a step the module was called in. A module with no forward of its own (ParameterList,
  ParameterDict, a holder of a mixture of experts' stacked weights) has none to bypass: never reported.
- no-gradient: a trained tensor's module ran in the training forward of GRADLESS_SAMPLES sampled steps that trained
  its optimizer (that optimizer stepped), and no gradient reached the tensor; fixed when one does.
- non-finite: the origin of an episode of NaN/Inf values is the first module, in execution order, of the
  episode's first step (or the loss, when that step was not sampled); later steps of the episode add
  evidence, never a new origin. A finding about non-finite values stays to the end of the run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ..capture.decode import NonFiniteModule
from ..capture.sentinels import ForwardLog
from ..model.frozen import BlockState, frozen_norm_parameters, in_frozen_block, is_norm
from ..model.structure import drops_at_random, has_no_forward
from ..schema import ModuleKind, display_path
from . import finding as findings
from .detectors import BypassCandidate, GradlessCandidate, ModelView
from .finding import Finding, Seen
from .rules import (
    EvalBuildsGraph,
    ForwardBypassed,
    NoGradient,
    NonFinite,
    NonFiniteOrigin,
    TrainingModeMismatch,
    TrainModeUnderNoGrad,
    TrainStepInEvalMode,
)


@dataclasses.dataclass
class Occurrence:
    """When something was seen: first and last step, and how often."""

    first: int
    last: int
    count: int = 1

    def again(self, step: int, times: int = 1) -> None:
        self.last = step
        self.count += times


@dataclasses.dataclass(frozen=True)
class SampledEvents:
    """What a sampled step showed that concerns events."""

    step: int
    # module id -> (its training flag, the model's: None when no forward of the step told it) for mode-relevant ones
    modes: Mapping[int, tuple[bool, bool | None]]
    agreed: Mapping[int, int]                   # module id -> the model's modes it ran in step with (1 eval, 2 train)
    called: frozenset[int]                      # modules called through __call__
    arrived: frozenset[int]                     # tensors a gradient reached
    owners: Mapping[int, tuple[int, ...]]       # tensor id -> modules owning it
    bypass: Sequence[BypassCandidate]
    gradless: Sequence[GradlessCandidate]
    bad_modules: Sequence[NonFiniteModule]      # in execution order
    bad_grads: Sequence[int]                    # tensors with a non-finite gradient (forward order)
    optimizer_skipped: bool                     # optimizers are watched but none stepped (an AMP skip)
    stepped: frozenset[int] = frozenset()       # the watched optimizers that stepped (their index)
    # normalization layers (dropouts: under no_grad) that ran in training mode inside frozen blocks (in a step that
    # trained): their block then
    frozen_blocks: Mapping[int, BlockState] = dataclasses.field(default_factory=dict)


# sampled steps in which a trained tensor's module ran and no gradient reached it before it is reported (one could be
# a step that backpropagated another loss only)
GRADLESS_SAMPLES = 2


class EventBook:
    def __init__(self) -> None:
        self.changed = False
        self._nograd_train: Occurrence | None = None
        self._nograd_train_modules: list[str] = []
        self._inference_mode = False
        self._eval_graph: Occurrence | None = None
        self._eval_graph_numel = 0
        self._eval_step: Occurrence | None = None
        self._eval_step_modules: list[str] = []
        self._mismatch: dict[int, tuple[Occurrence, bool, bool]] = {}     # mid -> (seen, own flag, root flag)
        # a normalization layer ran in training mode with the model in the latest sampled step: the ones in eval
        # are not all frozen on purpose (mmdetection's norm_eval, timm's freeze_bn freeze them all)
        self._norm_trains = False
        # module id -> seen: a normalization layer, frozen in a frozen block, ran in training mode in a training step
        self._frozen_norm_updating: dict[int, Occurrence] = {}
        # module id -> seen: a dropout layer in a frozen block ran in training mode under no_grad in a training step
        self._frozen_dropout: dict[int, Occurrence] = {}
        # module id -> its block's parameters at the last sampled step: frozen ones do not change (a momentum
        # encoder updated without gradients, a discriminator frozen again after its own step do)
        self._norm_blocks: dict[int, BlockState] = {}
        # tensor id -> (seen, owners, the evidence)
        self._bypass: dict[int, tuple[Occurrence, tuple[int, ...], BypassCandidate]] = {}
        # tensor id -> (seen, the modules of it that ran), for trained tensors no gradient reached
        self._gradless: dict[int, tuple[Occurrence, tuple[int, ...]]] = {}
        self._episodes: dict[str, tuple[NonFiniteOrigin, Occurrence, list[str]]] = {}   # by origin path
        self._open_episode: str | None = None     # the origin path of the episode going on now

    def copy(self) -> EventBook:
        """An independent copy (to preview a step in progress without counting it twice)."""
        other = EventBook()
        other.__dict__.update({k: _copy(v) for k, v in self.__dict__.items()})
        return other

    # -------------------------------------------------------------------------- forwards of the model
    def observe_forwards(self, step: int, log: ForwardLog, mode_sensitive: Sequence[str],
                         step_ended: bool) -> None:
        """What the root sentinel saw since the last boundary. ``step_ended``: an optimizer step (or
        ``w.step()``) ends it, so eval forwards not backpropagated by now never will be."""
        if log.nograd_train_forwards:
            self._see("_nograd_train", step, log.nograd_train_forwards)
            for path in log.nograd_train_modules:
                if path not in self._nograd_train_modules:
                    self._nograd_train_modules.append(path)
            self._inference_mode = self._inference_mode or log.inference_mode
        if log.last_nograd_training is False:        # a proper evaluation (eval() + no_grad()) after it
            self._clear("_nograd_train")
            self._clear("_eval_graph")
        trained = [f for f in log.eval_graph if f.backpropagated and not f.norms_training]
        unused = [f for f in log.eval_graph if not f.backpropagated]
        if unused and step_ended:
            self._see("_eval_graph", step, len(unused))
            self._eval_graph_numel = max(self._eval_graph_numel, *(f.numel for f in unused))
        if step_ended:
            # an eval forward backpropagated beside training-mode ones is an adversarial attack's (PGD, TRADES:
            # gradients with respect to the input, taken in eval mode), not a step trained in eval mode
            if trained and mode_sensitive and not log.train_forwards:
                self._see("_eval_step", step)
                self._eval_step_modules = list(mode_sensitive)
            elif log.train_forwards:
                self._clear("_eval_step")

    # -------------------------------------------------------------------------- the loss
    def observe_loss(self, step: int, value: float | None) -> None:
        if value is None:
            return
        if math.isfinite(value):
            self._open_episode = None
            return
        if self._open_episode is not None:
            self._continue_episode(step, False, "the loss")
            return
        self._start_episode(NonFiniteOrigin("loss", "", step, values_text=repr(value)))

    # -------------------------------------------------------------------------- sampled steps
    def observe_sample(self, ev: SampledEvents, view: ModelView) -> None:
        step = ev.step
        self.observe_modes(step, ev.modes, ev.agreed, view)
        for c in ev.bypass:
            if all(_holder(view, m) for m in c.module_ids):
                continue                              # it has no forward to bypass: its parameters are read
            seen_b = self._bypass.get(c.tensor_id)
            if seen_b is None:
                self._bypass[c.tensor_id] = (Occurrence(step, step), c.module_ids, c)
            else:
                seen_b[0].again(step)
                if c.forward_called and not seen_b[2].forward_called:     # the stronger evidence wins
                    self._bypass[c.tensor_id] = (seen_b[0], c.module_ids, c)
            self.changed = True
        if ev.stepped:
            self._observe_frozen_blocks(ev, view)
        flagged = {c.tensor_id for c in ev.bypass}
        for tid in [t for t in self._bypass if t not in flagged and t in ev.arrived]:
            if any(m in ev.called for m in ev.owners.get(tid, ())):
                del self._bypass[tid]                 # its module was called in a step it got a gradient in
                self.changed = True
        for g in self._trained_by_the_step(ev, view):
            seen_g = self._gradless.get(g.tensor_id)
            if seen_g is None:
                self._gradless[g.tensor_id] = (Occurrence(step, step), g.module_ids)
            else:
                seen_g[0].again(step)
            self.changed = True
        for tid in [t for t in self._gradless if t in ev.arrived]:
            del self._gradless[tid]                   # a gradient reached it
            self.changed = True
        grads = [] if ev.optimizer_skipped else list(ev.bad_grads)   # an AMP skip: inf gradients are expected
        if not ev.bad_modules and not grads:
            self._open_episode = None
            return
        # -inf alone, with finite gradients, is masking: an episode of its own kind, until NaN or Inf follow
        masking = not grads and all(b.minus_inf_only for b in ev.bad_modules)
        if self._open_episode is not None:
            self._continue_episode(step, masking, *(view.module_path(b.module_id) for b in ev.bad_modules[:3]))
            return
        if ev.bad_modules:
            first = ev.bad_modules[0]
            affected = tuple(view.module_path(b.module_id) for b in ev.bad_modules)
            self._start_episode(NonFiniteOrigin("activation", view.module_path(first.module_id), step, first.values,
                                                affected, masking=masking))
        else:
            tid = grads[-1]                           # the last tensor in forward order gets its gradient first
            owner = view.tensor_module(tid)
            path = view.module_path(owner) if owner is not None and view.has_module(owner) else view.tensor_path(tid)
            self._start_episode(NonFiniteOrigin("gradient", path, step, len(grads),
                                                tuple(view.tensor_path(t) for t in grads), view.tensor_path(tid)))

    def observe_modes(self, step: int, modes: Mapping[int, tuple[bool, bool | None]], agreed: Mapping[int, int],
                      view: ModelView) -> None:
        """The modules' training flags against the model's in a step (:class:`SampledEvents`' ``modes``, ``agreed``):
        a sampled step, or the one in progress when the watcher closes (an evaluation after the last step)."""
        if any(root_training is not None for _, root_training in modes.values()):
            self._norm_trains = any(training and root_training and is_norm(view, mid)
                                    for mid, (training, root_training) in modes.items())
        for mid, (training, root_training) in modes.items():
            if root_training is None:
                continue                              # no mode of the model to compare with
            seen = self._mismatch.get(mid)
            if training != root_training:
                if seen is None:
                    self._mismatch[mid] = (Occurrence(step, step), training, root_training)
                else:
                    seen[0].again(step)
                self.changed = True
            elif seen is not None and agreed.get(mid, 0) & (2 if seen[2] else 1):
                del self._mismatch[mid]                # in step with the model in that mode now
                self.changed = True

    def _observe_frozen_blocks(self, ev: SampledEvents, view: ModelView) -> None:
        """(A step in which a watched optimizer stepped.) The normalization layers that ran in training mode inside
        frozen blocks, against their block's parameters at the last such step."""
        for mid, block in ev.frozen_blocks.items():
            unchanged = self._norm_blocks.get(mid) == block
            self._norm_blocks[mid] = block
            book = self._frozen_norm_updating if is_norm(view, mid) else self._frozen_dropout
            if unchanged:
                seen = book.get(mid)
                if seen is None:
                    book[mid] = Occurrence(ev.step, ev.step)
                else:
                    seen.again(ev.step)
                self.changed = True
            elif book.pop(mid, None) is not None:
                self.changed = True                    # its block changed: trained, or a momentum copy
        for mid in ev.modes:
            if mid not in ev.frozen_blocks and (self._frozen_norm_updating.pop(mid, None) is not None
                                               or self._frozen_dropout.pop(mid, None) is not None):
                self.changed = True                    # in eval mode now, or trainable

    @staticmethod
    def _trained_by_the_step(ev: SampledEvents, view: ModelView) -> list[GradlessCandidate]:
        """The candidates whose optimizer stepped in the step. A step in which another optimizer stepped alone (a
        GAN's critic trained five times per generator step, the generator running in each for its samples) is not
        expected to reach this one's tensors; one that stepped is, even when no gradient reached any tensor it holds
        (a backbone with an optimizer of its own run under no_grad by mistake)."""
        if not ev.gradless:
            return []
        trained = ev.stepped
        return [c for c in ev.gradless if view.tensor_known(c.tensor_id)
                and (g := view.tensor_group(c.tensor_id)) is not None and g[0] in trained]

    # -------------------------------------------------------------------------- out
    def findings(self, view: ModelView) -> list[Finding]:
        out: list[Finding] = []
        if self._nograd_train is not None:
            o = self._nograd_train
            out.append(TrainModeUnderNoGrad.build(self._nograd_train_modules, self._inference_mode, o.first,
                                                         o.last, o.count))
        if self._eval_graph is not None:
            o = self._eval_graph
            out.append(EvalBuildsGraph.build(o.count, self._eval_graph_numel, o.first, o.last))
        if self._eval_step is not None:
            o = self._eval_step
            out.append(TrainStepInEvalMode.build(self._eval_step_modules, o.first, o.last, o.count))
        mismatch = {mid: m for mid, m in self._mismatch.items() if view.has_module(mid)}
        frozen = [mid for mid, (_, training, root_training) in mismatch.items()
                  if not training and root_training and is_norm(view, mid)
                  and not _in_part_out_of_step(view, mismatch, mid)]
        in_frozen_blocks = self._norm_trains
        if in_frozen_blocks:
            # others train: on purpose only where the layer and the block around it are frozen (the fix the
            # frozen-statistics warning gives, with a trained head's BatchNorm in training mode)
            frozen = [mid for mid in frozen if _frozen_and_tracking(view, mid)]
        if frozen:
            # every normalization layer that ran is in eval while the model trains (or those in frozen blocks):
            # frozen statistics, one finding
            group = _group(view, {mid: mismatch.pop(mid)[0] for mid in frozen})
            out.append(TrainingModeMismatch.frozen_normalization(group, in_frozen_blocks))
        updating = {mid: o for mid, o in self._frozen_norm_updating.items() if view.has_module(mid)}
        if updating:
            out.append(TrainingModeMismatch.frozen_normalization_updating(_group(view, updating)))
        noisy = {mid: o for mid, o in self._frozen_dropout.items() if view.has_module(mid)}
        if noisy:
            out.append(TrainingModeMismatch.frozen_dropout_active(_group(view, noisy)))
        out += _mismatches(view, {mid: m for mid, m in mismatch.items()
                                  # a frozen teacher or backbone put in eval: the recipe
                                  if m[1] or not m[2] or not in_frozen_block(view, mid)})
        for tid, (o, owners, c) in self._bypass.items():
            if view.tensor_known(tid):
                names = [display_path(view.module_path(m)) for m in owners]
                out.append(ForwardBypassed.build(view.module_path(owners[0]), view.tensor_path(tid), names,
                                                     o.first, o.last, o.count, c.forward_called, c.by_design))
        by_module: dict[int, list[tuple[int, Occurrence]]] = {}
        for tid, (o, ran) in self._gradless.items():
            if o.count >= GRADLESS_SAMPLES and view.tensor_known(tid) and view.has_module(ran[0]):
                by_module.setdefault(ran[0], []).append((tid, o))
        for mid, tensors in by_module.items():
            out.append(NoGradient.build(view.module_path(mid), [view.tensor_path(t) for t, _ in tensors],
                                            min(o.first for _, o in tensors), max(o.last for _, o in tensors),
                                            min(o.count for _, o in tensors)))
        for origin, o, later in self._episodes.values():
            out.append(NonFinite.build(origin, last_step=o.last, count=o.count, later=later))
        return out

    # -------------------------------------------------------------------------- helpers
    def _see(self, name: str, step: int, times: int = 1) -> None:
        seen: Occurrence | None = getattr(self, name)
        if seen is None:
            setattr(self, name, Occurrence(step, step, times))
        else:
            seen.again(step, times)
        self.changed = True

    def _clear(self, name: str) -> None:
        if getattr(self, name) is not None:
            setattr(self, name, None)
            self.changed = True

    def _start_episode(self, origin: NonFiniteOrigin) -> None:
        known = self._episodes.get(origin.path)
        if known is None:
            self._episodes[origin.path] = (origin, Occurrence(origin.step, origin.step), [])
        else:
            if known[1].last != origin.step:
                known[1].again(origin.step)
            if known[0].masking and not origin.masking:
                self._escalate(origin.path)
        self._open_episode = origin.path
        self.changed = True

    def _continue_episode(self, step: int, masking: bool, *where: str) -> None:
        assert self._open_episode is not None
        origin, seen, later = self._episodes[self._open_episode]
        if seen.last != step:                          # counted in steps: the loss and a sample of one step are one
            seen.again(step)
        if origin.masking and not masking:
            self._escalate(self._open_episode)
        for w in where:
            shown = display_path(w)
            if shown not in later and w != self._open_episode:
                later.append(shown)
        self.changed = True

    def _escalate(self, path: str) -> None:
        """NaN or Inf came after an episode of -inf alone: it was no harmless masking."""
        origin, seen, later = self._episodes[path]
        self._episodes[path] = (dataclasses.replace(origin, masking=False), seen, later)


def _mismatches(view: ModelView, mismatch: Mapping[int, tuple[Occurrence, bool, bool]]) -> list[Finding]:
    """One finding per module out of step with the model, the modules inside it with the same flag told in its own
    (a Hugging Face model left in eval: one finding, not one per layer); dropout layers that model.eval() reached and
    that ran in training mode after it together in one (Monte Carlo dropout)."""
    inside: dict[int, int] = {}
    tops = []
    for mid, (_, training, root_training) in mismatch.items():
        top, parent = mid, _parent(view, mid)
        while parent is not None:
            above = mismatch.get(parent)
            if above is not None and above[1] == training and above[2] == root_training:
                top = parent
            parent = _parent(view, parent)
        if top == mid:
            tops.append(mid)
        else:
            inside[top] = inside.get(top, 0) + 1
    out: list[Finding] = []
    monte_carlo, adapted = [], []            # set to training mode after model.eval(): dropouts, normalization layers
    for mid in tops:
        o, training, root_training = mismatch[mid]
        node = view.modules.get(mid)
        registered = node is not None and node.kind == ModuleKind.REGISTERED
        if registered and training and not root_training and not inside.get(mid) and node is not None \
                and node.module is not None:
            if drops_at_random(node.module):
                monte_carlo.append(mid)
                continue
            if is_norm(view, mid):
                adapted.append(mid)
                continue
        out.append(TrainingModeMismatch.mismatch(
            view.module_path(mid), view.module_type(mid), training, root_training,
            Seen(o.last, first_step=o.first, count=o.count),
            registered=registered, inside=inside.get(mid, 0),
            pretrained=node is not None and node.type_module.startswith("transformers.")))
    for group, make in ((monte_carlo, TrainingModeMismatch.monte_carlo_dropout),
                        (adapted, TrainingModeMismatch.norms_training_in_eval)):
        if group:
            out.append(make(_group(view, {mid: mismatch[mid][0] for mid in group})))
    return out


def _group(view: ModelView, seen: Mapping[int, Occurrence]) -> findings.ModuleGroup:
    """The modules of a grouped finding (in their order), and when they were seen."""
    occurrences = list(seen.values())
    return findings.ModuleGroup([view.module_path(m) for m in seen], sorted({view.module_type(m) for m in seen}),
                                min(o.first for o in occurrences), max(o.last for o in occurrences),
                                max(o.count for o in occurrences))


def _in_part_out_of_step(view: ModelView, mismatch: Mapping[int, tuple[Occurrence, bool, bool]],
                         module_id: int) -> bool:
    """Whether a module lies inside a part that trains yet ran with the same flag as it, against the model's (a
    trained encoder left in eval): it is told in that part's finding, not as frozen on purpose."""
    flags = mismatch[module_id][1:]
    parent = _parent(view, module_id)
    while parent is not None:
        above = mismatch.get(parent)
        if above is not None and above[1:] == flags and not in_frozen_block(view, parent):
            return True
        parent = _parent(view, parent)
    return False


def _parent(view: ModelView, module_id: int) -> int | None:
    node = view.modules.get(module_id)
    return node.parent_id if node is not None else None


def _copy(value: object) -> object:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    if isinstance(value, Occurrence):
        return dataclasses.replace(value)
    return value


def _holder(view: ModelView, module_id: int) -> bool:
    """A module with no forward of its own (ParameterList, ParameterDict, a holder of stacked expert weights)."""
    node = view.modules.get(module_id)
    return node is not None and node.module is not None and has_no_forward(node.module)


def _frozen_and_tracking(view: ModelView, module_id: int) -> bool:
    """A normalization layer that updates running statistics in training mode, in a frozen block."""
    return frozen_norm_parameters(view, module_id) is not None
