"""Real ``torchrun`` jobs (gloo on CPU) watched by probes, read back by the dashboard as one run.

* ``--nproc_per_node=2`` healthy: one run of ranks 0 and 1, the same sampled steps on both, identical
  replicas (no rank-divergence), each rank's local gradient norms.
* ``--nproc_per_node=2`` with rank 1 changing ``fc.weight`` in place once: rank-divergence at that weight,
  from the step it happened, in ``Run.findings_merged`` (what ``modscope findings`` prints) and on the
  Findings page in Chromium.
* a simulated two-node job: two ``torchrun --nnodes=2 --node_rank=0/1`` (static rendezvous on
  localhost), each with one process, writing into one run directory: read as one run of ranks 0 and 1,
  written with the rollback journal (a multi-node job).

The model is tests/distributed/ddp_train.py (DDP: the writer names paths without ``module.``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard.read.run import RunDir

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "ddp_train.py"
TIMEOUT = 600
DIVERGE_AT = 10
EVERY = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher]


def run_job(run_dir: Path, *args: str, nproc: int = 2) -> None:
    port = free_port()
    cmd = torchrun("--nnodes=1", f"--nproc_per_node={nproc}", "--rdzv_backend=static", "--node_rank=0",
                   "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPT), "--run-dir", str(run_dir), *args)
    r = subprocess.run(cmd, env=env(), cwd=str(REPO), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("healthy") / "run"
    run_job(run_dir, "--steps", "40")
    return run_dir


@pytest.fixture(scope="module")
def diverged(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("diverged") / "run"
    run_job(run_dir, "--steps", "30", "--every", str(EVERY), "--diverge-at", str(DIVERGE_AT))
    return run_dir


def test_two_healthy_ranks_are_one_run_with_identical_replicas(healthy):
    source = RunDir.open(healthy, crossrank_interval_s=0.0)
    [entry] = source.entries()
    assert entry.file_ranks == (0, 1)
    run = source.run()
    assert run.ranks() == [0, 1] and run.run_id() == entry.run_id
    for r in (0, 1):
        meta = run.at(r).meta()
        assert (meta["run_id"], meta["world_size"]) == (entry.run_id, 2)
    states = run.states()
    assert {s.state.value for s in states.values()} == {"closed"}
    # rank-consistent sampling (the default budget): both ranks sampled the same steps
    sampled = {r: run.at(r).sampled_steps(r) for r in (0, 1)}
    assert sampled[0] == sampled[1] and len(sampled[0]) >= 3
    # what replicas agree on is stored for parameters and buffers, and agrees
    step = sampled[0][0]
    values = {r: run.at(r).tensor_values(r, step) for r in (0, 1)}
    assert set(values[0]) == set(values[1]) >= {"fc.weight", "fc.bias", "head.weight", "head.bias"}
    assert all(fp is not None for fp, _ in values[0].values())
    assert values[0]["fc.weight"] == pytest.approx(values[1]["fc.weight"], rel=1e-6)
    merged = run.findings_merged()
    assert not [f for f in merged if f["code"] in ("rank-divergence", "rank-straggler")]
    assert not [f for f in merged if f["path"].startswith("module.")]          # DDP's wrapper prefix is gone
    # each rank's own gradient before the all-reduce, side by side
    fc = run.at(0).module_by_path(0, "fc")
    norms = run.local_grad_norms(0, fc["module_id"])
    weight = next(r for r in norms["rows"] if r["name"] == "weight")
    assert set(weight["values"]) == {0, 1} and all(v is not None and v > 0 for v in weight["values"].values())
    assert weight["values"][0] != pytest.approx(weight["values"][1], rel=1e-3)    # different data per rank


def test_a_weight_changed_on_one_rank_is_found(diverged):
    run = RunDir.open(diverged, crossrank_interval_s=0.0).run()
    assert run.ranks() == [0, 1]
    found = [f for f in run.findings_merged(active=True) if f["code"] == "rank-divergence"]
    assert [f["path"] for f in found] == ["fc.weight"], found
    [d] = found
    assert d["severity"] == "error" and d["ranks"] == [1] and d["cross_rank"]
    sampled = run.at(0).sampled_steps(0)
    assert DIVERGE_AT <= d["first_step"] <= DIVERGE_AT + EVERY and d["first_step"] in sampled
    assert d["last_step"] == 29 and d["evidence"]["at_close"]      # the ranks' close: after the last step
    ev = d["evidence"]
    assert ev["disagree"] == [1] and ev["agree"] == [0] and ev["quantity"] == "fingerprint"
    assert set(ev["values"]) == {"0", "1"}
    # the other tensors stay identical: the change was to fc.weight only
    assert not [f for f in run.findings_merged() if f["code"] == "rank-divergence" and f["path"] != "fc.weight"]
    for key in ("code", "severity", "path", "message", "fix", "ranks", "first_step", "last_step", "count",
                "cause_code", "cause_path"):
        assert key in d


def test_modscope_findings_prints_the_divergence(diverged):
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "findings", "--run", str(diverged), "--json"],
                       env=env(), cwd=str(REPO), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    found = [f for f in json.loads(r.stdout) if f["code"] == "rank-divergence"]
    assert [(f["path"], f["ranks"]) for f in found] == [("fc.weight", [1])]


@pytest.mark.browser
def test_the_divergence_on_the_findings_page(page, server_factory, diverged):
    from browser_helpers import screenshot, wait_text
    from selenium.webdriver.common.by import By

    srv = server_factory(["--run", str(diverged)])
    page.get(srv.url + "findings")
    card = wait_text(page, "rank-divergence", "#findings-list .finding")
    assert "fc.weight" in card.text and "rank 1" in card.text
    assert "differs between ranks" in card.find_element(By.CSS_SELECTOR, ".finding-message").text
    screenshot(page, "torchrun-divergence")


def test_two_nodes_write_one_run(tmp_path):
    """Two launchers (node ranks 0 and 1, one process each) on localhost, static rendezvous: one run
    of ranks 0 and 1 in the shared directory, each store written with the rollback journal."""
    run_dir = tmp_path / "run"
    port = free_port()
    procs = [subprocess.Popen(
        torchrun("--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_backend=static",
                 "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPT), "--run-dir", str(run_dir),
                 "--steps", "20", "--every", "1"),
        env=env(), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    source = RunDir.open(run_dir, crossrank_interval_s=0.0)
    [entry] = source.entries()
    assert entry.file_ranks == (0, 1)
    run = source.run()
    assert run.ranks() == [0, 1]
    for r in (0, 1):
        meta = run.at(r).meta()
        assert meta["world_size"] == 2 and meta["journal_mode"] == "delete"
        assert not Path(str(run.at(r).path) + "-wal").exists()
    assert {s.state.value for s in run.states().values()} == {"closed"}
    assert [row["step"] for row in run.rank_rows()] == [19, 19]
    assert not [f for f in run.findings_merged() if f["code"] == "rank-divergence"]
