"""Normalization layers with running statistics, dropout layers, and the frozen blocks around them.

A block is frozen when none of its parameters is trainable and they do not change between sampled steps. Whether
they changed is told by a sample of their values taken at the end of each sampled step (with the step's one host
copy): a momentum encoder updated through ``.data`` (MoCo, DINO) bumps no version counter, yet its values move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

# values of a block's parameters sampled to tell whether it changed between sampled steps: strided across each
# tensor, so an update of every value (a momentum encoder's) is seen in any of them
BLOCK_SAMPLE = 64


class _Node(Protocol):
    @property
    def parent_id(self) -> int | None: ...
    @property
    def module(self) -> nn.Module | None: ...
    @property
    def type(self) -> str: ...


class ModulesView(Protocol):
    @property
    def modules(self) -> Mapping[int, _Node]: ...


@dataclasses.dataclass(frozen=True)
class BlockState:
    """A frozen block's parameters at the end of a sampled step: their sampled values and version counters."""

    values: tuple[float, ...]
    versions: int


@dataclasses.dataclass(frozen=True)
class FrozenBlockSample:
    """The normalization layers (and the dropout layers, under no_grad) that ran in training mode inside frozen blocks
    in a sampled step that trained, and where their block's sampled values lie in the step's fetched vector
    ``slot``."""

    slot: int
    spans: Mapping[int, tuple[int, int, int]]       # module id -> (start, length, version sum)

    def read(self, fetched: Sequence[float]) -> dict[int, BlockState]:
        return {mid: BlockState(tuple(fetched[start:start + n]), versions)
                for mid, (start, n, versions) in self.spans.items()}


def sample_frozen_blocks(view: ModulesView, norms: Iterable[int], dropouts: Iterable[int] = ()
                        ) -> tuple[torch.Tensor, dict[int, tuple[int, int, int]]] | None:
    """For the normalization layers with running statistics among ``norms`` (they ran in training mode) and the
    dropout layers ``dropouts`` (they ran in training mode under no_grad) that are in frozen blocks: one vector of
    their blocks' sampled values (each block once), and where each layer's lies (the ``spans`` of a
    :class:`FrozenBlockSample`); None when there are none (the common case)."""
    parts: list[torch.Tensor] = []
    spans: dict[int, tuple[int, int, int]] = {}
    blocks: dict[tuple[int, ...], tuple[int, int, int]] = {}
    pos = 0
    # in the model's order (ids follow it): findings list them so
    candidates = [(mid, True) for mid in norms] + [(mid, False) for mid in dropouts]
    for mid, norm in sorted(candidates):
        if norm and not is_norm(view, mid):
            continue
        params = frozen_norm_parameters(view, mid) if norm else frozen_block(view, mid, beside=False)
        if not params:
            continue
        key = tuple(map(id, params))
        span = blocks.get(key)
        if span is None:
            values = block_sample(params)
            n = 0 if values is None else int(values.numel())
            if values is not None:
                if parts and values.device != parts[0].device:
                    values = values.to(parts[0].device)
                parts.append(values)
            span = blocks[key] = (pos, n, version_sum(params))
            pos += n
        spans[mid] = span
    if not parts:
        return None
    return torch.cat(parts), spans


def is_norm(view: ModulesView, module_id: int) -> bool:
    """A normalization layer that keeps running statistics (BatchNorm*, SyncBatchNorm, InstanceNorm* that track
    them, a library's own BatchNorm class) -- not a FrozenBatchNorm2d (torchvision, detectron2): its statistics are
    constants, and its training flag changes nothing."""
    node = view.modules.get(module_id)
    if node is None:
        return False
    module = node.module
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return bool(module.track_running_stats)
    name = node.type
    if "Frozen" in name:
        return False
    return "BatchNorm" in name or "InstanceNorm" in name


def frozen_norm_parameters(view: ModulesView, module_id: int) -> list[nn.Parameter] | None:
    """The parameters that make a normalization layer with running statistics frozen (:func:`frozen_block`); None
    when it is not such a layer. (Freezing only the layers' affine parameters while the convolutions around them
    train is a recipe of its own: their statistics must follow the changing features.)"""
    node = view.modules.get(module_id)
    module = node.module if node is not None else None
    if module is None or not getattr(module, "track_running_stats", False) or getattr(module, "momentum", None) == 0:
        return None
    return frozen_block(view, module_id)


def in_frozen_block(view: ModulesView, module_id: int) -> bool:
    """A frozen block, or a module of one (a frozen teacher, or its Dropout: eval() on it is how the teacher is
    frozen). A block is a module with children: a leaf layer's own frozen parameters make no frozen block (a
    BatchNorm with frozen affine parameters in a network that trains)."""
    node = view.modules.get(module_id)
    module = node.module if node is not None else None
    if module is not None and next(iter(module.children()), None) is not None:
        params = list(module.parameters())
        if params and not any(p.requires_grad for p in params):
            return True
    return frozen_block(view, module_id) is not None


def frozen_block(view: ModulesView, module_id: int, beside: bool = True) -> list[nn.Parameter] | None:
    """The parameters of a module's block when none is trainable: its own (an affine=False layer has none) and
    those of the nearest enclosing module with parameters of its own beyond the module's; where that module trains,
    the module's own with those of the layer before it there, when that one is frozen too (a ResNet's stem ``conv1``
    and ``bn1`` frozen at the top of a model whose later stages train; not with ``beside=False``: a dropout after a
    frozen embedding in a model that trains belongs to no frozen part); None otherwise."""
    node = view.modules.get(module_id)
    module = node.module if node is not None else None
    if module is None:
        return None
    own = list(module.parameters())
    if any(p.requires_grad for p in own):
        return None
    branch, parent = module, node.parent_id if node is not None else None
    while parent is not None:
        above = view.modules.get(parent)
        if above is None or above.module is None:
            return None
        params = list(above.module.parameters())
        if len(params) > len(own):
            if not any(p.requires_grad for p in params):
                return params
            before = _layer_before(above.module, branch) if beside else None
            if before is None or any(p.requires_grad for p in before):
                return None
            return [*own, *before]
        branch, parent = above.module, above.parent_id
    return None


def _layer_before(parent: nn.Module, child: nn.Module) -> list[nn.Parameter] | None:
    """The parameters of the nearest child of ``parent`` registered before ``child`` that has any; None when there is
    none."""
    before = None
    for sibling in parent.children():
        if sibling is child:
            return before
        params = list(sibling.parameters())
        if params:
            before = params
    return None


def block_sample(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """About BLOCK_SAMPLE values of ``params``, strided across each (float32, on the first one's device); None when
    they hold no floating-point values. The same parameters unchanged give the same values, bit for bit."""
    floats = [p for p in params if p.is_floating_point() and p.numel() and not p.is_meta]
    if not floats:
        return None
    device = floats[0].device
    per = max(1, BLOCK_SAMPLE // len(floats))
    parts = []
    with torch.no_grad():
        for p in floats:
            local = getattr(p, "to_local", None)          # a DTensor: this rank's shard (no collective)
            flat = (local() if callable(local) else p).detach().reshape(-1)
            stride = max(1, flat.numel() // per)
            parts.append(flat[::stride][:per].to(device=device, dtype=torch.float32))
        return torch.cat(parts)


def version_sum(params: Sequence[Any]) -> int:
    """The parameters' version counters together: an in-place change bumps one (through ``.data`` it does not: the
    sampled values see that)."""
    return sum(p._version for p in params)
