"""The overhead budget and the store's thinning, checked by their behaviour."""
import sqlite3

import pytest
import torch
import zoo
from helpers import train

import probes
from probes.capture.sampling import MAX_INTERVAL, SamplingPolicy
from probes.store import session as session_mod


def feed(policy, plain_ms, sampled_ms, probe_ms, steps):
    sampled_steps = []
    for step in range(steps):
        s = policy.should_sample(step)
        if s:
            sampled_steps.append(step)
        policy.observe(step, sampled_ms if s else plain_ms, probe_ms if s else 0.0, s)
    return sampled_steps


def test_budget_chooses_the_interval_from_measured_cost():
    p = SamplingPolicy(every=None, overhead=0.01)
    sampled = feed(p, plain_ms=100.0, sampled_ms=110.0, probe_ms=5.0, steps=400)
    # a sampled step costs 10 ms more than a 100 ms step: 1% needs one sample every 10 steps; the interval
    # is the power of two at or above it (the budget is an upper bound)
    assert p.interval == 16
    # the start: steps 0-2 (findings at once); the budget counts them: the next sample comes at the first multiple
    # of the interval from which 1% of the steps so far covers all four (30 + 10 ms: step 40)
    assert sampled[:5] == [0, 1, 2, 48, 64]
    assert p.overhead() == pytest.approx(10.0 / (100.0 * 16))
    assert set(sampled) == {s for s in range(400) if s < 3 or (s >= 48 and s % 16 == 0)}


def test_the_interval_is_chosen_at_the_first_unsampled_step_after_the_start():
    """An expensive sampled step (here 5 times a plain one) must not be repeated before the budget allows:
    the interval is chosen as soon as one unsampled step is timed, not at the next sampled step."""
    p = SamplingPolicy(every=None, overhead=0.01)
    sampled = feed(p, plain_ms=100.0, sampled_ms=500.0, probe_ms=400.0, steps=2100)
    # the start's three samples cost 12 plain steps: 1% of the steps covers them and a fourth only at step 1600;
    # full samples stay at most MAX_INTERVAL steps apart
    assert sampled == [0, 1, 2, 1024, 2048]


def test_budget_adapts_when_sampling_gets_expensive():
    p = SamplingPolicy(every=None, overhead=0.01)
    feed(p, 100.0, 150.0, 40.0, 300)
    assert p.interval == 64                   # 50 needed
    p2 = SamplingPolicy(every=None, overhead=0.05)
    feed(p2, 100.0, 150.0, 40.0, 300)
    assert p2.interval == 16                  # a bigger budget samples more often (10 needed)


class DictChannel:
    """What torch.distributed's key-value store does for the policy: one shared announcement."""

    def __init__(self):
        self.value = None

    def announce(self, from_step, schedule):
        self.value = (from_step, schedule)

    def latest(self):
        return self.value


def test_ranks_sample_the_same_steps_whatever_their_own_timings():
    channel = DictChannel()
    leader = SamplingPolicy(every=None, overhead=0.01, channel=channel, leader=True)
    follower = SamplingPolicy(every=None, overhead=0.01, channel=channel, leader=False)
    sampled = {0: [], 1: []}
    intervals = set()
    for step in range(3000):
        # rank 0 finds sampling expensive (30 ms), then cheap (1 ms) from step 1500; rank 1 always cheap
        for rank, (policy, extra) in enumerate(((leader, 30.0 if step < 1500 else 1.0), (follower, 2.0))):
            s = policy.should_sample(step)
            if s:
                sampled[rank].append(step)
            policy.observe(step, 100.0 + (extra if s else 0.0), extra if s else 0.0, s)
        intervals.add(leader.interval)
    assert sampled[0] == sampled[1]
    assert 32 in intervals and leader.interval == follower.interval == 1
    assert len(sampled[0]) > 100
@pytest.mark.parametrize("seed", range(4))
def test_ranks_in_lockstep_sample_the_same_steps_when_rank_0_changes_its_mind(seed):
    """Data parallelism in lockstep: at each step boundary every rank records its step and decides whether the next
    is sampled, in any order across ranks (a follower's read of the announcement may fall before rank 0's
    announcement of the same boundary); no rank passes the next boundary before all passed this one (the step's
    all-reduce). Rank 0's sampling cost jumps about, so it announces new intervals and takes back ones whose step
    has not come: no follower may switch alone."""
    import random
    rng = random.Random(seed)
    channel = DictChannel()
    ranks = [SamplingPolicy(every=None, overhead=0.01, channel=channel, leader=r == 0) for r in range(3)]
    sampled: dict[int, list[int]] = {r: [0] for r in range(3)}
    upcoming = [p.should_sample(0) for p in ranks]
    intervals = set()
    for step in range(2000):
        order = list(range(3))
        rng.shuffle(order)
        for r in order:
            s = upcoming[r]
            extra = rng.choice([1.0, 3.0, 10.0, 30.0, 60.0]) if r == 0 else 2.0
            ranks[r].observe(step, 100.0 + (extra if s else 0.0), extra if s else 0.0, s)
            upcoming[r] = ranks[r].should_sample(step + 1)
            if upcoming[r]:
                sampled[r].append(step + 1)
        intervals.add(ranks[0].interval)
    assert len(intervals) >= 3 and len(sampled[0]) > 30
    assert sampled[1] == sampled[0] and sampled[2] == sampled[0]


def test_interval_is_capped_and_fixed_every_is_respected():
    p = SamplingPolicy(every=None, overhead=0.01)
    feed(p, 1.0, 1000.0, 999.0, 3000)
    assert p.interval == MAX_INTERVAL
    fixed = SamplingPolicy(every=3, overhead=None)
    assert feed(fixed, 1.0, 100.0, 99.0, 10) == [0, 3, 6, 9]


def test_every_one_reports_overhead_from_probe_time():
    p = SamplingPolicy(every=1, overhead=None)
    feed(p, 100.0, 120.0, 20.0, 10)
    assert p.overhead() == pytest.approx(20.0 / 100.0)


def test_long_runs_are_thinned(run_dir, monkeypatch):
    monkeypatch.setattr(session_mod, "THIN_RECENT", 20)
    monkeypatch.setattr(session_mod, "THIN_OLD", 10)
    monkeypatch.setattr(session_mod, "THIN_EVERY", 10)
    model = zoo.MLP(din=4, hidden=8, dout=2, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 300, lambda: (x, y))
    con = sqlite3.connect(w.store_path)
    sampled = [r[0] for r in con.execute("SELECT DISTINCT step FROM module_stats ORDER BY step")]
    assert len(sampled) <= 20 + 10 + 10 + 2            # recent window + thinned history (+ one pass of slack)
    assert sampled[-20:] == list(range(280, 300))            # the recent window is whole
    assert sampled[0] == 0                               # the oldest history stays represented
    steps = [r[0] for r in con.execute("SELECT step FROM steps ORDER BY step")]
    assert len(steps) < 300 and steps[0] == 0 and steps[-1] == 299
    # every module row of a kept step is still complete
    per_step = {r[0] for r in con.execute("SELECT COUNT(*) FROM module_stats GROUP BY step")}
    assert len(per_step) == 1


def test_probe_time_is_counted_once_and_lies_within_the_step(run_dir):
    """The probe's own time per step (what the overhead shown on the dashboard is made of)
    counts nested hook guards and the step's finishing work once, inside the step's wall time,
    and never spills into the next step."""
    model = zoo.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=2) as w:
        train(model, opt, w, 16, lambda: (torch.randn(8, 32), torch.randint(0, 10, (8,))))
        store = w.store_path
    con = sqlite3.connect(store)
    rows = con.execute("SELECT step, step_ms, probe_ms, sampled FROM steps ORDER BY step").fetchall()
    sampled = [r for r in rows if r[3]]
    plain = [r for r in rows if not r[3]]
    assert len(sampled) == 8 and len(plain) == 8
    assert all(0 < probe <= wall for _, wall, probe, _ in sampled)
    # an unsampled step runs only the optimizer hooks and the step boundary: a small share of the
    # sampled steps' probe time, not their finishing work carried over (which would be in every one of
    # them). The median, not the maximum: a collection of the heap that the sampled step paused may run
    # inside the next step's optimizer hook, and in a long test session it alone can take milliseconds
    plain_ms = sorted(p for _, _, p, _ in plain)
    assert plain_ms[len(plain_ms) // 2] < min(p for _, _, p, _ in sampled) / 2
