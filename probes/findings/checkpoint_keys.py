"""``checkpoint-keys`` observed: a load of the watched model's state dict that left parts of the model unloaded, or
parts of the file unused, which ``load_state_dict(strict=False)`` returns and nothing shows (the rule and its finding:
:class:`probes.findings.rules.CheckpointKeys`).

A post-hook on the watched model (PyTorch's public ``register_load_state_dict_post_hook``) sees the missing and
unexpected keys of every ``load_state_dict()`` of it or of a wrapper around it (DDP, a compiled model), strict or
not: a strict load raises after the hooks ran, and a caller that catches that error has the same half-loaded model.

Severity: an error when trained weights are missing (parameters that require grad, not loaded under a tied name:
they keep the values they had, usually their random initialisation, while the rest of the model is the
checkpoint's); a warning when only buffers or frozen parameters are missing, or only keys of the file went unused.
Loading part of a model on purpose is done on that part (``model.backbone.load_state_dict(sd)``), which this hook on
the whole model does not see. An event: it stays until a later load of the model leaves nothing out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..capture.guard import ProbeRuntime
from ..capture.hooks import HeldHook
from ..schema import key_prefix
from .finding import Finding
from .rules import CheckpointKeys, LoadResult


def judge_load(model: nn.Module, missing: Sequence[str], unexpected: Sequence[str]) -> LoadResult:
    """Which of ``missing`` are trained weights, and which loaded under a tied name. Keys may carry a wrapper's
    prefix (a load through DDP's ``module.``): each is matched to the longest ending that names a tensor of
    ``model``."""
    own = _named_tensors(model)
    local = {k: _local_key(k, own) for k in missing}
    missing_local = set(local.values())
    loaded = {id(t) for name, t in own.items() if name not in missing_local}
    kept: list[str] = []
    trained: list[str] = []
    tied: list[str] = []
    for k in missing:
        name = local[k]
        t = own.get(name) if name is not None else None
        if t is not None and id(t) in loaded:
            tied.append(k)
            continue
        kept.append(k)
        if isinstance(t, nn.Parameter) and t.requires_grad:
            trained.append(k)
    prefix = key_prefix(kept, unexpected) if kept and unexpected else None
    return LoadResult(tuple(kept), tuple(trained), tuple(unexpected), tuple(tied), prefix)


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict names and tensors, without calling state_dict() (which runs the user's and FSDP's
    state-dict hooks, collectives included)."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def _local_key(key: str, own: Mapping[str, Any]) -> str | None:
    while key not in own:
        _, dot, rest = key.partition(".")
        if not dot:
            return None
        key = rest
    return key


class CheckpointLoads:
    """The hook on the watched model and the finding it keeps. ``on_change`` is called (inside the hook's guard)
    when the finding appeared, changed or was resolved."""

    def __init__(self, probe: ProbeRuntime, on_change: Callable[[], None]) -> None:
        self._probe = probe
        self._on_change = on_change
        self._handle: RemovableHandle | None = None
        self._finding: Finding | None = None
        self._first_step: int | None = None
        self._count = 0

    def attach(self, model: nn.Module) -> None:
        self._handle = model.register_load_state_dict_post_hook(HeldHook(self._after_load))

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def findings(self) -> list[Finding]:
        return [self._finding] if self._finding is not None else []

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        # the keys are read, never changed: a post-hook that edits them changes what a strict load raises
        with self._probe.guard("load-state-dict-hook"):
            self._observe(module, list(incompatible.missing_keys), list(incompatible.unexpected_keys))

    def _observe(self, module: nn.Module, missing: Iterable[str], unexpected: Iterable[str]) -> None:
        result = judge_load(module, list(missing), list(unexpected))
        step = self._probe.step
        if result.complete:
            if self._finding is None:
                return
            self._finding, self._first_step, self._count = None, None, 0      # evidence of the fix
        else:
            self._first_step = step if self._first_step is None else self._first_step
            self._count += 1
            self._finding = CheckpointKeys.build(result, step, self._first_step, self._count)
        self._on_change()
