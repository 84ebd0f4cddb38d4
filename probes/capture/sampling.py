"""Which steps are sampled, and how: a fixed interval (every=N) or an overhead budget. Pure logic, no torch.

Two tiers share the schedule. A *full sample* measures everything (activations, histograms, update ratios,
findings); the *dense tier* takes only the per-tensor gradient and weight norms, in one fused device reduction,
on steps that are not full samples. The schedule is a function of the step number and one :class:`Schedule`,
so every rank of a job samples the same steps and ranks can be compared step by step:

- ``every=N``: full samples at the multiples of N; the dense tier on every other step (``dense=K``: every K-th).
- the budget (default 1%): full samples at steps 0, 1 and 2 (every finding needs at most three samples, so
  findings appear at once), then at the multiples of the interval; the dense tier at the multiples of its own
  interval. Both are powers of two, chosen from measured costs: the dense tier takes a quarter of the budget, but
  keeps one step in DENSE_TARGET while that costs at most DENSE_FLOOR_BUDGETS budgets (on a model whose steps
  take a few milliseconds on the CPU, a dense step costs 5-15 % of one: the dense tier then takes the whole budget
  and more, up to 5 % at the default 1 %); the full sample takes the rest. The budget counts the start of the run: a
  full sample is taken only once the budget of the steps so far covers every full sample and dense step since
  step 0 (the first three samples included), so a short run's full samples come as soon as the budget affords
  them, and the interval settles at the power of two at or above the measured extra time of a full sample divided
  by its share of the budget. Full samples stay at most MAX_INTERVAL steps apart, whatever they cost.

The interval is chosen as soon as one step that is no full sample has been timed, at every such step during the
first START_STEPS, and after every full sample. In a distributed job rank 0 chooses from its own timings and
announces the schedule, with the step from which it applies, through an :class:`IntervalChannel`; the other
ranks follow. The announcement names a step after the followers' next full sample (during the start, when they
read it every step: two steps ahead), so every rank switches at the same step.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Protocol

from ..store.rundir import Schedule

MAX_INTERVAL = 1024
INITIAL_INTERVAL = 16
WARMUP_STEPS = 3               # steps 0..2 are always sampled under a budget
START_STEPS = 256              # the schedule is chosen again at every step of the start
DENSE_SHARE = 0.25             # the dense tier's share of the budget...
DENSE_TARGET = 4               # ...but it keeps one dense step in this many...
DENSE_FLOOR_BUDGETS = 5        # ...while that costs at most this many budgets (a dense step up to 20% of a step)
# a full sample's cost in the ledger: its extra wall time, at most this many times the probe's own time in it (a step's
# wall time also holds what the loop did since the step before: the first step's, all since watch(); an evaluation)
WALL_PER_PROBE = 4.0


class IntervalChannel(Protocol):
    """How rank 0 tells the other ranks the schedule (and from which step it applies)."""

    def announce(self, from_step: int, schedule: Schedule) -> None: ...
    def latest(self) -> tuple[int, Schedule] | None: ...


def power_of_two_at_least(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1.0))))


def _round_up(step: int, interval: int) -> int:
    return -(-step // interval) * interval


class SamplingPolicy:
    def __init__(self, every: int | None, overhead: float | None, channel: IntervalChannel | None = None,
                 leader: bool = True, dense: bool | int = True, host_timed: bool = True) -> None:
        """``dense``: True (the budget chooses its interval; every step under ``every``), False (off) or a fixed
        interval. ``host_timed``: the dense tier's host time is its cost (the CPU, where the reduction runs on the
        calling thread); elsewhere dense steps' wall time is compared with plain steps' too."""
        self.every = every
        self.budget = overhead
        self.interval = every if every else INITIAL_INTERVAL
        self._dense_fixed = None if isinstance(dense, bool) else dense
        # until it is chosen: every step (a plain step too where a dense step's cost is told by comparison)
        initial = 1 if host_timed or every else 2
        self.dense_interval = (self._dense_fixed or initial) if dense is not False else 0
        self._host_timed = host_timed
        self._channel = channel
        self._leader = leader
        self._pending: tuple[int, Schedule] | None = None   # (from step, schedule) not in force yet
        self._sampled_ms: collections.deque[float] = collections.deque(maxlen=9)
        self._plain_ms: collections.deque[float] = collections.deque(maxlen=31)   # steps less their dense work
        self._probe_ms: collections.deque[float] = collections.deque(maxlen=9)
        self._dense_ms: collections.deque[float] = collections.deque(maxlen=31)   # the dense tier's own time
        self._dense_step_ms: collections.deque[float] = collections.deque(maxlen=31)
        self._bare_step_ms: collections.deque[float] = collections.deque(maxlen=31)
        self._n_sampled = 0
        self._spent_ms = 0.0             # what every full sample cost (the start's included): the ledger
        self._unpriced: list[tuple[float, float]] = []   # (wall, probe ms) of full samples before a plain step
        self._dense_spent_ms = 0.0       # what every dense step cost
        self._started = False            # the schedule after the start has been chosen (or learnt)

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.interval, self.dense_interval)

    def should_sample(self, step: int) -> bool:
        """Whether ``step`` is a full sample (and the schedule in force from it on)."""
        if self._pending is not None and step >= self._pending[0] and not self._leader and self._channel is not None:
            # a change is due: rank 0 may have taken it back after this rank read it (the read fell before rank 0's
            # announcement of the same step); read once more, so that no rank switches alone. In lockstep what
            # rank 0 announced up to two steps ago is there (it never takes back a change due within a step)
            announced = self._channel.latest()
            if announced is not None:
                self._follow(announced, step)
        if self._pending is not None and step >= self._pending[0]:
            self.interval, self.dense_interval = self._pending[1]
            self._pending = None
        if self.every:
            return step % self.every == 0
        return step < WARMUP_STEPS or step % self.interval == 0

    def dense_due(self, step: int) -> bool:
        """Whether the dense tier runs at ``step`` (one that :meth:`should_sample` found no full sample)."""
        return self.dense_interval > 0 and step % self.dense_interval == 0

    def next_sample(self, step: int) -> int:
        """The step of the next full sample at or after ``step``, as the schedule stands."""
        if self.every:
            return _round_up(step, self.every)
        if step < WARMUP_STEPS:
            return step
        first = _round_up(step, self.interval)
        if self._pending is None or first < self._pending[0]:
            return first
        return _round_up(max(step, self._pending[0]), self._pending[1].interval)

    def observe(self, step: int, step_ms: float, probe_ms: float, sampled: bool,
                dense_ms: float | None = None) -> None:
        """Record a finished step (``dense_ms``: the dense tier's own time in it, None when it did not run) and
        choose (or learn) the schedule after a full sample, and at the steps of the start."""
        if not sampled:
            self._plain_ms.append(step_ms - (dense_ms or 0.0))
            if dense_ms is None:
                self._bare_step_ms.append(step_ms)
            else:
                self._dense_spent_ms += dense_ms
                if self._dense_spent_ms > dense_ms:      # the first dense step carries one-off costs (its plan)
                    self._dense_ms.append(dense_ms)
                    self._dense_step_ms.append(step_ms)
            # rank 0 stops choosing at every step two steps before the others stop reading at every step: what it
            # announces then applies two steps later, and in lockstep the others have read it by then
            start = START_STEPS - 2 if self._leader else START_STEPS
            if not self.every and self._n_sampled >= WARMUP_STEPS and (not self._started or step < start):
                # right after the start (followers: polling each step until rank 0's choice arrives, which applies
                # two steps after it was made), and again at each step of the start, as timings accumulate
                self._started = self._choose(step, early=True) or self._leader or self._started
            return
        self._n_sampled += 1
        self._unpriced.append((step_ms, probe_ms))
        if self._plain_ms:
            self._price(statistics.median(self._plain_ms))
        if self._n_sampled > 1:          # the first step carries one-off warm-up costs
            self._sampled_ms.append(step_ms)
            self._probe_ms.append(probe_ms)
        if not self.every:
            self._choose(step)

    def _choose(self, step: int, early: bool = False) -> bool:
        """Choose the schedule (rank 0) or learn rank 0's choice (the others); True once one is known."""
        if not self._leader:
            announced = self._channel.latest() if self._channel is not None else None
            if announced is None:
                return self._channel is None
            self._follow(announced, step)
            return True
        wanted = self._budget_schedule(step)
        current = self._pending[1] if self._pending is not None else self.schedule
        if wanted == current:
            return True
        if self._channel is None:
            (self.interval, self.dense_interval), self._pending = wanted, None
            return True
        if self._pending is not None and self._pending[0] <= step + 1:
            return True      # followers may be switching to it now: it goes ahead, a new choice waits for a sample
        if early:
            # during the start the followers poll every step: in lockstep (data parallelism waits for every rank
            # at each step) they have read it within two steps
            from_step = step + 2
        else:
            # every follower samples again at step + interval (or earlier) and reads the announcement there
            span = max(self.interval, wanted.interval)
            from_step = (step + self.interval) // span * span + span
        self._pending = (from_step, wanted)
        self._channel.announce(from_step, wanted)
        return True

    def _follow(self, announced: tuple[int, Schedule], step: int) -> None:
        """Take rank 0's latest announcement (a follower): its whole intent, also where it takes back an earlier one
        whose step has not come (its schedule may be this rank's current one: the pending change must still go)."""
        if announced == self._pending:
            return
        if announced[0] > step:
            self._pending = announced
        else:                                    # late: follow at once
            self._pending = None
            self.interval, self.dense_interval = announced[1]

    def _price(self, base: float) -> None:
        """Add the full samples not in the ledger yet, priced against ``base``, the plain step's time."""
        for wall, probe in self._unpriced:
            self._spent_ms += max(probe, min(wall - base, WALL_PER_PROBE * probe))
        self._unpriced.clear()

    def extra_ms(self) -> float | None:
        """Measured cost of one full sample (ms), or None before there is evidence."""
        if not self._sampled_ms or not self._plain_ms:
            if self._probe_ms:
                return statistics.median(self._probe_ms)
            return None
        diff = statistics.median(self._sampled_ms) - statistics.median(self._plain_ms)
        probe = statistics.median(self._probe_ms)
        return max(min(diff, WALL_PER_PROBE * probe), probe, 0.0)

    def dense_cost_ms(self) -> float | None:
        """Measured cost of one dense step (ms), or None before one ran."""
        if not self._dense_ms:
            return None
        own = statistics.median(self._dense_ms)
        if self._host_timed or not self._bare_step_ms:
            # the reduction ran on the calling thread: its own time is its cost. Comparing whole steps' wall times
            # instead lets a busy machine's noise (one slow dense step among few) price the tier out of the run
            return own
        # what dense steps add to the wall time of plain ones: on an accelerator the reduction runs after the host
        # launched it
        return max(own, statistics.median(self._dense_step_ms) - statistics.median(self._bare_step_ms))

    def _budget_schedule(self, step: int) -> Schedule:
        """The dense tier's interval, then the full sample's from the rest of the budget and from what every full
        sample so far cost (the start's included: no full sample before the budget of the steps so far covers it)."""
        extra = self.extra_ms()
        if extra is None or not self._plain_ms or not self.budget:
            return Schedule(INITIAL_INTERVAL if self.budget else MAX_INTERVAL, self.dense_interval)
        base = max(statistics.median(self._plain_ms), 1e-3)
        budget = self.budget
        dense = self.dense_interval
        dense_cost = self.dense_cost_ms()
        dense_rate = 0.0
        if dense_cost is not None and dense:
            if self._dense_fixed is None:
                dense = power_of_two_at_least(dense_cost / (budget * DENSE_SHARE * base))
                if dense > DENSE_TARGET:
                    floor = DENSE_FLOOR_BUDGETS * DENSE_TARGET * budget * base
                    dense = (DENSE_TARGET if dense_cost <= floor
                             else min(MAX_INTERVAL, power_of_two_at_least(dense_cost / (budget * base))))
            dense_rate = dense_cost / (base * dense)
        rate = max(budget - dense_rate, budget / MAX_INTERVAL)     # the full sample's share, per step
        interval = min(MAX_INTERVAL, power_of_two_at_least(extra / (rate * base)))
        # the ledger: the step from which the budget of the steps so far covers every full sample and dense step so
        # far, the next full sample, and the dense steps until then
        self._price(base)
        owed = self._spent_ms + self._dense_spent_ms - dense_rate * base * step
        affordable = (owed + extra) / (rate * base)
        while interval < MAX_INTERVAL and (step // interval + 1) * interval < affordable:
            interval *= 2
        return Schedule(interval, dense)

    def overhead(self) -> float | None:
        """Estimated average overhead (full samples and dense steps) as a fraction of plain step time."""
        extra = self.extra_ms()
        if extra is None:
            return None
        if not self._plain_ms:
            base = statistics.median(self._sampled_ms) - extra if self._sampled_ms else None
            if not base or base <= 0:
                return None
            return extra / base
        base = max(statistics.median(self._plain_ms), 1e-6)
        full = extra / (base * (self.every or self.interval))
        dense = self.dense_cost_ms()
        if dense is None or not self.dense_interval:
            return full
        return full + dense / (base * self.dense_interval)
