"""Which steps are sampled: a fixed interval (every=N) or an overhead budget.

With a budget (the default, 1%), the first DENSE_START steps are sampled, then the interval is
chosen from the measured cost: the median
wall time of recent sampled steps minus that of unsampled ones, divided by the budget times
the unsampled step time. Pure logic, no torch.
"""
from __future__ import annotations

import collections
import math
import statistics

MAX_INTERVAL = 1000
INITIAL_INTERVAL = 10
DENSE_START = 8        # with a budget, the first steps are all sampled: findings appear at once and the
                       # cost of a sampled step is measured before the interval is chosen


class SamplingPolicy:
    def __init__(self, every: int | None, overhead: float | None) -> None:
        self.every = every
        self.budget = overhead
        self.interval = every if every else INITIAL_INTERVAL
        self._sampled_ms: collections.deque[float] = collections.deque(maxlen=9)
        self._plain_ms: collections.deque[float] = collections.deque(maxlen=31)
        self._probe_ms: collections.deque[float] = collections.deque(maxlen=9)
        self._next = 0
        self._n_sampled = 0

    def should_sample(self, step: int) -> bool:
        return step >= self._next or (not self.every and step < DENSE_START)

    def observe(self, step: int, step_ms: float, probe_ms: float, sampled: bool) -> None:
        """Record a finished step and schedule the next sampled one."""
        if sampled:
            self._n_sampled += 1
            if self._n_sampled > 1:          # the first step carries one-off warm-up costs
                self._sampled_ms.append(step_ms)
                self._probe_ms.append(probe_ms)
            if not self.every:
                self.interval = self._budget_interval()
            self._next = step + self.interval
        else:
            self._plain_ms.append(step_ms)

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
        return int(min(MAX_INTERVAL, max(1, math.ceil(need))))

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
