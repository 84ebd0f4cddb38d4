"""Hooks that modscope leaves in PyTorch's hook dicts (a module's forward hooks, an optimizer's step hooks).

A module's hook dicts travel with it: ``copy.deepcopy(model)`` (an EMA or Mean Teacher copy, ``AveragedModel``,
timm's ``ModelEmaV2``) copies them, and ``torch.save(model)`` pickles them. A bound method of the watcher would
drag the watcher along (its locks and threads cannot be copied: the user's code would raise), and a copy that
still reported to the watcher would mix another model's forwards into this one's. A module's hooks are added with
:func:`hold`: a copy or a pickle of the module leaves them out (a file ``torch.save(model)`` wrote while it was
watched loads where modscope is not installed). Any other place a :class:`HeldHook` is copied to gets
:func:`inert_hook`: it does nothing and holds nothing.
"""

from __future__ import annotations

import collections
import copyreg
import threading
from collections.abc import Callable
from typing import Any, Protocol


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


# ---------------------------------------------------------------------------------- pickling without modscope
# A module that holds a HeldHook pickles it as ``probes.capture.hooks._inert``: loading such a file would need
# modscope. So while a class has instances that hold one, it is in copyreg's dispatch table (which pickle, copy.copy and
# copy.deepcopy consult by exact class): its instances reduce as they always do, with modscope's hooks left out of
# their hook dicts (``torch.save(model)`` then writes what it would write for an unwatched model).
_HOOK_ID_SETS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
_pickling_lock = threading.Lock()
_held_classes: dict[type, tuple[int, Any]] = {}     # class -> (hooks held by its instances, the entry it replaced)


class Removable(Protocol):
    def remove(self) -> None: ...


class HeldHandle:
    """The handle of a :func:`hold`'d hook: ``remove()`` removes it, and releases its class from copyreg's table."""

    __slots__ = ("_cls", "_handle")

    def __init__(self, handle: Removable, cls: type | None) -> None:
        self._handle = handle
        self._cls = cls

    def remove(self) -> None:
        self._handle.remove()
        cls, self._cls = self._cls, None
        if cls is not None:
            _release(cls)


def hold(register: Callable[..., Removable], fn: Callable[..., Any], **kwargs: Any) -> HeldHandle:
    """``register(HeldHook(fn), **kwargs)``, ``register`` being a module's ``register_*_hook`` method: the module
    (and any module of its class) pickles and copies without the hook while it is held."""
    handle = register(HeldHook(fn), **kwargs)
    owner = getattr(register, "__self__", None)
    cls = type(owner) if owner is not None else None
    if cls is not None:
        with _pickling_lock:
            count, replaced = _held_classes.get(cls, (0, copyreg.dispatch_table.get(cls)))
            copyreg.dispatch_table[cls] = _reduce_without_held_hooks
            _held_classes[cls] = (count + 1, replaced)
    return HeldHandle(handle, cls)


def _release(cls: type) -> None:
    with _pickling_lock:
        count, replaced = _held_classes.get(cls, (0, None))
        if count > 1:
            _held_classes[cls] = (count - 1, replaced)
            return
        _held_classes.pop(cls, None)
        if copyreg.dispatch_table.get(cls) is _reduce_without_held_hooks:     # not replaced since by someone else
            if replaced is None:
                del copyreg.dispatch_table[cls]
            else:
                copyreg.dispatch_table[cls] = replaced


def _reduce_without_held_hooks(obj: Any) -> Any:
    replaced = _held_classes.get(type(obj), (0, None))[1]
    rv = replaced(obj) if replaced is not None else obj.__reduce_ex__(2)
    if not (isinstance(rv, tuple) and len(rv) >= 3 and isinstance(rv[2], dict)):
        return rv
    state, dropped = dict(rv[2]), set[Any]()
    for key, value in rv[2].items():
        if isinstance(value, dict) and any(isinstance(h, HeldHook) for h in value.values()):
            dropped.update(k for k, h in value.items() if isinstance(h, HeldHook))
            state[key] = collections.OrderedDict((k, h) for k, h in value.items() if not isinstance(h, HeldHook))
    if not dropped:
        return rv
    for key in _HOOK_ID_SETS:          # torch's side tables of hook ids
        ids = state.get(key)
        if isinstance(ids, dict) and dropped.intersection(ids):
            state[key] = type(ids)((k, v) for k, v in ids.items() if k not in dropped)
    return (*rv[:2], state, *rv[3:])
