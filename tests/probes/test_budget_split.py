"""How the overhead budget is split between the dense tier and the full sample, and how the start of a run is
paid for: the policy fed with step timings (pure logic)."""
import itertools
import random

import pytest

from probes.capture.sampling import MAX_INTERVAL, START_STEPS, SamplingPolicy, Schedule


def run(policy, steps, plain_ms=100.0, full_ms=10.0, dense_ms=1.0, first_full_ms=None):
    """Feeds ``steps`` steps: a full sample costs ``full_ms`` more than a plain step (the first one
    ``first_full_ms``), a dense step ``dense_ms`` more. Returns the full samples, the dense steps and the total
    extra time spent."""
    full, dense, spent = [], [], 0.0
    for step in range(steps):
        if policy.should_sample(step):
            extra = first_full_ms if first_full_ms is not None and not full else full_ms
            full.append(step)
            spent += extra
            policy.observe(step, plain_ms + extra, extra, True)
        elif policy.dense_due(step):
            dense.append(step)
            spent += dense_ms
            policy.observe(step, plain_ms + dense_ms, dense_ms, False, dense_ms)
        else:
            policy.observe(step, plain_ms, 0.0, False)
    return full, dense, spent


@pytest.mark.parametrize(("dense_ms", "schedule"), [
    (0.1, Schedule(16, 1)),     # cheap: every step, within a quarter of the budget; the full sample gets the rest
    (0.8, Schedule(16, 4)),     # a quarter of the budget allows one step in four
    (3.0, Schedule(64, 4)),     # one step in four takes most of the budget: the full sample has a quarter of 1%
    (6.0, Schedule(MAX_INTERVAL, 4)),   # one step in four is kept (6% a step: 1.5%), the full sample at its slowest
    (24.0, Schedule(64, 32)),   # one in four would cost 6%, over 5 budgets: one in 32, within the budget
])
def test_the_budget_is_split_between_the_dense_tier_and_the_full_sample(dense_ms, schedule):
    p = SamplingPolicy(every=None, overhead=0.01)
    full, dense, _ = run(p, 3000, full_ms=10.0, dense_ms=dense_ms)
    assert p.schedule == schedule
    assert set(dense) >= {s for s in range(2000, 3000) if s % schedule.dense == 0} - set(full)
    expected = 10.0 / (100.0 * schedule.interval) + dense_ms / (100.0 * schedule.dense)
    assert p.overhead() == pytest.approx(expected)
    assert p.overhead() <= max(0.01, dense_ms / (100.0 * 4)) + 10.0 / (100.0 * MAX_INTERVAL)


def test_the_budget_holds_from_the_first_step():
    """Counting the first three samples (and the first one's one-off cost), the full sample waits until the budget
    of the steps so far covers it: over the first 200 steps, and any later span from the start, the extra time stays
    within 1% (a full sample here costs 17% of a step, the first 80%; a dense step 0.8%)."""
    p = SamplingPolicy(every=None, overhead=0.01)
    full, dense, _ = run(p, 1000, full_ms=17.0, dense_ms=0.8, first_full_ms=80.0)
    for n in (200, 400, 1000):
        spent = 80.0 + 17.0 * (sum(1 for s in full if s < n) - 1) + 0.8 * sum(1 for s in dense if s < n)
        assert spent <= 0.01 * 100.0 * n, (n, full)
    assert full[:3] == [0, 1, 2] and len(full) > 20             # and it samples as the budget affords
    assert full[3] < 200


def test_time_before_the_first_step_is_no_cost_of_the_start():
    """The first step's wall time holds all since watch() (a DataLoader starting its workers: 20 s here) and a later
    full sample's an evaluation run before it (5 s): the ledger counts a full sample at most WALL_PER_PROBE times
    the probe's own time, so neither holds the next full samples back."""
    p = SamplingPolicy(every=None, overhead=0.01)
    full = []
    for step in range(400):
        gap = 20000.0 if step == 0 else 5000.0 if step == 80 else 0.0
        if p.should_sample(step):
            full.append(step)
            p.observe(step, 110.0 + gap, 10.0, True)
        else:
            p.observe(step, 100.0 + gap, 0.0, False)
    assert full[3] < 100 and len(full) > 15, full


def test_a_full_sample_comes_as_soon_as_the_budget_affords_it():
    """Cheap full samples (2% of a step, the dense tier 0.2%: every step, leaving 0.8% to full samples): the start's
    three samples and a fourth fit in 0.8% of the steps so far at step 10; the fourth comes at the first multiple
    of the interval (4) after it, and then every 4 steps."""
    p = SamplingPolicy(every=None, overhead=0.01)
    full, dense, _ = run(p, 200, full_ms=2.0, dense_ms=0.2)
    assert full[:6] == [0, 1, 2, 12, 16, 20]
    assert p.schedule == Schedule(4, 1)
    assert dense == [s for s in range(200) if s not in full]


def test_every_n_keeps_its_meaning_and_the_dense_tier_takes_the_steps_between():
    p = SamplingPolicy(every=4, overhead=None)
    full, dense, _ = run(p, 12)
    assert full == [0, 4, 8] and dense == [1, 2, 3, 5, 6, 7, 9, 10, 11]
    off = SamplingPolicy(every=4, overhead=None, dense=False)
    assert run(off, 12)[:2] == ([0, 4, 8], [])
    third = SamplingPolicy(every=4, overhead=None, dense=3)
    assert run(third, 12)[:2] == ([0, 4, 8], [3, 6, 9])


def test_the_dense_tier_off_gives_the_full_sample_the_whole_budget():
    p = SamplingPolicy(every=None, overhead=0.01, dense=False)
    _, dense, _ = run(p, 3000, full_ms=10.0)
    assert dense == [] and p.schedule == Schedule(16, 0)


def test_a_fixed_dense_interval_is_kept_and_paid_for():
    p = SamplingPolicy(every=None, overhead=0.01, dense=2)
    run(p, 3000, full_ms=10.0, dense_ms=1.0)       # 0.5% for the dense tier, the rest for the full sample
    assert p.schedule == Schedule(32, 2)


def test_on_an_accelerator_dense_steps_are_timed_against_plain_ones():
    """Where the reduction runs after the host launched it, a dense step's cost is what it adds to the step's wall
    time (the host's own time is only the launch)."""
    p = SamplingPolicy(every=None, overhead=0.01, host_timed=False)
    for step in range(3000):
        if p.should_sample(step):
            p.observe(step, 110.0, 10.0, True)
        elif p.dense_due(step):
            p.observe(step, 103.0, 0.05, False, 0.05)     # launched in 50 us, 3 ms on the device
        else:
            p.observe(step, 100.0, 0.0, False)
    assert p.dense_cost_ms() == pytest.approx(3.0)
    assert p.schedule.dense == 4


@pytest.mark.parametrize("every", [None, 3])
def test_next_sample_names_the_next_full_sample(every):
    p = SamplingPolicy(every=every, overhead=None if every else 0.01)
    announced = {}
    for step in range(600):
        announced[step] = p.next_sample(step)
        if p.should_sample(step):
            assert announced[step] == step
            p.observe(step, 110.0, 10.0, True)
        else:
            assert announced[step] > step
            dense = 1.0 if p.dense_due(step) else None
            p.observe(step, 100.0 + (dense or 0.0), dense or 0.0, False, dense)
    sampled = [s for s in range(600) if announced[s] == s]
    # after the start (whose schedule is chosen again at each step), every step between two full samples named the
    # next one
    assert len(sampled) > 5
    for a, b in itertools.pairwise(sampled):
        if a >= START_STEPS:
            assert all(announced[s] == b for s in range(a + 1, b))


class DictChannel:
    def __init__(self):
        self.value = None

    def announce(self, from_step, schedule):
        self.value = (from_step, schedule)

    def latest(self):
        return self.value


@pytest.mark.parametrize("seed", range(3))
def test_ranks_in_lockstep_take_the_same_full_and_dense_steps(seed):
    """Rank 0 chooses both intervals from its own (jumpy) timings and announces them; the followers, whose timings
    differ, sample and take dense values on the very same steps."""
    rng = random.Random(seed)
    channel = DictChannel()
    ranks = [SamplingPolicy(every=None, overhead=0.01, channel=channel, leader=r == 0) for r in range(3)]
    full = {r: [] for r in range(3)}
    dense = {r: [] for r in range(3)}
    upcoming = [p.should_sample(0) for p in ranks]
    schedules = set()
    for step in range(2000):
        order = list(range(3))
        rng.shuffle(order)
        for r in order:
            p = ranks[r]
            if upcoming[r]:
                full[r].append(step)
                extra = rng.choice([1.0, 3.0, 10.0, 30.0]) if r == 0 else 2.0
                p.observe(step, 100.0 + extra, extra, True)
            elif p.dense_due(step):
                dense[r].append(step)
                cost = rng.choice([0.05, 0.3, 1.0, 4.0]) if r == 0 else 0.2
                p.observe(step, 100.0 + cost, cost, False, cost)
            else:
                p.observe(step, 100.0, 0.0, False)
            upcoming[r] = p.should_sample(step + 1)
        schedules.add(ranks[0].schedule)
    assert len({s.dense for s in schedules}) >= 2 and len(full[0]) > 5
    assert full[1] == full[0] and full[2] == full[0]
    assert dense[1] == dense[0] and dense[2] == dense[0]


@pytest.mark.parametrize("dear_from", range(START_STEPS - 22, START_STEPS - 12))     # its change: steps 250-260
def test_a_change_rank_0_makes_at_the_end_of_the_start_reaches_every_rank(dear_from):
    """Rank 0 chooses the schedule at every step of the start and the others read it at every step; a change it makes
    in the last steps of the start (its dense steps become dear, and the median of their cost follows 16 steps
    later; full samples, dear too, are far apart then) is followed by every rank at the same step."""
    channel = DictChannel()
    ranks = [SamplingPolicy(every=None, overhead=0.01, channel=channel, leader=r == 0) for r in range(2)]
    dense = {0: [], 1: []}
    upcoming = [p.should_sample(0) for p in ranks]
    for step in range(600):
        for r in (1, 0):                  # the follower passes each boundary first: it reads before rank 0 writes
            p = ranks[r]
            if upcoming[r]:
                p.observe(step, 160.0, 60.0, True)
            elif p.dense_due(step):
                dense[r].append(step)
                cost = 4.0 if r == 0 and step >= dear_from else 0.1
                p.observe(step, 100.0 + cost, cost, False, cost)
            else:
                p.observe(step, 100.0, 0.0, False)
            upcoming[r] = p.should_sample(step + 1)
    assert dense[1] == dense[0] and len(dense[0]) > 100
