"""The eager scope of a compiled model's sampled steps.

A compiled model runs its sampled steps eagerly: the compiled graph never sees our hooks, so it is neither broken nor
recompiled, and unsampled steps run it exactly as without modscope. Only this model's calls run eagerly: any other
compiled code of the process (another model, a compiled loss) keeps its graph, sampled step or not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..model.structure import CompiledModules
from .hooks import HeldHandle, hold

__all__ = ["HAS_STANCE", "EagerScope", "hide_global_hook_warning", "restore_warning_filters"]

HAS_STANCE = hasattr(torch, "compiler") and hasattr(torch.compiler, "set_stance")   # torch >= 2.6

# torch.compile(module) warns at each call of the wrapper while global module hooks exist, which ours do
# during a sampled step (they skip the wrapper: it is not in the model index); not the user's concern
_GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


def hide_global_hook_warning() -> Any:
    """Hide torch's warning about global module hooks (ours) at torch.compile wrapper calls; returns the
    filter for :func:`restore_warning_filters`."""
    warnings.filterwarnings("ignore", message=_GLOBAL_HOOK_WARNING, category=UserWarning)
    return warnings.filters[0]


def restore_warning_filters(entry: Any) -> None:
    filters: list[Any] = warnings.filters  # type: ignore[assignment]   # a list at run time
    try:
        filters.remove(entry)
    except ValueError:
        return                          # the user reset the filters meanwhile
    mutated = getattr(warnings, "_filters_mutated", None)   # so cached decisions are made again
    if callable(mutated):
        mutated()


class EagerScope:
    """What torch.compile put in the model, and the undoing of a sampled step's eager run of it."""

    def __init__(self) -> None:
        self.compiled = CompiledModules()        # set with each index (probes.model.structure.compiled_modules)
        # the model runs inside compiled code of the user's (a compiled train step calling it): a sampled step then
        # runs all compiled code eagerly, or our hooks would only ever be traced (learnt from a sampled step whose
        # optimizer stepped while no hook of ours ran eagerly)
        self.called_from_compiled = False
        self._active = False
        # while a step runs eagerly: the compiled call of each module compiled in place, the compiled methods taken
        # off instances, the hooks on torch.compile wrappers, and the stances entered (innermost last)
        self._calls: list[tuple[nn.Module, Any]] = []
        self._methods: list[tuple[nn.Module, str, Any]] = []
        self._handles: list[HeldHandle] = []
        self._stances: list[Any] = []
        self._warning_filter: Any = None   # hides torch's warning about our global hooks, while they exist

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Under torch.compile without stances (torch < 2.6), run our hooks eagerly instead of letting dynamo
        trace them; a plain function otherwise (no wrapper cost)."""
        if self.compiled and not HAS_STANCE and hasattr(torch, "compiler") and hasattr(torch.compiler, "disable"):
            return torch.compiler.disable(fn)  # type: ignore[no-any-return]
        return fn

    def enter(self) -> None:
        """A sampled step is armed: this model's compiled code runs eagerly until :meth:`leave`."""
        self._active = True
        for module in self.compiled.in_place:
            self._calls.append((module, module._compiled_call_impl))
            module._compiled_call_impl = None          # this instance's __call__ runs _call_impl eagerly
        for module, name in self.compiled.methods:
            compiled = module.__dict__.pop(name, None)
            if compiled is not None:                   # the class's own method answers for this step
                self._methods.append((module, name, compiled))
        if HAS_STANCE:
            for wrapper in self.compiled.wrappers:
                self._handles.append(hold(wrapper.register_forward_pre_hook, self._enter_eager))
                self._handles.append(hold(wrapper.register_forward_hook, self._exit_eager, always_call=True))
            if self.called_from_compiled:
                self._stances.append(torch.compiler.set_stance("force_eager"))    # undone at leave()

    def global_hooks_attached(self) -> None:
        """Our global module hooks exist now: torch.compile wrappers would warn about them at every call."""
        if self.compiled.wrappers and self._warning_filter is None:
            self._warning_filter = hide_global_hook_warning()

    def leave(self, ran_compiled: bool) -> None:
        """The step is detached: everything :meth:`enter` changed is put back. ``ran_compiled``: the optimizer
        stepped while no hook of ours ran eagerly, so the model runs inside the user's compiled code."""
        if ran_compiled:
            self.called_from_compiled = True
        self._active = False
        for module, call in self._calls:
            module._compiled_call_impl = call
        self._calls.clear()
        for module, name, compiled in self._methods:
            module.__dict__.setdefault(name, compiled)   # unless the user set another meanwhile
        self._methods.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        while self._stances:                             # a forward that never returned
            self._stances.pop().__exit__(None, None, None)
        if self._warning_filter is not None:
            restore_warning_filters(self._warning_filter)
            self._warning_filter = None

    def set_compiled(self, found: CompiledModules) -> None:
        """What torch.compile put in the model (``structure.compiled_modules``, at each index build). A build
        during a sampled step does not see what that step swapped out: it is compiled all the same."""
        if self._calls or self._methods:
            found = CompiledModules(
                found.wrappers,
                found.in_place + tuple(m for m, _ in self._calls if not any(m is x for x in found.in_place)),
                found.methods + tuple((m, n) for m, n, _ in self._methods
                                      if not any(m is x and n == y for x, y in found.methods)))
        self.compiled = found

    def reset(self) -> None:
        self.leave(ran_compiled=False)
        self.compiled = CompiledModules()

    def _enter_eager(self, module: nn.Module, args: Any) -> None:
        if self._active:
            self._stances.append(torch.compiler.set_stance("force_eager"))

    def _exit_eager(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._active and self._stances:
            self._stances.pop().__exit__(None, None, None)   # the stance the user had
