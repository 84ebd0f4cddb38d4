"""Real two-process ``torchrun`` jobs (gloo, CPU) under the default sampling budget, which samples steps 0 to 2
and then rarely (a tiny model: one step in 32 or fewer):

* rank 1 changes ``fc.weight`` in place after step 5 of 40: ``rank-divergence`` names it and rank 1, found at
  the ranks' close (the fingerprints every rank stores when its watcher closes), with the last sampled step at
  which the ranks still agreed;
* rank 1 sleeps 20 ms before every backward: DDP makes both ranks wait for each other in the all-reduce, so
  their wall times per step are equal, and only each rank's own time (``steps.compute_ms``) names rank 1 as the
  ``rank-straggler``.

The training script is tests/distributed/ddp_train.py; the job runner is test_torchrun.py's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
from test_torchrun import REPO, env, run_job

from dashboard.read import crossrank
from dashboard.read.run import RunDir

STEPS = 40
DIVERGE_AFTER = 5
STRAGGLER_STEPS = 128          # four windows of 32 steps
SLOW_MS = 20


@pytest.fixture(scope="module")
def diverged_late_found(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("diverge-default") / "run"
    run_job(run_dir, "--steps", str(STEPS), "--diverge-at", str(DIVERGE_AFTER))
    return run_dir


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straggler-default") / "run"
    run_job(run_dir, "--steps", str(STRAGGLER_STEPS), "--slow-rank", "1", "--slow-ms", str(SLOW_MS))
    return run_dir


def test_a_replica_that_diverges_after_the_first_samples_is_found_at_close(diverged_late_found):
    run = RunDir.open(diverged_late_found, crossrank_interval_s=0.0).run()
    assert run.ranks() == [0, 1]
    sampled = sorted(run.at(0).sampled_steps(0))
    assert sampled == sorted(run.at(1).sampled_steps(1)) and sampled[:3] == [0, 1, 2]
    assert len(sampled) < STEPS / 4                       # the default budget: most steps are not sampled
    [d] = [f for f in run.findings_merged(active=True) if f["code"] == "rank-divergence"]
    assert (d["path"], d["ranks"], d["severity"]) == ("fc.weight", [1], "error")
    ev = d["evidence"]
    assert ev["at_close"] and d["last_step"] == STEPS - 1     # the values after the last step
    assert ev["disagree"] == [1] and ev["agree"] == [0] and ev["quantity"] == "fingerprint"
    # it agreed at the last sample before the change, and differs at every compared point since
    assert ev["agreed_at"] == max(s for s in sampled if s <= DIVERGE_AFTER)
    assert DIVERGE_AFTER < d["first_step"] <= STEPS - 1
    assert f"when the ranks closed (after step {STEPS - 1}): rank 1 disagrees with rank 0" in d["message"]
    assert not [f for f in run.findings_merged() if f["code"] == "rank-divergence" and f["path"] != "fc.weight"]
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "findings", "--run", str(diverged_late_found),
                        "--json", "--fail-on", "error"],
                       env=env(), cwd=str(REPO), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stderr
    assert [(f["path"], f["ranks"]) for f in json.loads(r.stdout) if f["code"] == "rank-divergence"] == \
        [("fc.weight", [1])]


def test_a_rank_slowed_before_backward_is_the_straggler_by_its_own_time(slowed):
    run = RunDir.open(slowed, crossrank_interval_s=0.0).run()
    wall = {r: dict(run.at(r).step_times(r)) for r in (0, 1)}
    own = {r: dict(run.at(r).compute_times(r)) for r in (0, 1)}
    assert set(own[0]) == set(own[1]) == set(range(STRAGGLER_STEPS))
    # synchronous DDP: the wall times are alike (rank 0 waits in the all-reduce), so they name nobody ...
    assert statistics.median(wall[0].values()) > 0.8 * statistics.median(wall[1].values())
    assert crossrank.stragglers({r: list(wall[r].items()) for r in (0, 1)}) == []
    # ... while rank 1's own time holds the sleep and rank 0's does not
    assert statistics.median(own[1].values()) >= SLOW_MS * 0.9
    assert statistics.median(own[0].values()) < SLOW_MS / 2
    [s] = [f for f in run.findings_merged(active=True) if f["code"] == "rank-straggler"]
    assert (s["ranks"], s["severity"], s["path"]) == ([1], "warning", "")
    assert s["evidence"]["time"] == "own" and s["evidence"]["windows_slow"] == s["evidence"]["windows_compared"] == 4
    assert s["message"].startswith("rank 1's own time per step (outside the waits for the other ranks) is ")
    assert s["last_step"] == STRAGGLER_STEPS - 1
    assert not [f for f in run.findings_merged() if f["code"] == "rank-divergence"]
