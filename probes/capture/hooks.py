"""Hooks that modscope leaves in PyTorch's hook dicts (a module's forward hooks, an optimizer's step hooks).

A module's hook dicts travel with it: ``copy.deepcopy(model)`` (an EMA or Mean Teacher copy, ``AveragedModel``,
timm's ``ModelEmaV2``) copies them, and ``torch.save(model)`` pickles them. A bound method of the watcher would
drag the watcher along (its locks and threads cannot be copied: the user's code would raise), and a copy that
still reported to the watcher would mix another model's forwards into this one's. Wrapped in :class:`HeldHook`,
a copy gets :func:`inert_hook` instead: it does nothing and holds nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a copied or unpickled module or optimizer holds in place of modscope's hook."""
    return None


class HeldHook:
    """A hook function that copies and pickles as :func:`inert_hook`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return inert_hook

    def __copy__(self) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())


def _inert() -> Callable[..., None]:
    return inert_hook
