"""Dynamic detectors: rules over the statistics of sampled steps, evaluated for every module at once.

Definitions (also in docs/usage.md):
- a unit is a channel (dim 1) of conv-like outputs, else the last dimension; it is *active* in a sample
  when any of its values is non-zero. The *window* is the last ``window`` sampled steps (default 16).
  A unit is dead when it was not active in any call of the window.
- dead-layer: >= 90% dead units, or the output is constant (std == 0 over more than one value, and the same mean) in
  every sample of the window, or, for an output of one value per call, that value stayed the same over
  ``MIN_UNIT_VALUES`` calls (a loss module's changes every step); dead-units: 25% to 90%; at the innermost module,
  not again at the wrappers returning its very output. Both need at least ``MIN_SAMPLES`` calls of the module within
  the window, and at least
  ``MIN_UNIT_VALUES`` values per unit over the window (each call's values per unit, from its layout; a lower bound
  from the outputs' sizes where units are not tracked): a Squeeze-and-Excitation ReLU on pooled features holds one
  value per sample, and a live unit stays zero over a few of them by chance. A module called in some sampled steps
  only (a mixture-of-experts expert the router did not pick every step) needs ``SPARSE_ROWS``: the few inputs routed
  to it do not show that a unit never activates (a constant output needs ``MIN_UNIT_VALUES`` only, in any steps).
  A module called several times a step (one ReLU after a block's first conv and again after its residual add) is
  judged call by call (call_sites.py): each measured call keeps its own unit activity and spread, the module's row
  carries its worst call, and the finding and the dead-input chain name that call. At a dropout module in training
  (the only module showing the dead units of a functional activation: nn.TransformerEncoderLayer's F.relu) only when
  the chance that a live unit's values were all dropped over the window, p ** its values per unit (per channel or
  sample for Dropout2d and drop-path), is below DROPPED_ALL; in eval mode a dropout is the identity, judged as any
  module. Never at a dropout whose input (the module that ended just before it) is flagged: the units that die
  upstream are reported at the activation that kills them.
- saturated: Tanh/Hardtanh/Softsign outputs with |x| > 0.99, Sigmoid/Hardsigmoid outputs below 0.01 or
  above 0.99; flagged when more than half of the values sit in those tails on average over the last
  MIN_SAMPLES samples, at the activation itself (not the wrappers returning its output). A sigmoid-like output
  layer (no trained layer ran after it in the forward: a multi-label classifier's final Sigmoid) saturates because
  the model is confident, which stalls nothing with a log-likelihood loss: an info. A Tanh stays a warning (a
  generator's or actor's final Tanh feeds a critic), and with no optimizer watched nothing is an output layer.
- not-updating: over the last NOT_UPDATING_STEPS observed optimizer steps a tensor received a gradient
  (more than a numerically zero one) and its value did not change; and the other ways a parameter the optimizer
  holds does not move (a zero or cleared gradient at the step, no gradient at all): not_moving.py.
- grad-accumulating: in the last ACCUMULATING_STEPS sampled steps in which it got a gradient, its .grad
  already held one when the step's first gradient arrived, and it was not zeroed before a later backward of the
  step (a GAN trained generator first reaches the discriminator before ``opt_d.zero_grad()``). When that is so
  of (nearly, NEVER_ZEROED) every tensor an optimizer holds that got gradients, its gradients are never zeroed
  (zero_grad() forgotten): one finding at the root for them, none per tensor.

The windows are ring buffers indexed by module (and tensor) id, so a sampled step of a model with 15,000
modules costs a few vector operations, and only the modules a rule flags cost Python.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from ..capture.decode import MODULE_STATS, ModuleColumns, TensorColumns, floats
from ..model.structure import drops_at_random
from . import not_moving
from .call_sites import CallSites, flat_in_every_sample
from .finding import Finding
from .rules import DeadLayer, DeadUnits, GradAccumulating, Saturated
from .update_size import UpdateRule, no_rules

DEAD_LAYER = 0.90
DEAD_UNITS = 0.25
SATURATED = 0.5
MIN_SAMPLES = 3
# values per unit a module called in only some sampled steps of the window must have produced over it before its
# units are called dead (a healthy ReLU unit active on 10% of inputs stays zero over 10 of them a third of the time)
SPARSE_ROWS = 64
# values per unit any module's outputs must have held over the window before its units are called dead (a pooled SE
# ReLU holds one a sample); an output of one value per call is constant once it held the same one over as many calls
MIN_UNIT_VALUES = 16
NOT_UPDATING_STEPS = 2
ACCUMULATING_STEPS = 2
# the share of the tensors an optimizer holds (of those that got gradients) whose gradient accumulates beyond which
# its gradients are never zeroed (zero_grad() forgotten): one finding at the root for all of them
NEVER_ZEROED = 0.9
# a gradient below this fraction of the tensor's norm is numerically zero (a bias before BatchNorm): no
# optimizer step is expected to move the tensor by it
NEGLIGIBLE_GRAD = 1e-6
# a dropout module's units are judged only when the chance that a live unit's values were all dropped over the window
# (p ** independent draws) is below this
DROPPED_ALL = 1e-6
_NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class BypassCandidate:
    """A tensor that received a gradient in a step in which none of its modules was called."""

    tensor_id: int
    module_ids: tuple[int, ...]
    # a child of one of them was called through __call__: their .forward() was called directly. Otherwise (a leaf
    # module) its parameters may as well have been read directly (module.weight)
    forward_called: bool = True
    # why that is likely by design: "table" (an embedding table, often kept only to hold its weight: DETR's queries,
    # a sliced position table), "read-by-parent" (the module around it was called: its forward read the weights
    # itself, a functional call), or ""
    by_design: str = ""


@dataclasses.dataclass(frozen=True)
class GradlessCandidate:
    """A trained tensor whose module ran in training, within a training forward, in a step that backpropagated,
    but which no gradient reached."""

    tensor_id: int
    module_ids: tuple[int, ...]        # those of its modules that ran so


class _Node(Protocol):
    @property
    def parent_id(self) -> int | None: ...
    @property
    def module(self) -> torch.nn.Module | None: ...
    @property
    def type(self) -> str: ...
    @property
    def type_module(self) -> str: ...
    @property
    def kind(self) -> str: ...


class _TensorNode(Protocol):
    @property
    def dtype(self) -> str: ...
    @property
    def numel(self) -> int: ...


class ModelView(Protocol):
    """What the detectors read about the model (implemented by :class:`probes.model.index.ModelIndex`)."""

    @property
    def saturation(self) -> Mapping[int, str | None]: ...      # module id -> 'tanh' | 'sigmoid' | None
    @property
    def owners(self) -> Mapping[int, tuple[int, ...]]: ...     # tensor id -> the modules owning it
    @property
    def trained_tensors(self) -> frozenset[int]: ...
    @property
    def modules(self) -> Mapping[int, _Node]: ...              # module id -> its node (``parent_id``)
    @property
    def tensors(self) -> Mapping[int, _TensorNode]: ...        # tensor id -> its node (``dtype``)
    @property
    def n_optimizers(self) -> int: ...

    def has_module(self, module_id: int) -> bool: ...
    def module_path(self, module_id: int) -> str: ...
    def module_type(self, module_id: int) -> str: ...
    def tensor_known(self, tensor_id: int) -> bool: ...
    def tensor_path(self, tensor_id: int) -> str: ...
    def tensor_module(self, tensor_id: int) -> int | None: ...
    def tensor_in_optimizer(self, tensor_id: int) -> bool: ...
    def tensor_group(self, tensor_id: int) -> tuple[int, int] | None: ...


def _column(values: Sequence[float | int | bool | None]) -> torch.Tensor:
    return floats(values).to(torch.float32)


def _rows(ids: list[int], rows: list[int], columns: dict[str, Sequence[float | int | bool | None]]
          ) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Rows ``rows`` of some columns of values per tensor, as float32 columns (NaN for None), and their ids."""
    if len(rows) == len(ids):           # every row: the common case, without picking
        return ids, {name: _column(col) for name, col in columns.items()}
    picked = torch.tensor(rows, dtype=torch.int64)
    return [ids[i] for i in rows], {name: _column(col).index_select(0, picked) for name, col in columns.items()}


class _Window:
    """Per-id ring buffers of the last ``size`` observations of some statistics."""

    def __init__(self, size: int, fields: Sequence[str], dtype: torch.dtype = torch.float32) -> None:
        self.size = size
        self.fields = tuple(fields)
        self.dtype = dtype
        self.count = torch.zeros(0, dtype=torch.int64)
        self.buf = {f: torch.full((size, 0), _NAN, dtype=dtype) for f in fields}

    def _grow(self, n: int) -> None:
        have = self.count.numel()
        if n <= have:
            return
        n = max(n, 2 * have, 64)
        self.count = torch.cat([self.count, torch.zeros(n - have, dtype=torch.int64)])
        for f in self.fields:
            self.buf[f] = torch.cat([self.buf[f], torch.full((self.size, n - have), _NAN, dtype=self.dtype)], 1)

    def observe(self, ids: list[int], columns: dict[str, torch.Tensor]) -> None:
        if not ids:
            return
        self._grow(max(ids) + 1)
        idx = torch.tensor(ids, dtype=torch.int64)
        pos = self.count[idx] % self.size
        for f, col in columns.items():
            self.buf[f][pos, idx] = col
        self.count[idx] += 1

    def last(self, field: str, back: int = 0) -> torch.Tensor:
        """The observation ``back`` steps before the latest, per id (NaN where there is none)."""
        pos = (self.count - 1 - back) % self.size
        out = self.buf[field].gather(0, pos.unsqueeze(0)).squeeze(0)
        return torch.where(self.count > back, out, torch.full_like(out, _NAN))

    def valid(self) -> torch.Tensor:
        """[size, ids] mask of the slots written so far."""
        return torch.arange(self.size).unsqueeze(1) < self.count.clamp(max=self.size).unsqueeze(0)


class DynamicDetectors:
    def __init__(self, window: int = 16) -> None:
        self.window = window
        # flat: bit k set when call k's output had no spread (std 0 over more than one value)
        # least: a module called several times a step, its call with the fewest dead units (dead-units needs them
        # dead in every call: RAFT's motion encoder meets a zero flow in its first call only)
        self.modules = _Window(window, ("std", "mean", "dead", "least", "sat", "nonfinite", "numel", "zero", "flat"))
        # per module call: the sampled step it was in (counted here) and its output's size, exactly
        self.calls = _Window(window, ("at", "numel", "per_unit"), torch.float64)
        self.samples = 0                    # sampled steps observed
        # the latest sampled step's modules and the execution order of their first calls (a dict made when needed)
        self._latest: tuple[list[int], list[int]] = ([], [])
        self._orders: dict[int, int] | None = None
        self._at: dict[int, int] = {}       # module -> its judged call's place in that order (:meth:`_preceding`)
        self.sites = CallSites()            # the modules called several times a step, and which call is judged
        self.updates = _Window(NOT_UPDATING_STEPS, ("step", "grad", "data", "update", "arrived", "lr", "held"))
        self.quiet = torch.zeros(0)         # per tensor: observed optimizer steps in a row without gradient or change
        self.arrivals = _Window(ACCUMULATING_STEPS, ("stale", "grad"))

    def observe(self, m: ModuleColumns, t: TensorColumns) -> None:
        stats = dict(zip(MODULE_STATS, m.stats.to(torch.float32).T, strict=True))
        numel = torch.tensor(m.numel, dtype=torch.float64)
        flat = self.sites.observe(m, stats["std"], numel)
        least = self.sites.least_dead(m, stats["dead_frac"])
        self.modules.observe(m.module_ids, {
            "std": stats["std"], "mean": stats["mean"], "dead": stats["dead_frac"], "least": least,
            "sat": stats["sat_frac"],
            "nonfinite": stats["nonfinite"], "numel": numel.to(torch.float32), "zero": stats["zero_frac"],
            "flat": flat})
        self.calls.observe(m.module_ids, {"at": torch.full((len(m.module_ids),), float(self.samples),
                                                           dtype=torch.float64), "numel": numel,
                                        "per_unit": torch.tensor(m.per_unit, dtype=torch.float64)})
        self.samples += 1
        self._latest, self._orders = (m.module_ids, m.order), None
        upd = [i for i, u in enumerate(t.update_norm) if u is not None]        # observed optimizer steps
        if upd:
            ids, cols = _rows(t.tensor_ids, upd, {
                "step": [t.step] * len(t.tensor_ids), "grad": t.grad_norm, "data": t.data_norm,
                "update": t.update_norm, "arrived": t.arrived, "lr": t.lr,
                "held": [g is not None for g in t.grad_norm]})
            self.updates.observe(ids, cols)
            if self.quiet.numel() < self.updates.count.numel():
                self.quiet = torch.cat([self.quiet, torch.zeros(self.updates.count.numel() - self.quiet.numel())])
            idx = torch.tensor(ids, dtype=torch.int64)
            self.quiet[idx] = not_moving.quiet_steps(cols["arrived"], cols["update"], self.quiet[idx])
        arr = [i for i, a in enumerate(t.arrived) if a]
        if arr:
            self.arrivals.observe(*_rows(t.tensor_ids, arr, {"stale": t.stale_grad_norm, "grad": t.grad_norm}))

    def evaluate(self, view: ModelView, step: int, optimizer_stepped: bool,
                 update_rules: Callable[[tuple[int, int]], UpdateRule | None] = no_rules) -> list[Finding]:
        """The findings about states (dead units, saturation, tensors that do not update or accumulate
        gradients) the windows show now. Events (modes, NaN/Inf, bypassed forwards) are the EventBook's.
        ``update_rules``: a param group's update rule (update_size.py), from the optimizer's settings."""
        out = self._activations(step, view)
        if optimizer_stepped:
            out += self._not_updating(step, view, update_rules)
        out += self._accumulating(step, view)
        return out

    def _activations(self, step: int, view: ModelView) -> list[Finding]:
        w = self.modules
        if not w.count.numel():
            return []
        samples = w.count.clamp(max=w.size)
        eligible = (samples >= MIN_SAMPLES) & ~(w.last("nonfinite") > 0)   # NaN/Inf: non-finite says it
        valid = w.valid()
        # flat (no spread over more than one value) in every sample of the window, at the same call; an output of
        # one value per call is one unit: constant when that value stayed the same over MIN_UNIT_VALUES calls
        flat = flat_in_every_sample(w.buf["flat"], valid)
        same_value = ((w.buf["mean"] == w.last("mean")) | ~valid).all(0)
        one_value = (samples >= MIN_UNIT_VALUES) & ((w.buf["numel"] == 1) | ~valid).all(0) & same_value
        # and the same value in every sample: a zero-initialised gate or modulation (NFNet's and DiT's, a
        # ControlNet's zero convolutions) starts flat and moves as it learns
        constant = eligible & (((flat > 0) & same_value) | one_value)
        dead = w.last("dead")
        dead_layer = eligible & ~constant & (dead >= DEAD_LAYER)
        dead_units = eligible & ~constant & (w.last("least") >= DEAD_UNITS) & (dead < DEAD_LAYER)
        sats = torch.stack([w.last("sat", k) for k in range(MIN_SAMPLES)])
        sat_mean = sats.mean(0)
        saturated = eligible & ~torch.isnan(sats).any(0) & (sat_mean > SATURATED)
        out: list[Finding] = []
        flagged = (constant | dead_layer | dead_units | saturated).nonzero().flatten().tolist()
        trained: frozenset[int] | None = None       # the modules owning trained tensors, made when needed
        wrappers = self._wrappers((constant | dead_layer | dead_units).nonzero().flatten().tolist(), view)
        judged = {mid: self._enough_for_dead(mid, bool(constant[mid]), _drop_probability(view, mid))
                  for mid in flagged if view.has_module(mid)}
        self.sites.judge(flagged, constant, flat)
        # a dropout whose input is flagged shows its input's dead units: reported at the activation that kills them
        dropouts = [m for m in flagged if judged.get(m) is not None and m not in wrappers and _drops_at_random(view, m)]
        if dropouts:
            shown = {m for m in flagged if bool(constant[m] | dead_layer[m] | dead_units[m])}
            preceding = self._preceding(wrappers, view)
            for m in dropouts:
                if self.sites.judged_in(preceding(m), shown):
                    judged[m] = None
        # an unjudged dropout passes a dead input on (zeros stay zeros): a link of the chain
        dead_inputs = self._dead_inputs(
            [m for m in flagged if judged.get(m) is not None and m not in wrappers
             and bool(constant[m] | dead_layer[m] | dead_units[m])],
            {m for m in flagged if m in judged and (judged[m] is not None or _drops_at_random(view, m))
             and bool(constant[m] | dead_layer[m])}, wrappers, view)
        for mid in flagged:
            if not view.has_module(mid):
                continue
            path, typ, n = view.module_path(mid), view.module_type(mid), int(samples[mid])
            dead_judged = judged[mid]
            if dead_judged is not None:
                n = dead_judged
            last_std = _opt(w.last("std")[mid])
            ev = {"dead_fraction": _opt(dead[mid]), "window_samples": n, "zero_fraction": _opt(w.last("zero")[mid]),
                  "std": last_std, "type": typ}
            link = dead_inputs.get(mid)
            dead_input = (view.module_path(link[0]), view.module_path(link[1])) if link is not None else None
            call, mean = self.sites.judged(mid) or (None, _opt(w.last("mean")[mid]))
            ev |= {"call": call[0] + 1, "calls": call[1]} if call is not None else {}
            if dead_judged is None or mid in wrappers:
                pass
            elif constant[mid]:
                out.append(DeadLayer.constant(path, typ, mean, n, ev, step, dead_input, call))
            elif dead_layer[mid]:
                out.append(DeadLayer.build(path, typ, float(dead[mid]), n, ev, step, dead_input, call))
            elif dead_units[mid]:
                out.append(DeadUnits.build(path, typ, float(dead[mid]), n, ev, step, dead_input, call))
            # the activation itself: the wrappers returning its very output share its statistics
            kind = view.saturation.get(mid) if saturated[mid] else None
            if kind:
                output_layer = False
                if kind == "sigmoid":       # a probability output; a Tanh's saturation is no confidence
                    if trained is None:
                        trained = frozenset(m for t in view.trained_tensors for m in view.owners.get(t, ()))
                    output_layer = self._is_output_layer(mid, view, trained)
                out.append(Saturated.build(path, typ, float(sat_mean[mid]), MIN_SAMPLES, step,
                                              output_layer=output_layer))
        return out

    def _wrappers(self, mids: list[int], view: ModelView) -> set[int]:
        """Those of ``mids`` that return the very output of a module of ``mids`` below them (a Sequential or a block
        ending in its ReLU shares the ReLU's statistics): the finding is the innermost one's."""
        if len(mids) < 2:
            return set()
        flagged = set(mids)
        last = {f: self.modules.last(f) for f in ("dead", "numel", "std", "mean")}

        def same(a: int, b: int) -> bool:
            rows = self.sites.rows(b) or [torch.stack([v[b] for v in last.values()])]   # or one of b's calls
            mine = torch.stack([v[a] for v in last.values()])
            return any(bool(((mine == r) | (torch.isnan(mine) & torch.isnan(r))).all()) for r in rows)

        out: set[int] = set()
        for mid in mids:
            node = view.modules.get(mid)
            seen: set[int] = set()
            while node is not None and node.parent_id is not None and node.parent_id not in seen:
                parent = node.parent_id
                seen.add(parent)
                if parent in flagged and same(parent, mid):
                    out.add(parent)
                node = view.modules.get(parent)
        return out

    def _dead_inputs(self, reported: list[int], dead: set[int], wrappers: set[int], view: ModelView
                     ) -> dict[int, tuple[int, int]]:
        """Module id -> (the module whose dead output is its input, the first dead layer of that chain) for those of
        ``reported`` (dead, constant or with dead units) whose input is dead: the module that ended last before it
        started in the latest sampled step's execution order (a wrapper returning its child's output: that child) is
        one of ``dead`` (dead or constant, reported). What is dead because its input is dead is a consequence of the
        first dead layer, in execution order; one whose input is alive (the previous module is not dead) is a root.
        A module called several times a step is dead in the call judged (CallSites), which is where it stands in
        the order. Only the rare step that flags two dead modules pays for the order."""
        if not dead or len(reported) < 2:
            return {}
        before = self._preceding(wrappers, view)
        at = self._at
        chain: dict[int, tuple[int, int]] = {}
        for mid in sorted((m for m in {*reported, *dead} if m in at), key=at.__getitem__):
            prev = before(mid)
            if prev is not None and prev[0] != mid and self.sites.judged_in(prev, dead):
                chain[mid] = (prev[0], chain[prev[0]][1] if prev[0] in chain else prev[0])
        shown = set(reported)       # the first dead layer must be reported (not a dropout, not a wrapper)
        return {m: link for m in reported if (link := chain.get(m)) is not None and link[1] in shown}

    def _preceding(self, wrappers: set[int], view: ModelView) -> Callable[[int], tuple[int, int] | None]:
        """The module whose output is a module's input, and which of its calls: the one that ended last before it
        started in the latest sampled step's execution order (its own children excluded; a wrapper returning its
        child's output: that child), None when unknown; a module called several times starts where its judged call
        (CallSites, else its first) does. Made only when a step flags a dropout or two dead modules."""
        if self._orders is None:
            self._orders = dict(zip(*self._latest, strict=False))
        seq, at = self.sites.sequence(self._orders)
        self._at = at

        def inside(mid: int, ancestor: int) -> bool:
            node, seen = view.modules.get(mid), set()
            while node is not None and node.parent_id is not None and node.parent_id not in seen:
                if node.parent_id == ancestor:
                    return True
                seen.add(node.parent_id)
                node = view.modules.get(node.parent_id)
            return False

        def before(mid: int) -> tuple[int, int] | None:
            if mid not in at:
                return None
            i = at[mid] - 1
            while i >= 0 and inside(seq[i][1], mid):      # its own children ran inside it, on its input
                i -= 1
            while i >= 0 and seq[i][1] in wrappers:       # a wrapper's output is its last child's
                i -= 1
            return (seq[i][1], seq[i][2]) if i >= 0 else None

        return before

    def _enough_for_dead(self, mid: int, constant: bool = False, drop: _Drop | None = None) -> int | None:
        """The module's calls within the window its unit activity covers (the last ``window`` sampled steps), when
        they are evidence enough that a unit never activates; None when not: fewer than MIN_SAMPLES, or outputs that
        held fewer than MIN_UNIT_VALUES values per unit over them (SPARSE_ROWS for a module called in some of those
        steps only; the judged call of each step counted), or a dropout
        training (``drop``) under which a live unit's values may all have been dropped (chance DROPPED_ALL or more).
        A ``constant`` output over MIN_SAMPLES calls whose outputs held MIN_UNIT_VALUES values per unit is evidence
        enough, in whichever steps it was called."""
        c = self.calls
        if mid >= c.count.numel():
            return None
        at, numel = c.buf["at"][:, mid], c.buf["numel"][:, mid]
        inside = at > self.samples - 1 - self.window         # False for a slot never written (NaN)
        n = int(inside.sum())
        if n < MIN_SAMPLES:
            return None
        every_step = n >= min(self.window, self.samples)      # called in every sampled step of the window
        sizes = [int(v) for v in numel[inside].tolist() if v > 0]
        if not sizes:
            return None
        # every output holds (units x rows) values, so the sizes' gcd is a multiple of the units: at least sum / gcd
        # values per unit (one per call with one batch size)
        bound = sum(sizes) // math.gcd(*sizes)
        per_unit = [int(v) for v in c.buf["per_unit"][:, mid][inside].tolist()]
        rows = sum(per_unit) if all(v > 0 for v in per_unit) else bound    # exactly, where the layouts tell
        if constant:
            # a flat output needs no rows per unit beyond these: a Squeeze-and-Excitation ReLU on two pooled
            # samples a step can stay at zero for a few steps while alive
            return n if rows >= MIN_UNIT_VALUES else None
        if rows < (MIN_UNIT_VALUES if every_step else SPARSE_ROWS):
            return None
        if drop is not None:
            # independent draws per unit: each value (Dropout), else at least one per call (a channel or a sample).
            # The bound, not the exact count: a live unit may be non-zero in a few of its values only (sparse
            # features, one-hot inputs), and then its values are not all draws of the dropout
            draws = bound if drop.elementwise else n
            if drop.p >= 1 or (drop.p > 0 and draws * math.log(drop.p) >= math.log(DROPPED_ALL)):
                return None
        return n

    def _is_output_layer(self, mid: int, view: ModelView, trained: frozenset[int]) -> bool:
        """No module owning trained tensors (``trained``) ended its first call after the first call of ``mid`` in the
        latest sampled step, but the modules around it (a call ends after its children's): no trained layer runs
        on its output, which is the model's. A generator's final Tanh, which the discriminator runs on, is hidden.
        Never when nothing trains (no optimizer watched): which layers train is unknown."""
        if not trained:
            return False                 # no optimizer watched: nothing says which layers train
        if self._orders is None:
            self._orders = dict(zip(*self._latest, strict=False))
        orders = self._orders
        order = orders.get(mid)
        if order is None:
            return False
        ancestors = set()
        node = view.modules.get(mid)
        while node is not None and node.parent_id is not None and node.parent_id not in ancestors:
            ancestors.add(node.parent_id)
            node = view.modules.get(node.parent_id)
        return not any(orders.get(m, -1) > order for m in trained if m not in ancestors)

    def _not_updating(self, step: int, view: ModelView,
                      update_rules: Callable[[tuple[int, int]], UpdateRule | None]) -> list[Finding]:
        w = self.updates
        if not w.count.numel():
            return []
        rule = w.count >= NOT_UPDATING_STEPS
        for k in range(NOT_UPDATING_STEPS):
            grad, data = w.last("grad", k), w.last("data", k)
            rule &= (w.last("arrived", k) == 1) & torch.isfinite(grad) & (grad > 0) & (w.last("update", k) == 0)
            rule &= grad > NEGLIGIBLE_GRAD * torch.nan_to_num(data, nan=0.0)
        plain = set(rule.nonzero().flatten().tolist())
        out = not_moving.unchanged(w, [t for t in sorted(plain) if view.tensor_known(t)], view, step,
                                   NOT_UPDATING_STEPS, update_rules)
        return out + not_moving.not_moving(w, self.quiet, view, step, NOT_UPDATING_STEPS, plain.__contains__)

    def _accumulating(self, step: int, view: ModelView) -> list[Finding]:
        """Tensors whose .grad held the previous gradient when the next arrived. When (nearly, NEVER_ZEROED) every
        tensor an optimizer holds that got gradients does, nothing zeroes its gradients (zero_grad() forgotten): one
        finding at the root for them; a tensor no optimizer holds (nothing zeroes it) has its own."""
        w = self.arrivals
        if not w.count.numel():
            return []
        judged = w.count >= ACCUMULATING_STEPS
        rule = judged.clone()
        for k in range(ACCUMULATING_STEPS):
            rule &= w.last("stale", k) > 0
        flagged = [t for t in rule.nonzero().flatten().tolist() if view.tensor_known(t)]
        if not flagged:
            return []
        held: dict[int, list[int]] = {}          # optimizer -> its tensors that accumulate
        opt_of: dict[int, int | None] = {}
        for tid in flagged:
            group = view.tensor_group(tid)
            opt_of[tid] = group[0] if group is not None else None
            if group is not None:
                held.setdefault(group[0], []).append(tid)
        never_zeroed: dict[int, int] = {}        # optimizer -> its tensors that got gradients in as many steps
        totals: dict[int, int] = {}
        if held:
            totals = {o: len(tids) for o, tids in held.items()}
            for tid in (judged & ~rule).nonzero().flatten().tolist():     # few: most accumulate, or none is held
                if view.tensor_known(tid) and (group := view.tensor_group(tid)) is not None and group[0] in totals:
                    totals[group[0]] += 1
            never_zeroed = {o: n for o, n in totals.items() if len(held[o]) >= NEVER_ZEROED * n}
        out = []
        ks = list(reversed(range(ACCUMULATING_STEPS)))
        for tid in flagged:
            opt = opt_of[tid]
            if opt is not None and opt in never_zeroed:
                continue                         # the root finding says it
            judged_n = totals.get(opt) if opt is not None else None
            out.append(GradAccumulating.build(
                view.tensor_path(tid), [_opt(w.last("stale", k)[tid]) for k in ks],
                [_opt(w.last("grad", k)[tid]) for k in ks], step, opt,
                zeroed=judged_n - len(held[opt]) if judged_n is not None and opt is not None else None,
                judged=judged_n))
        if never_zeroed:
            opts = sorted(never_zeroed)
            out.append(GradAccumulating.never_zeroed(
                opts, max(view.n_optimizers, len(opts)), [view.tensor_path(t) for o in opts for t in held[o]],
                sum(never_zeroed.values()), step))
        return out


def _drops_at_random(view: ModelView, mid: int) -> bool:
    """Dropout: its zeros are drawn at random (few rows make a unit look dead), and the units that die upstream are
    reported at the activation that kills them."""
    node = view.modules.get(mid)
    return node is not None and node.module is not None and drops_at_random(node.module)


@dataclasses.dataclass(frozen=True)
class _Drop:
    """A dropout module in training: its drop probability, and whether each value is drawn apart (nn.Dropout)
    or a whole channel or sample at once (Dropout2d, DropPath)."""

    p: float
    elementwise: bool


def _drop_probability(view: ModelView, mid: int) -> _Drop | None:
    """The drop of a dropout module in training (p 1 when unknown: never judged); None for any other module and a
    dropout in eval mode, the identity."""
    node = view.modules.get(mid)
    module = node.module if node is not None else None
    if module is None or not drops_at_random(module) or not module.training:
        return None
    p = getattr(module, "p", getattr(module, "drop_prob", None))
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
        return _Drop(1.0, False)
    return _Drop(float(p), type(module) in (torch.nn.Dropout, torch.nn.AlphaDropout))


def _opt(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v
