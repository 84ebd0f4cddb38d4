"""Which steps are sampled: a fixed interval (every=N) or an overhead budget. Pure logic, no torch.

The schedule is a function of the step number and one interval, so every rank of a job samples the same
steps and ranks can be compared step by step:

- ``every=N``: the multiples of N.
- the budget (default 1%): steps 0, 1 and 2 (every finding needs at most three samples, so findings
  appear at once), then the multiples of the interval. The interval is chosen as soon as one unsampled
  step has been timed, and after every sampled step: the power of two at or above the measured extra
  time of a sampled step (the median of recent sampled steps minus that of unsampled ones) divided by
  the budget times the unsampled step time, so the budget is an upper bound.

In a distributed job rank 0 chooses the interval from its own timings and announces it, with the step
from which it applies, through an :class:`IntervalChannel`; the other ranks follow. The announcement
names a step after the followers' next sampled step, so every rank switches at the same step.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Protocol

MAX_INTERVAL = 1024
INITIAL_INTERVAL = 16
WARMUP_STEPS = 3               # steps 0..2 are always sampled under a budget


class IntervalChannel(Protocol):
    """How rank 0 tells the other ranks the sampling interval (and from which step it applies)."""

    def announce(self, from_step: int, interval: int) -> None: ...
    def latest(self) -> tuple[int, int] | None: ...


def power_of_two_at_least(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1.0))))


class SamplingPolicy:
    def __init__(self, every: int | None, overhead: float | None, channel: IntervalChannel | None = None,
                 leader: bool = True) -> None:
        self.every = every
        self.budget = overhead
        self.interval = every if every else INITIAL_INTERVAL
        self._channel = channel
        self._leader = leader
        self._pending: tuple[int, int] | None = None   # (from step, interval) not in force yet
        self._sampled_ms: collections.deque[float] = collections.deque(maxlen=9)
        self._plain_ms: collections.deque[float] = collections.deque(maxlen=31)
        self._probe_ms: collections.deque[float] = collections.deque(maxlen=9)
        self._n_sampled = 0
        self._started = False            # the interval after the start has been chosen (or learnt)

    def should_sample(self, step: int) -> bool:
        if self._pending is not None and step >= self._pending[0] and not self._leader and self._channel is not None:
            # a change is due: rank 0 may have taken it back after this rank read it (the read fell before rank 0's
            # announcement of the same step); read once more, so that no rank switches alone. In lockstep what
            # rank 0 announced up to two steps ago is there (it never takes back a change due within a step)
            announced = self._channel.latest()
            if announced is not None:
                self._follow(announced, step)
        if self._pending is not None and step >= self._pending[0]:
            self.interval = self._pending[1]
            self._pending = None
        if self.every:
            return step % self.every == 0
        return step < WARMUP_STEPS or step % self.interval == 0

    def observe(self, step: int, step_ms: float, probe_ms: float, sampled: bool) -> None:
        """Record a finished step and, after a sampled one, choose (or learn) the interval."""
        if not sampled:
            self._plain_ms.append(step_ms)
            if not self.every and self._n_sampled >= WARMUP_STEPS and not self._started:
                # the first timed unsampled step after the start: choose now (followers: learn it, polling
                # each step until rank 0's choice arrives, which applies two steps after it was made)
                self._started = self._choose(step, early=True) or self._leader
            return
        self._n_sampled += 1
        if self._n_sampled > 1:          # the first step carries one-off warm-up costs
            self._sampled_ms.append(step_ms)
            self._probe_ms.append(probe_ms)
        if not self.every:
            self._choose(step)

    def _choose(self, step: int, early: bool = False) -> bool:
        """Choose the interval (rank 0) or learn rank 0's choice (the others); True once one is known."""
        if not self._leader:
            announced = self._channel.latest() if self._channel is not None else None
            if announced is None:
                return self._channel is None
            self._follow(announced, step)
            return True
        wanted = self._budget_interval()
        current = self._pending[1] if self._pending is not None else self.interval
        if wanted == current:
            return True
        if self._channel is None:
            self.interval, self._pending = wanted, None
            return True
        if self._pending is not None and self._pending[0] <= step + 1:
            return True      # followers may be switching to it now: it goes ahead, a new choice waits for a sample
        if early:
            # right after the start the followers poll every step: in lockstep (data parallelism waits for
            # every rank at each step) they have read it within two steps
            from_step = step + 2
        else:
            # every follower samples again at step + interval (or earlier) and reads the announcement there
            span = max(self.interval, wanted)
            from_step = (step + self.interval) // span * span + span
        self._pending = (from_step, wanted)
        self._channel.announce(from_step, wanted)
        return True

    def _follow(self, announced: tuple[int, int], step: int) -> None:
        """Take rank 0's latest announcement (a follower): its whole intent, also where it takes back an earlier one
        whose step has not come (its interval may be this rank's current one: the pending change must still go)."""
        if announced == self._pending:
            return
        if announced[0] > step:
            self._pending = announced
        else:                                    # late: follow at once
            self._pending = None
            self.interval = announced[1]

    def extra_ms(self) -> float | None:
        """Measured cost of sampling one step (ms), or None before there is evidence."""
        if not self._sampled_ms or not self._plain_ms:
            if self._probe_ms:
                return statistics.median(self._probe_ms)
            return None
        diff = statistics.median(self._sampled_ms) - statistics.median(self._plain_ms)
        return max(diff, statistics.median(self._probe_ms), 0.0)

    def _budget_interval(self) -> int:
        extra = self.extra_ms()
        if extra is None or not self._plain_ms:
            return INITIAL_INTERVAL
        base = max(statistics.median(self._plain_ms), 1e-3)
        need = extra / (self.budget * base) if self.budget else MAX_INTERVAL
        return min(MAX_INTERVAL, power_of_two_at_least(need))

    def overhead(self) -> float | None:
        """Estimated average overhead as a fraction of plain step time."""
        extra = self.extra_ms()
        if extra is None:
            return None
        if not self._plain_ms:
            base = statistics.median(self._sampled_ms) - extra if self._sampled_ms else None
            if not base or base <= 0:
                return None
            return extra / base
        base = max(statistics.median(self._plain_ms), 1e-6)
        return extra / (base * self.interval)
