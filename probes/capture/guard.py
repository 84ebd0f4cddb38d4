"""What every hook body shares: the probe's own clock and the log of errors caught inside modscope.

``with probe.guard("forward-hook"):`` around a hook body times it and never lets a probe failure reach
the training loop: the exception is counted, kept (and later stored) instead.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ..store.errors import ErrorLog

# re-raise probe errors instead of swallowing them (development only)
RAISE_PROBE_ERRORS = os.environ.get("MODSCOPE_DEBUG") == "1"
class GcPause:
    """Python's cyclic garbage collector, paused from the first forward of a sampled step to the end of
    its finishing work. The probes allocate many small objects on a sampled step; every collection they
    trigger walks the whole heap, which for a model of many modules costs more than the probes' own work.
    Collection resumes right after (a collector the user disabled stays disabled)."""

    def __init__(self) -> None:
        self._paused = False

    def pause(self) -> None:
        if not self._paused and gc.isenabled():
            gc.disable()
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            gc.enable()


class ProbeRuntime:
    """The probe clock (time spent inside modscope during the current step) and the error log.

    The probe's own time is counted by the outermost guard only, and only since the last step
    boundary: a guard around the end of a step (which measures its finishing work itself) must not
    count it again into the next step."""

    def __init__(self) -> None:
        self.errors = ErrorLog()
        self.step = 0                     # the current (unfinished) step
        self.probe_s = 0.0                # probe time inside the current step
        self.step_t0 = time.perf_counter()
        self.depth = 0                    # guards entered and not yet left
        self.gc = GcPause()

    def guard(self, location: str) -> Guard:
        return Guard(self, location)

    def start_step(self, step: int) -> None:
        self.step = step
        self.probe_s = 0.0
        self.step_t0 = time.perf_counter()


class Guard:
    """A plain class, not @contextmanager: hooks run hundreds of times per sampled step and a
    generator-based context manager costs several times more to enter and leave."""

    __slots__ = ("location", "runtime", "t0")

    def __init__(self, runtime: ProbeRuntime, location: str) -> None:
        self.runtime = runtime
        self.location = location
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.runtime.depth += 1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        rt = self.runtime
        rt.depth -= 1
        if rt.depth == 0:
            rt.probe_s += max(0.0, time.perf_counter() - max(self.t0, rt.step_t0))
        if isinstance(exc, Exception):        # never let a probe failure reach the training loop
            rt.errors.record(self.location, exc, rt.step)
            return not RAISE_PROBE_ERRORS
        return False


def call_guarded(rt: ProbeRuntime, location: str, body: Callable[..., None], *args: Any) -> None:
    """:class:`Guard` as a plain call: the forward hooks run on every module call of a sampled step, where making,
    entering and leaving a guard object costs about a tenth of the hook."""
    t0 = time.perf_counter()
    rt.depth += 1
    try:
        body(*args)
    except Exception as exc:
        rt.errors.record(location, exc, rt.step)
        if RAISE_PROBE_ERRORS:
            raise
    finally:
        rt.depth -= 1
        if rt.depth == 0:
            rt.probe_s += max(0.0, time.perf_counter() - max(t0, rt.step_t0))
