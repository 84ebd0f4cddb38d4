"""Closure optimizers: ``optimizer.step(closure)`` (LBFGS, and any torch optimizer given a closure).

The closure runs forward and backward *inside* ``step()``, several times for LBFGS (once per line-search
evaluation). The optimizer's step pre-hook fires before the first evaluation, when the gradients are still
the previous step's; a framework's "gradients are final" event (Lightning's ``on_before_optimizer_step``)
fires after every evaluation. So a watched optimizer's closure is wrapped for that ``step()`` call (the same
calls, the same results): its first evaluation says when the gradients are final, for the parameters as they
were before the step (torch optimizers evaluate the closure before they change them). A "gradients are final"
call made before that first evaluation (at a step pre-hook) waits for it; one made inside the closure (the
user's, after backward and clipping) counts at once; later ones (the other evaluations) change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .rank_clock import RankClock

__all__ = ["ClosureSteps", "StepArgs", "optimizer_position", "step_closure"]


class StepArgs(NamedTuple):
    """The arguments of an optimizer's ``step()`` call, as its step pre-hook may return them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def optimizer_position(optimizers: list[Any], optimizer: Any) -> int | None:
    """The index of ``optimizer`` (an optimizer or an index) among the watched ``optimizers``, or None."""
    if isinstance(optimizer, int) and not isinstance(optimizer, bool):
        return optimizer if 0 <= optimizer < len(optimizers) else None
    return next((i for i, opt in enumerate(optimizers) if opt is optimizer), None)


def step_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The closure of a ``step(closure)`` call (positional or keyword), or None. ``args`` are what a step pre-hook
    gets: the optimizer first, then the call's own."""
    closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    return closure if callable(closure) else None


def _with_closure(args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any]) -> StepArgs:
    if "closure" in kwargs:
        return StepArgs(args, {**kwargs, "closure": closure})
    return StepArgs((args[0], closure, *args[2:]), kwargs)


class ClosureSteps:
    """The closures of the optimizer steps in progress, by optimizer index; with a ``clock``
    (:class:`probes.capture.rank_clock.RankClock`), the optimizer steps' own time too."""

    def __init__(self, on_first_evaluation: Callable[[int], None], clock: RankClock | None = None) -> None:
        self._on_first = on_first_evaluation     # (optimizer index): its gradients are final now
        self.clock = clock
        self._pending: set[int] = set()           # in step(closure), the closure not evaluated yet
        self._inside = 0                          # closure evaluations in progress

    def step_begins(self, opt_index: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                    sampled: bool) -> StepArgs | None:
        """At an optimizer's step pre-hook: the step's arguments with its closure wrapped, where there is one and
        anyone needs it (a sampled step, or the clock); else None."""
        clock = self.clock
        if clock is not None:
            clock.optimizer_begin()
        if clock is None and not sampled:
            return None
        return self.wrap(opt_index, args, kwargs, clock.timed_closure if clock is not None else None)

    def step_ends(self, opt_index: int) -> None:
        self._pending.discard(opt_index)
        if self.clock is not None:
            self.clock.optimizer_end()

    def wrap(self, opt_index: int, args: tuple[Any, ...], kwargs: dict[str, Any],
             timed: Callable[[Callable[[], Any]], Callable[[], Any]] | None = None) -> StepArgs | None:
        """The step's arguments with its closure wrapped (None: no closure). ``timed`` wraps it once more (the rank
        clock takes the closure's calls out of the optimizer step's time)."""
        closure = step_closure(args, kwargs)
        if closure is None:
            return None
        self._pending.add(opt_index)

        def evaluate() -> Any:
            self._inside += 1
            try:
                out = closure()
            finally:
                self._inside -= 1
            if opt_index in self._pending:
                self._pending.discard(opt_index)
                self._on_first(opt_index)
            return out

        return _with_closure(args, kwargs, timed(evaluate) if timed is not None else evaluate)

    def defers(self, opt_index: int) -> bool:
        """Whether "gradients are final" for ``opt_index`` must wait: its closure has not run yet and this is
        not called from inside one."""
        return opt_index in self._pending and not self._inside

    def clear(self) -> None:
        self._pending.clear()
