"""Modules that run inside the model's forward but are reachable from none of its attributes: held in a
closure or a global, or built inside ``forward``. Found while forward runs, named ``<unreachable Type>``
under the module that called them, and kept (with what was seen of them) for the rest of the run."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

from torch import nn

from ..schema import ModuleKind, attr_path, runtime_label
from .index import IdRegistry, ModelIndex
from .structure import ModuleNode, subtree_has_state_or_modes


@dataclasses.dataclass(frozen=True)
class RuntimeKey:
    """A run-time module is known by its caller, its type and its rank among that caller's modules of
    that type in one forward: the same code path gives the same key every step."""

    parent_id: int
    type_name: str
    occurrence: int


@dataclasses.dataclass(frozen=True)
class RuntimeSighting:
    """A run-time module with parameters, buffers or modes, as the last forward that called it showed it: the
    findings rules tell from it whether it is held in a closure or a global, or built anew on every call."""

    path: str
    type_name: str
    called_from: str          # the path of the module whose forward called it
    seen_before: bool         # a module was called at this place in an earlier step
    same_object: bool         # ... and it was this very object
    numel: int
    step: int


@dataclasses.dataclass
class ForwardSightings:
    """What one step's forwards have seen so far (reset at every step)."""

    by_object: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)   # (id, type) -> module id
    per_caller: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)  # (caller, type) -> count


class RuntimeModules:
    def __init__(self, ids: IdRegistry) -> None:
        self._ids = ids
        self._nodes: dict[RuntimeKey, ModuleNode] = {}
        self._objects: dict[RuntimeKey, weakref.ref[nn.Module]] = {}
        self._sightings: dict[str, RuntimeSighting] = {}

    def nodes(self) -> list[ModuleNode]:
        return list(self._nodes.values())

    def sightings(self) -> list[RuntimeSighting]:
        """The run-time modules that matter to the optimizer, state_dict(), .to() or .eval()."""
        return list(self._sightings.values())

    def clear(self) -> None:
        """Drop the references to the user's modules (the watcher is closing)."""
        self._objects.clear()

    def lookup(self, module: nn.Module, seen: ForwardSightings) -> int | None:
        """The id of a run-time module already met in this step's forwards."""
        return seen.by_object.get((id(module), type(module).__name__))

    def discover(self, module: nn.Module, parent_id: int, index: ModelIndex, seen: ForwardSightings,
                 step: int) -> tuple[int, ModuleNode | None]:
        """The module id of ``module`` called under ``parent_id``, and its node if it is new to the run."""
        tname = type(module).__name__
        known = seen.by_object.get((id(module), tname))
        if known is not None:
            return known, None
        k = seen.per_caller.get((parent_id, tname), 0)
        seen.per_caller[(parent_id, tname)] = k + 1
        key = RuntimeKey(parent_id, tname, k)
        node = self._nodes.get(key)
        new = node is None
        parent = index.modules.get(parent_id)
        ppath = parent.path if parent is not None else ""
        if node is None:
            label = runtime_label(tname, k)
            path = attr_path(ppath, label)
            params = list(module.parameters())
            node = ModuleNode(module_id=self._ids.module_id(path), path=path, parent_id=parent_id, name=label,
                              type=tname, type_module=type(module).__module__, kind=ModuleKind.RUNTIME,
                              depth=(parent.depth + 1) if parent is not None else 1, module=None,
                              params_total=sum(p.numel() for p in params),
                              params_trainable=sum(p.numel() for p in params if p.requires_grad))
            self._nodes[key] = node
        previous = self._objects.get(key)
        same_object = previous is not None and previous() is module
        with contextlib.suppress(TypeError):
            self._objects[key] = weakref.ref(module)
        if subtree_has_state_or_modes(module):
            self._sightings[node.path] = RuntimeSighting(
                node.path, node.type, ppath, seen_before=previous is not None, same_object=same_object,
                numel=node.params_total, step=step)
        # a module with no parameters, buffers or modes built at run time (HF models build their loss
        # criterion in forward) harms nothing: it shows in the tree, not as a finding
        seen.by_object[(id(module), tname)] = node.module_id
        return node.module_id, node if new else None
