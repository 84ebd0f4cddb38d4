"""A rank's own time in a step, for ``rank-straggler``: its wall time less the time it spent waiting for the
other ranks.

Under synchronous data parallelism every rank's wall time per step is the same: the fast ranks wait for the
slowest in the gradient all-reduce. What differs is where the time goes. DDP launches the all-reduce of each
gradient bucket while backward still runs and waits for all of them in a callback that autograd runs once the
backward graph is done. A root forward hook puts a gradient hook on the model's output; that hook (early in
backward, before any parameter's gradient) queues a callback with autograd's engine, which therefore runs
before DDP's: the time this rank finished its own backward. From that callback a second one is queued, which
runs after DDP's: the time the other ranks' gradients had arrived. The difference is the wait. The optimizer
step is left out too (a sharded optimizer's collectives wait in it), except the closure calls in it (LBFGS
evaluates the model there).

Measured on the host clock, on every step, only in a job of several processes: a forward hook on the model,
one gradient hook and two engine callbacks per backward. On an accelerator whose collectives do not block the
host (NCCL), the wait shows where the host next waits for the device instead, which this does not see.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import measure
from .guard import ProbeRuntime
from .hooks import HeldHandle, hold

__all__ = ["RankClock"]


def _queue_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class RankClock:
    """Sums, per step, the time backward waited for the other ranks and the optimizer steps' own time;
    :meth:`own_ms` turns a step's wall time into this rank's own."""

    def __init__(self, probe: ProbeRuntime) -> None:
        self._probe = probe              # a failure is counted (probe_errors), never raised into training
        self._handle: HeldHandle | None = None
        self.waited_s = 0.0              # this step: backward waiting for the other ranks
        self.optimizer_s = 0.0           # this step: inside optimizer steps, closure calls not counted
        self._queued = False             # a backward's callbacks are queued (one pair per backward)
        self._local_done = 0.0
        self._opt_started: float | None = None
        self._opt_depth = 0

    def _on_error(self, exc: BaseException) -> None:
        self._probe.errors.record("rank-clock", exc, self._probe.step)

    def attach(self, outermost: nn.Module) -> None:
        """A forward hook on the module the user calls (a DDP wrapper: its output is what backward starts from)."""
        self._handle = hold(outermost.register_forward_hook, self._on_forward)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # -- backward ------------------------------------------------------------------------------------
    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if measure.is_compiling() or not torch.is_grad_enabled():
            return
        try:
            x = output if isinstance(output, torch.Tensor) else measure.primary(measure.float_tensors(output))
            if x is not None and x.requires_grad:
                x.register_hook(self._on_output_grad)
        except Exception as exc:
            self._on_error(exc)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._queued:
            return                       # another output of the same backward
        try:
            _queue_callback(self._backward_done)
            self._queued = True
        except Exception as exc:
            self._on_error(exc)

    def _backward_done(self) -> None:
        """Runs when this rank's backward graph is done, before DDP's callback waits for the all-reduce."""
        self._local_done = time.perf_counter()
        try:
            _queue_callback(self._synced)
        except Exception as exc:
            self._queued = False
            self._on_error(exc)

    def _synced(self) -> None:
        """Runs after DDP's callback: the other ranks' gradients have arrived."""
        self.waited_s += time.perf_counter() - self._local_done
        self._queued = False

    # -- the optimizer step ----------------------------------------------------------------------------
    def optimizer_begin(self) -> None:
        if self._opt_depth == 0:
            self._opt_started = time.perf_counter()
        self._opt_depth += 1

    def optimizer_end(self) -> None:
        if self._opt_depth == 0:
            return
        self._opt_depth -= 1
        if self._opt_depth == 0 and self._opt_started is not None:
            self.optimizer_s += time.perf_counter() - self._opt_started
            self._opt_started = None

    def timed_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` with its calls taken out of the optimizer step's time (they evaluate the model)."""
        def timed() -> Any:
            t0 = time.perf_counter()
            try:
                return closure()
            finally:
                self.optimizer_s -= time.perf_counter() - t0
        return timed

    # -- the step ----------------------------------------------------------------------------------------
    def own_ms(self, wall_ms: float) -> float:
        """This rank's own time in a step of ``wall_ms``; starts the next step's sums."""
        if self._opt_started is not None:                  # a step ended inside an optimizer step (never, usually)
            now = time.perf_counter()
            self.optimizer_s += now - self._opt_started
            self._opt_started = now
        own = wall_ms - (self.waited_s + max(self.optimizer_s, 0.0)) * 1e3
        self.waited_s = self.optimizer_s = 0.0
        return max(own, 0.0)
