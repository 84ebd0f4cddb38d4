"""The limits of ``probes.watch``'s arguments (listed in the README's API section). A value beyond one raises a
``ValueError`` that names the limit, at the call: ``window=10**9`` would size the detectors' ring buffers (one slot
per sampled step of the window, per module and statistic), a 10 MB ``run_name`` goes into every store, snapshot and
page that names the run. Standard library only (``modscope run`` checks its options with the same numbers)."""

from __future__ import annotations

from .schema import MAX_EVERY

__all__ = ["MAX_EVERY", "MAX_RUN_NAME", "MAX_WINDOW", "check_dense", "check_every", "check_overhead",
           "check_run_name", "check_window"]

MAX_WINDOW = 256          # sampled steps in the detectors' window (memory: ~50 bytes per module per step of it)
MAX_RUN_NAME = 200        # characters of a run's name


def check_every(every: object) -> int | None:
    if every is None or (isinstance(every, int) and not isinstance(every, bool) and 1 <= every <= MAX_EVERY):
        return every
    raise ValueError(f"every must be None or an int from 1 to {MAX_EVERY:,} (sample every N-th step), "
                     f"got {every!r:.80}")


def check_overhead(overhead: object) -> float:
    if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0 < overhead <= 1:
        raise ValueError(f"overhead must be a fraction in (0, 1], got {overhead!r:.80}")
    return float(overhead)


def check_window(window: object) -> int:
    if isinstance(window, int) and not isinstance(window, bool) and 1 <= window <= MAX_WINDOW:
        return window
    raise ValueError(f"window must be an int from 1 to {MAX_WINDOW} (sampled steps), got {window!r:.80}")


def check_run_name(run_name: object) -> str | None:
    """None (the run directory's name) or a printable str of at most ``MAX_RUN_NAME`` characters."""
    if run_name is None:
        return None
    if not isinstance(run_name, str):
        raise TypeError(f"run_name must be a str or None, got {type(run_name).__qualname__}: {run_name!r:.80}")
    if len(run_name) > MAX_RUN_NAME:
        raise ValueError(f"run_name must be at most {MAX_RUN_NAME} characters, got {len(run_name):,}")
    if not run_name.isprintable():
        raise ValueError(f"run_name must be printable (no control characters or line breaks), got {run_name!r}")
    return run_name


def check_dense(dense: object) -> bool | int:
    """``dense`` must be True (its interval chosen within the budget), False (off) or an int from 1 to MAX_EVERY."""
    if isinstance(dense, bool) or (isinstance(dense, int) and 1 <= dense <= MAX_EVERY):
        return dense
    raise ValueError(f"dense must be True (chosen within the budget), False (off) or an int from 1 to {MAX_EVERY:,} "
                     f"(every N-th step), got {dense!r:.80}")
