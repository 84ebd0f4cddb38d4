"""The model index: everything the probes need to know about the watched model, as one immutable object.

Built from the static structure walk (:mod:`probes.model.structure`) with ids that stay stable for the whole
run: a module keeps its id while it is part of the model, also when it moves to another path (a ModuleList item
popped before it); a new module put at a path (a head replaced mid-run) gets a new id, and so do its tensors, so
that what it replaced keeps its own rows and history (marked as removed, :class:`Presence`). Plus the modules
discovered while forward ran (:mod:`probes.model.runtime`). The detectors read it through the same named methods
the hooks use.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import torch
from torch import nn

from ..schema import FindingCode, ModuleKind, TensorKind
from .frozen import is_norm
from .structure import (
    ModelStructure,
    ModuleNode,
    TensorNode,
    build_structure,
    drops_at_random,
    is_mode_sensitive,
    is_uninitialized,
    saturation_kind,
    subtree_has_state_or_modes,
)


class IdRegistry:
    """Ids for the whole run. A module keeps its id for as long as it is part of the model, at its path or at
    another one it moved to (``model.blocks.pop(2)`` moves ``blocks.3`` to ``blocks.2``; ``insert(0, ...)`` moves
    every block): the id is the module object's. Another module put at a path (``model.head = nn.Linear(...)``)
    gets a new id. A tensor's id is its name under its owning module's id (its path below the module's): a tensor
    that moves with its module keeps its id, a new module's tensors are new, a parameter replaced on the same module
    keeps its id."""

    def __init__(self) -> None:
        self._paths: dict[str, int] = {}           # path -> the id last given at it
        self._objects: dict[int, tuple[weakref.ref[nn.Module], int]] = {}   # id(module) -> (the module, its id)
        self._bound: set[int] = set()              # ids given to a module object (never reused by path alone)
        self._n_modules = 0
        self._pruned_at = 0
        self._tensors: dict[tuple[str, int | None], int] = {}

    def _new(self) -> int:
        mid = self._n_modules
        self._n_modules += 1
        return mid

    def module_id(self, path: str, module: nn.Module | None = None) -> int:
        """The id of the module at ``path`` (``module``: the object there now; None: by path alone: a module found
        while forward ran)."""
        if module is None:
            mid = self._paths.get(path)
            if mid is None:
                mid = self._paths[path] = self._new()
            return mid
        known = self._objects.get(id(module))
        if known is not None and known[0]() is module:
            mid = known[1]
        else:
            mid = self._paths.get(path)
            if mid is None or mid in self._bound:
                mid = self._new()               # a module new to the run (another one may have been at this path)
            try:
                ref = weakref.ref(module)
            except TypeError:                   # not weakly referenceable: known by its path alone
                pass
            else:
                self._objects[id(module)] = (ref, mid)
                self._bound.add(mid)
                self._prune()
        self._paths[path] = mid
        return mid

    def _prune(self) -> None:
        """Forget the modules that no longer exist (their ids are never given again)."""
        if len(self._objects) > 2 * self._pruned_at + 64:
            self._objects = {k: v for k, v in self._objects.items() if v[0]() is not None}
            self._pruned_at = len(self._objects)

    def tensor_id(self, name: str, owner: int | None = None) -> int:
        """The id of the tensor ``name`` (its path below its owning module's) owned by module id ``owner``."""
        return self._tensors.setdefault((name, owner), len(self._tensors))


@dataclasses.dataclass
class Presence:
    """Which modules and tensors the store holds as part of the model now, and the step at which each of the others
    left it (id -> step). A module or tensor whose id comes back is current again."""

    modules: dict[int, bool] = dataclasses.field(default_factory=dict)     # current id -> registered
    tensors: dict[int, bool] = dataclasses.field(default_factory=dict)
    removed_modules: dict[int, int] = dataclasses.field(default_factory=dict)
    removed_tensors: dict[int, int] = dataclasses.field(default_factory=dict)

    def update(self, index: ModelIndex, step: int) -> tuple[dict[int, int], dict[int, int]]:
        """Take ``index`` (built at ``step``) as the model now; returns what left it since the last one (modules,
        tensors: id -> step). A truncated walk (``walk_truncated``) did not see every unregistered module or tensor:
        only registered ones that are gone are removed then."""
        truncated = index.structure.walk_truncated
        modules = {mid: n.kind == ModuleKind.REGISTERED for mid, n in index.modules.items()}
        tensors = {tid: t.registered for tid, t in index.tensors.items()}
        gone_m = {mid: step for mid, reg in self.modules.items() if mid not in modules and (reg or not truncated)}
        gone_t = {tid: step for tid, reg in self.tensors.items() if tid not in tensors and (reg or not truncated)}
        kept_m = {mid: reg for mid, reg in self.modules.items() if mid not in modules and mid not in gone_m}
        kept_t = {tid: reg for tid, reg in self.tensors.items() if tid not in tensors and tid not in gone_t}
        self.modules = {**kept_m, **modules}
        self.tensors = {**kept_t, **tensors}
        for mid in modules:
            self.removed_modules.pop(mid, None)
        for tid in tensors:
            self.removed_tensors.pop(tid, None)
        self.removed_modules.update(gone_m)
        self.removed_tensors.update(gone_t)
        return gone_m, gone_t

    def add(self, node: ModuleNode) -> None:
        """A module found while forward ran."""
        self.modules[node.module_id] = node.kind == ModuleKind.REGISTERED
        self.removed_modules.pop(node.module_id, None)


def measurable(t: torch.Tensor) -> bool:
    """A tensor whose values can be reduced: materialised, dense, floating point, not on the meta device."""
    return not (is_uninitialized(t) or t.device.type == "meta" or t.is_sparse or not t.is_floating_point())


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (the local shard of a DTensor)."""
    return t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]


ModelSignature = tuple[tuple[tuple[int, bool, bool], ...], tuple[int, ...]]


def _live_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every registered parameter of the live tree, each once: what ``model.parameters()`` yields, walked
    without its nested generators (several times cheaper on a model of 10,000s of modules)."""
    seen_modules: set[int] = set()
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    stack: list[nn.Module | None] = [model]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen_modules:
            continue
        seen_modules.add(id(m))
        if m._parameters:
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        if m._modules:
            stack.extend(m._modules.values())
    return out


def model_signature(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> ModelSignature:
    """Changes when parameters are replaced, materialised (lazy), frozen or unfrozen, or when the
    optimizers' param groups change: then the index must be rebuilt."""
    # type(p) is Parameter rules out a lazy parameter without the isinstance test (10,000s of parameters)
    params = tuple([(id(p), type(p) is not nn.Parameter and is_uninitialized(p), p.requires_grad)
                    for p in _live_parameters(model)])
    held = tuple(id(p) for o in optimizers for g in o.param_groups for p in g["params"])
    return (params, held)


@dataclasses.dataclass(frozen=True)
class ModelIndex:
    structure: ModelStructure
    modules: Mapping[int, ModuleNode]          # module id -> node (static walk + run-time discoveries)
    tensors: Mapping[int, TensorNode]          # tensor id -> node
    module_ids: Mapping[int, int]              # id(nn.Module object) -> module id
    paths: Mapping[str, int]                   # module path (and alias) -> module id
    tensor_paths: Mapping[str, int]            # tensor path -> tensor id
    root_id: int
    owners: Mapping[int, tuple[int, ...]]      # tensor id -> every module owning it, under any name
    mode_relevant: frozenset[int]              # modules whose .training matters
    saturation: Mapping[int, str | None]       # module id -> 'tanh' | 'sigmoid' | None
    bypass_exempt: frozenset[int]              # torch.nn children their parent uses functionally
    signature: ModelSignature
    n_optimizers: int
    wrappers: frozenset[int] = frozenset()     # id() of wrapper modules (DDP, FSDP units...): transparent

    @classmethod
    def empty(cls) -> ModelIndex:
        """An index of nothing: what a closed watcher keeps, so that it holds no reference to the model."""
        return cls(structure=ModelStructure([], [], [], False, 0), modules=MappingProxyType({}),
                   tensors=MappingProxyType({}), module_ids=MappingProxyType({}), paths=MappingProxyType({}),
                   tensor_paths=MappingProxyType({}), root_id=0, owners=MappingProxyType({}),
                   mode_relevant=frozenset(), saturation=MappingProxyType({}), bypass_exempt=frozenset(),
                   signature=((), ()), n_optimizers=0)

    # -- the view the detectors read ------------------------------------------------------------
    def module_path(self, module_id: int) -> str:
        node = self.modules.get(module_id)
        return node.path if node is not None else ""

    def module_type(self, module_id: int) -> str:
        node = self.modules.get(module_id)
        return node.type if node is not None else ""

    def has_module(self, module_id: int) -> bool:
        return module_id in self.modules

    def tensor_path(self, tensor_id: int) -> str:
        return self.tensors[tensor_id].path

    def tensor_module(self, tensor_id: int) -> int | None:
        node = self.tensors.get(tensor_id)
        return node.module_id if node is not None else None

    def tensor_known(self, tensor_id: int) -> bool:
        return tensor_id in self.tensors

    def tensor_in_optimizer(self, tensor_id: int) -> bool:
        return self.tensors[tensor_id].in_optimizer

    def tensor_group(self, tensor_id: int) -> tuple[int, int] | None:
        t = self.tensors[tensor_id]
        return (t.opt_index, t.opt_group) if t.opt_index is not None and t.opt_group is not None else None

    def mode_sensitive_modules(self) -> list[tuple[str, nn.Module]]:
        """Dropout/BatchNorm-like modules of the model (registered or not), with their paths."""
        return [(n.path, n.module) for n in self.structure.modules
                if n.module is not None and is_mode_sensitive(n.module)]

    def module_for_finding(self, code: str, path: str) -> int | None:
        """The module a finding is drawn on in the tree: the module at its path, else the owner of the
        tensor at its path; an optimizer entry that is not part of the model is drawn on the root."""
        mid = self.paths.get(path)
        if mid is not None:
            return mid
        tid = self.tensor_paths.get(path)
        if tid is not None:
            return self.tensors[tid].module_id
        if code == FindingCode.UNREGISTERED_MODULE:      # the layers of a plain list: drawn on its first layer
            return next((mid for p, mid in sorted(self.paths.items(), key=lambda kv: kv[1])
                         if p.startswith(path + "[")), None)
        return self.root_id if code == FindingCode.STALE_OPTIMIZER_PARAM else None

    # -- what the hooks attach to (read live: requires_grad can change between rebuilds) ----------------
    def top_level_modules(self) -> list[nn.Module]:
        """The root and its direct children: a sampled step is armed with pre-hooks on them."""
        return [n.module for n in self.structure.modules
                if n.module is not None and (n.parent_id is None or n.parent_id == self.root_id)]

    @functools.cached_property
    def random_drops(self) -> frozenset[int]:
        """Dropout layers that drop something (p > 0, drop-path)."""
        return frozenset(n.module_id for n in self.structure.modules if n.module is not None
                         and drops_at_random(n.module) and is_mode_sensitive(n.module))

    @functools.cached_property
    def running_stat_norms(self) -> frozenset[int]:
        """Normalization layers that keep running statistics (:func:`probes.model.frozen.is_norm`)."""
        return frozenset(n.module_id for n in self.structure.modules if is_norm(self, n.module_id))

    # These lists are computed once per index: the index is rebuilt when a parameter is replaced, frozen,
    # unfrozen or materialised (model_signature, checked after every sampled step).
    @functools.cached_property
    def _measurable(self) -> tuple[TensorNode, ...]:
        return tuple(t for t in self.structure.tensors if t.tensor is not None and measurable(t.tensor))

    @functools.cached_property
    def _grad_hook_targets(self) -> tuple[TensorNode, ...]:
        return tuple(t for t in self._measurable if t.kind != TensorKind.BUFFER and t.tensor is not None
                     and t.tensor.requires_grad and t.tensor.grad_fn is None)

    def grad_hook_targets(self) -> tuple[TensorNode, ...]:
        """Leaf tensors that receive gradients: each gets a gradient hook on a sampled step."""
        return self._grad_hook_targets

    @functools.cached_property
    def trained_tensors(self) -> frozenset[int]:
        """The leaves a watched optimizer holds that require grad: a gradient should reach each whenever its module
        runs in training."""
        return frozenset(t.param_id for t in self._grad_hook_targets if t.opt_index is not None)

    @functools.cached_property
    def _by_optimizer(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for t in self._measurable:
            if t.opt_index is not None:
                out.setdefault(t.opt_index, []).append(t.param_id)
        return out

    def optimizer_tensors(self, opt_index: int) -> list[int]:
        return self._by_optimizer.get(opt_index, [])

    @functools.cached_property
    def _tables_by_optimizer(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for t in self._measurable:
            owner = self.modules.get(t.module_id) if t.module_id is not None else None
            if t.opt_index is not None and t.name == "weight" and owner is not None and \
                    isinstance(owner.module, (nn.Embedding, nn.EmbeddingBag)) and \
                    type(t.tensor).__name__ != "DTensor":        # a shard's rows: not worth a collective
                out.setdefault(t.opt_index, []).append(t.param_id)
        return out

    def optimizer_tables(self, opt_index: int) -> list[int]:
        """The embedding tables among an optimizer's tensors: their gradient reaches only some rows."""
        return self._tables_by_optimizer.get(opt_index, [])

    @functools.cached_property
    def _leaves(self) -> tuple[TensorNode, ...]:
        """The measurable tensors that may hold a ``.grad``: no buffers, and no computed (non-leaf) tensors kept as
        attributes, such as the parameters of a TorchScript module deep-copied by ``AveragedModel`` (their ``.grad``
        is never filled, and reading it makes torch warn)."""
        return tuple(t for t in self._measurable if t.kind != TensorKind.BUFFER and t.tensor is not None
                     and t.tensor.is_leaf)

    @functools.cached_property
    def _orphans(self) -> list[int]:
        return [t.param_id for t in self._leaves if t.opt_index is None and t.tensor is not None
                and t.tensor.requires_grad]

    def orphan_tensors(self) -> list[int]:
        """Trainable tensors no watched optimizer holds: their change across a step proves (non-)updates."""
        return self._orphans

    @functools.cached_property
    def _gradient_tensors(self) -> list[int]:
        return [t.param_id for t in self._leaves]

    def gradient_tensors(self) -> list[int]:
        """Every tensor whose gradient is measured at the end of a step (no buffers, no non-leaf tensors)."""
        return self._gradient_tensors

    @functools.cached_property
    def _computed_tensors(self) -> list[int]:
        return [t.param_id for t in self._measurable if t.kind != TensorKind.BUFFER and t.tensor is not None
                and not t.tensor.is_leaf]

    def computed_tensors(self) -> list[int]:
        """The non-leaf tensors (left out of the gradient lists): only their values are measured."""
        return self._computed_tensors

    def fingerprint_tensors(self) -> list[int]:
        """Registered parameters and buffers that data parallelism keeps identical on every rank (not the
        shards of a sharded model: every rank holds a different part of those)."""
        if self.structure.sharded:
            return []
        return [t.param_id for t in self.structure.tensors
                if t.registered and t.tensor is not None and measurable(t.tensor)]

    def tensor(self, tensor_id: int) -> torch.Tensor:
        """The tensor's values on this rank (the local shard of a DTensor)."""
        t = self.tensors[tensor_id].tensor
        assert t is not None
        return local(t)

    def grad(self, tensor_id: int) -> torch.Tensor | None:
        """Its .grad on this rank (local shard), None when there is none or it is sparse."""
        t = self.tensors[tensor_id].tensor
        g = t.grad if t is not None else None
        return None if g is None or g.is_sparse else local(g)

    # -- run-time discoveries ---------------------------------------------------------------------
    def with_runtime(self, node: ModuleNode) -> ModelIndex:
        """This index plus a module discovered while forward ran."""
        modules = dict(self.modules)
        modules[node.module_id] = node
        paths = dict(self.paths)
        paths.setdefault(node.path, node.module_id)
        return dataclasses.replace(self, modules=MappingProxyType(modules), paths=MappingProxyType(paths))


def build_index(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], ids: IdRegistry,
                runtime_nodes: Iterable[ModuleNode] = ()) -> ModelIndex:
    """Walk the model and give every module and tensor its run-stable id."""
    s = build_structure(model, optimizers)
    # a tensor is known by its name below its owning module (the walk's module ids are positions in s.modules)
    names = [_below(t.path, s.modules[t.module_id].path if t.module_id is not None else None) for t in s.tensors]
    for node in s.modules:
        node.module_id = ids.module_id(node.path, node.module)
    remap = {i: n.module_id for i, n in enumerate(s.modules)}
    for node in s.modules:
        node.parent_id = remap.get(node.parent_id) if node.parent_id is not None else None
    for t, name in zip(s.tensors, names, strict=True):
        t.module_id = remap.get(t.module_id) if t.module_id is not None else None
        t.param_id = ids.tensor_id(name, t.module_id)
    modules = {n.module_id: n for n in s.modules}
    for rt in runtime_nodes:
        modules.setdefault(rt.module_id, rt)
    paths: dict[str, int] = {}
    for n in modules.values():
        paths.setdefault(n.path, n.module_id)
        for alias in n.aliases:
            paths.setdefault(alias, n.module_id)
    root_id = next((n.module_id for n in s.modules if n.path == ""), None)
    if root_id is None:
        root_id = ids.module_id("")
    live = [n for n in s.modules if n.module is not None]
    return ModelIndex(
        structure=s,
        modules=MappingProxyType(modules),
        tensors=MappingProxyType({t.param_id: t for t in s.tensors}),
        module_ids=MappingProxyType({id(n.module): n.module_id for n in live}),
        paths=MappingProxyType(paths),
        tensor_paths=MappingProxyType({t.path: t.param_id for t in s.tensors}),
        root_id=root_id,
        owners=MappingProxyType(_owners(s)),
        mode_relevant=frozenset(n.module_id for n in live if _mode_relevant(n)),
        saturation=MappingProxyType({n.module_id: saturation_kind(n.module) for n in live if n.module is not None}),
        bypass_exempt=frozenset(_functional_children(s, modules)),
        signature=model_signature(model, optimizers),
        n_optimizers=len(optimizers),
        wrappers=s.wrappers,
    )


def _below(path: str, owner: str | None) -> str:
    """A tensor's path below its owning module's path ``owner`` (``0.weight`` of ``blocks.0.weight`` under
    ``blocks``): the same while the module moves; the whole path where it has no owner (or, marked apart from every
    name below it, where its path is not below its owner's)."""
    if not owner:
        return path
    prefix = owner + "."
    return path[len(prefix):] if path.startswith(prefix) else "\x00" + path


def _mode_relevant(node: ModuleNode) -> bool:
    """Dropout/BatchNorm-like modules, and user modules with state (they may read self.training)."""
    module = node.module
    if module is None:
        return False
    # a torch container holding mode-sensitive modules too (``decoder.eval()`` on an nn.Sequential: its layers'
    # findings are told in its own)
    return is_mode_sensitive(module) or (not node.type_module.startswith("torch.")
                                         and subtree_has_state_or_modes(module)) \
        or (isinstance(module, nn.Sequential) and any(is_mode_sensitive(m) for m in module.modules()))


def _owners(s: ModelStructure) -> dict[int, tuple[int, ...]]:
    """Every module that owns a tensor, under any of its names (tied weights); a tensor no module of the tree owns
    has no entry (never an empty tuple: readers take the first owner)."""
    by_path = {n.path: n.module_id for n in s.modules}
    for n in s.modules:
        for a in n.aliases:
            by_path.setdefault(a, n.module_id)
    owners: dict[int, tuple[int, ...]] = {}
    for t in s.tensors:
        mids = [t.module_id] if t.module_id is not None else []
        for alias in t.aliases:
            mid = by_path.get(alias.rpartition(".")[0])
            if mid is not None and mid not in mids:
                mids.append(mid)
        if mids:
            owners[t.param_id] = tuple(mids)
    return owners


def _functional_children(s: ModelStructure, modules: Mapping[int, ModuleNode]) -> set[int]:
    """Modules whose torch.nn parent uses their parameters functionally (MultiheadAttention's
    out_proj): not calling them is by design, not a bypass."""
    out = set()
    for n in s.modules:
        if n.parent_id is None:
            continue
        parent = modules.get(n.parent_id)
        if parent is not None and parent.type_module.startswith("torch.nn"):
            out.add(n.module_id)
    return out
