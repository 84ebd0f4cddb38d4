"""Multi-rank benchmark (issue 11): the dashboard over one run of 8 ranks of a small model on CPU.

1. The stores: ``torchrun --nproc_per_node=8`` (gloo, CPU) trains a small GPT-style model under
   DistributedDataParallel for ``--steps`` steps, each rank watched by the real ``probes.watch`` (default
   sampling budget) into one run directory: one store per rank. With ``--real-ranks K`` (K < 8) only K
   real processes train and their stores are cloned into the other ranks (rank r is a copy of real rank
   r mod K, its rank column rewritten); the output says which was done.
2. The dashboard's first render in a real headless Chromium (``python app.py --run DIR``, live mode):
   the Overview with its cards, loss curve and the 8-line per-rank table, with the HTTP cache cleared
   (and once in a freshly started browser); the Findings page (merged over the ranks, with the
   cross-rank comparison).
3. The p50/p95 of the ``dashboard.read.run.Run`` queries over the merged run, each repetition on a fresh
   ``RunDir`` (no cache, new connections: what a request thread of the server pays first).
4. The store size per rank per 10,000 steps: the size of the real rank-0 store divided by its steps,
   times 10,000 (a linear extrapolation, stated as such: the writer's thinning keeps longer runs
   smaller, and the run's first steps are sampled densely).

    python -m bench.multirank_scale                   # 8 real ranks, 300 steps
    python -m bench.multirank_scale --real-ranks 2    # 2 real ranks cloned to 8 (a machine with few cores)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bench.browser import DashboardProcess, RSSSampler, free_port, load_seconds, make_driver

REPO = Path(__file__).resolve().parent.parent


# -- the worker (one rank, started by torchrun) -----------------------------------------------------------
def worker(run_dir: str, steps: int, every: int | None) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import probes
    from bench.models import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(GPT(vocab=128, d=64, layers=2, heads=4, block=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    try:
        with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
            for _ in range(steps):
                x = torch.randint(0, 128, (4, 32), generator=g)
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.roll(-1, 1).reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the stores ----------------------------------------------------------------------------------------------
def train(run_dir: Path, nproc: int, steps: int, every: int | None = None) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           "--rdzv_backend=static", "--node_rank=0", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "--module", "bench.multirank_scale", "--worker", "--run-dir", str(run_dir), "--steps", str(steps),
           *(["--every", str(every)] if every else [])]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def clone_ranks(run_dir: Path, real: int, total: int) -> None:
    """Copy real rank r mod ``real`` into rank r for r in [real, total), rank column and world size rewritten."""
    from probes import schema

    [run_id] = {schema.parse_store_filename(p.name).run_id for p in run_dir.glob("modscope-*-rank*.sqlite")}
    for r in range(real, total):
        src = run_dir / schema.store_filename(run_id, r % real)
        dst = run_dir / schema.store_filename(run_id, r)
        shutil.copyfile(src, dst)
        conn = sqlite3.connect(str(dst))
        try:
            for table in schema.TABLES:
                if table != "meta":
                    conn.execute(f"UPDATE {table} SET rank = ?", (r,))
            conn.execute("UPDATE ranks SET world_size = ?", (total,))
            conn.execute("UPDATE meta SET value = ? WHERE key IN ('world_size', 'rank_count')", (json.dumps(total),))
            conn.commit()
        finally:
            conn.close()
    for r in range(real):
        conn = sqlite3.connect(str(run_dir / schema.store_filename(run_id, r)))
        try:
            conn.execute("UPDATE ranks SET world_size = ?", (total,))
            conn.commit()
        finally:
            conn.close()


# -- measuring -----------------------------------------------------------------------------------------------
PER_SAMPLE = ("module_stats", "param_stats", "module_stats_by_step", "param_stats_by_step")


def size_breakdown(path: Path) -> dict[str, Any]:
    """Where a real rank store's bytes are (SQLite's dbstat, whole pages): the statistics of sampled
    steps, the per-step rows, and the rest (schema, tree, findings); per sampled step and per step."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = dict(conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall())
        steps, sampled = conn.execute("SELECT COUNT(*), SUM(sampled) FROM steps").fetchone()
        last_two = [r[0] for r in conn.execute("SELECT step FROM steps WHERE sampled = 1 ORDER BY step DESC LIMIT 2")]
    finally:
        conn.close()
    per_sample = sum(tables.get(t, 0) for t in PER_SAMPLE)
    per_step = tables.get("steps", 0)
    fixed = sum(tables.values()) - per_sample - per_step
    interval = last_two[0] - last_two[1] if len(last_two) == 2 else 1
    b_sample, b_step = per_sample / max(1, sampled), per_step / max(1, steps)

    def mb(n_steps: int, every: int) -> float:
        return round((fixed + n_steps * b_step + n_steps / every * b_sample) / 2**20, 1)
    return {"fixed_bytes": fixed, "bytes_per_sampled_step": round(b_sample), "bytes_per_step": round(b_step),
            "sampling_interval_at_end": interval,
            "mb_per_10k_steps_at_that_interval": mb(10_000, interval), "mb_per_10k_steps_every_1": mb(10_000, 1)}

def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]


def query_times(run_dir: Path, repeat: int) -> dict[str, list[float]]:
    """ms per Run query, each repetition on a fresh RunDir (no cached results, new connections)."""
    from dashboard.read.run import RunDir

    probe = RunDir.open(run_dir).run()
    rank0 = probe.at(0)
    module = next(m for m in rank0.all_modules(0) if m["params_total"] and m["n_children"] == 0)
    queries: dict[str, Callable[[Any], Any]] = {
        "poll (ranks, change signature, health)": lambda run: (run.ranks(), run.change_signature(0), run.health()),
        "overview (rank 0, merged root causes)": lambda run: run.overview(0),
        "per-rank table (8 ranks)": lambda run: run.rank_rows(),
        "findings merged (8 ranks + cross-rank)": lambda run: run.findings_merged(active=None),
        "cross-rank comparison (divergence, stragglers)": lambda run: run.cross_rank_findings(),
        "module detail: local grad norms (8 ranks)": lambda run: run.local_grad_norms(0, module["module_id"]),
        "module detail: series (rank 0)": lambda run: run.at(0).module_series(0, module["module_id"], max_points=600),
        "snapshot of the run (8 files -> 1)": lambda run: run.snapshot_bytes(),
    }
    out: dict[str, list[float]] = {name: [] for name in queries}
    for _ in range(repeat):
        for name, q in queries.items():
            run = RunDir.open(run_dir, crossrank_interval_s=0.0).run()
            t0 = time.perf_counter()
            q(run)
            out[name].append((time.perf_counter() - t0) * 1000)
            del run
            gc.collect()        # close the previous RunDir's connections (the server keeps one RunDir)
    return out


def browser_times(run_dir: Path, repeat: int) -> dict[str, Any]:
    server = DashboardProcess(run_dir, run_dir.parent / "dashboard.log")
    url = server.url
    rss = RSSSampler(server.pid)
    rss.start()
    driver = make_driver()

    def load(page: str, ready: str, cold: bool) -> float:
        return load_seconds(driver, url + page, ready, cold)

    overview_ready = ("document.querySelectorAll('#ov-ranks tbody tr').length === 8"
                      " && document.querySelector('#ov-cards').innerText.includes('GPT')"
                      " && document.querySelector('#ov-loss .scatterlayer .trace')")
    findings_ready = ("document.querySelector('#findings-list .finding, #findings-list .message')"
                      " && !document.querySelector('#findings-list .message.wait')")
    out: dict[str, Any] = {}
    try:
        out["overview_fresh_browser_s"] = load("", overview_ready, cold=False)
        out["overview_s"] = [load("", overview_ready, cold=True) for _ in range(repeat)]
        out["findings_s"] = [load("findings", findings_ready, cold=True) for _ in range(repeat)]
        out["findings_cards"] = driver.execute_script(
            "return document.querySelectorAll('#findings-list > .finding').length")
    finally:
        driver.quit()
        rss.stop.set()
        rss.join(1)
        server.stop()
    out["dashboard_peak_rss_mb"] = round(rss.peak / 2**20, 1)
    return out


class TrainedRun(NamedTuple):
    """The run the dashboard reads: its stores, trained (and cloned up to ``--ranks``)."""
    run_dir: Path
    how: str                        # real ranks, or real ranks cloned
    train_s: float
    size0: int                      # bytes of the real rank-0 store
    breakdown: dict[str, Any]       # size_breakdown of the real rank-0 store


class Every1Store(NamedTuple):
    """The rank-0 store of a run that sampled every step (2 real ranks, every=1, 200 steps)."""
    size: int
    breakdown: dict[str, Any]
    mb_per_10k_steps: float         # extrapolated linearly


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--every", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help="where the stores go (default: a temporary directory)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--real-ranks", type=int, default=None, help="real processes (default: --ranks); the rest cloned")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=20, help="repetitions of each query (browser loads: a quarter)")
    ap.add_argument("--json", help="also write the results here")
    return ap.parse_args(argv)


def train_run(base: Path, ranks: int, real: int, steps: int) -> TrainedRun:
    run_dir = base / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    print(f"training: torchrun --nproc_per_node={real}, gloo on CPU, {steps} steps, small GPT "
          f"(2 blocks, d=64), probes.watch with the default budget ...", flush=True)
    train_s = train(run_dir, real, steps)
    how = f"{real} real ranks" if real == ranks else \
        f"{real} real ranks, cloned to {ranks} (rank r = real rank r mod {real})"
    rank0 = sorted(run_dir.glob("modscope-*-rank0.sqlite"))[0]
    size0 = rank0.stat().st_size
    breakdown = size_breakdown(rank0)
    if real < ranks:
        clone_ranks(run_dir, real, ranks)
    return TrainedRun(run_dir, how, train_s, size0, breakdown)


def train_every1(base: Path) -> Every1Store:
    """Bytes per sampled step, measured where every step is sampled (2 real ranks, every=1, 200 steps)."""
    every1 = base / "every1"
    if every1.exists():
        shutil.rmtree(every1)
    print("  and, for the bytes of a sampled step: torchrun --nproc_per_node=2, every=1, 200 steps ...", flush=True)
    train(every1, 2, 200, every=1)
    every1_rank0 = sorted(every1.glob("modscope-*-rank0.sqlite"))[0]
    size = every1_rank0.stat().st_size
    return Every1Store(size, size_breakdown(every1_rank0), round(size / 200 * 10_000 / 2**20, 1))


def describe_stores(trained: TrainedRun, every1: Every1Store) -> dict[str, Any]:
    """The stores' figures, as the merged run reads them."""
    from dashboard.read.run import RunDir

    run = RunDir.open(trained.run_dir).run()
    ranks = run.ranks()
    store0 = run.at(0)
    ov = store0.overview(0)
    n_modules = sum(ov["modules"].values())
    sampled = ov["samples_stored"]
    results: dict[str, Any] = {
        "stores": trained.how, "ranks": ranks, "steps": ov["steps_recorded"], "train_s": round(trained.train_s, 1),
        "modules": n_modules, "sampled_steps_rank0": sampled,
        "store_bytes_rank0": trained.size0,
        "store_mb_per_rank_per_10k_steps_linear": round(trained.size0 / ov["steps_recorded"] * 10_000 / 2**20, 1),
        "store_breakdown_rank0": trained.breakdown,
        "store_every1_breakdown_rank0": every1.breakdown,
        "store_every1_mb_per_10k_steps_linear": every1.mb_per_10k_steps,
    }
    print(f"  {trained.how}; {n_modules} modules; {ov['steps_recorded']} steps of which {sampled} sampled on each "
          f"rank; trained in {trained.train_s:.0f} s", flush=True)
    return results


def measure_queries(run_dir: Path, repeat: int) -> dict[str, dict[str, float]]:
    print("queries over the merged run ...", flush=True)
    q = query_times(run_dir, repeat)
    return {k: {"p50": round(statistics.median(v), 1), "p95": round(pct(v, 95), 1), "max": round(max(v), 1)}
            for k, v in q.items()}


def measure_browser(run_dir: Path, repeat: int) -> tuple[dict[str, Any], int]:
    """The dashboard's first renders in Chromium, summarized; and how many cold overview loads were timed."""
    print("the dashboard in Chromium ...", flush=True)
    b = browser_times(run_dir, max(3, repeat // 4))
    summary = {
        "overview_first_render_s": {"p50": round(statistics.median(b["overview_s"]), 3),
                                    "max": round(max(b["overview_s"]), 3)},
        "overview_first_render_fresh_browser_s": round(b["overview_fresh_browser_s"], 3),
        "findings_first_render_s": {"p50": round(statistics.median(b["findings_s"]), 3),
                                    "max": round(max(b["findings_s"]), 3)},
        "findings_cards": b["findings_cards"], "dashboard_peak_rss_mb": b["dashboard_peak_rss_mb"],
    }
    return summary, len(b["overview_s"])


def print_report(results: dict[str, Any], trained: TrainedRun, every1: Every1Store, overview_loads: int) -> None:
    steps, sampled, size0 = results["steps"], results["sampled_steps_rank0"], trained.size0
    print(f"\nstores: {trained.how}, {steps} steps, {results['modules']} modules per rank")
    print(f"{'query over the merged run (fresh RunDir each time)':52s} {'p50 ms':>8s} {'p95 ms':>8s} {'max ms':>8s}")
    for k, v in results["queries_ms"].items():
        print(f"{k:52s} {v['p50']:8.1f} {v['p95']:8.1f} {v['max']:8.1f}")
    br = results["browser"]
    print(f"\noverview first render, HTTP cache cleared: median {br['overview_first_render_s']['p50']:.2f} s, "
          f"max {br['overview_first_render_s']['max']:.2f} s ({overview_loads} loads)")
    print(f"overview first render, freshly started browser: {br['overview_first_render_fresh_browser_s']:.2f} s")
    print(f"findings page first render: median {br['findings_first_render_s']['p50']:.2f} s, "
          f"max {br['findings_first_render_s']['max']:.2f} s ({br['findings_cards']} cards)")
    print(f"dashboard peak RSS: {br['dashboard_peak_rss_mb']} MB")
    print(f"\nstore size, rank 0: {size0 / 2**20:.2f} MB for {steps} steps ({sampled} sampled) -> "
          f"{results['store_mb_per_rank_per_10k_steps_linear']} MB per rank per 10,000 steps, extrapolated "
          "linearly (an upper bound: the dense first steps and no thinning at this length)")
    bd, e1 = trained.breakdown, every1.breakdown
    print(f"  the budget reached a sampling interval of {bd['sampling_interval_at_end']} steps; at that interval "
          f"10,000 steps would take {bd['mb_per_10k_steps_at_that_interval']} MB (linear)")
    print(f"every step sampled (every=1, 2 real ranks, 200 steps): rank 0 {every1.size / 2**20:.2f} MB "
          f"-> {every1.mb_per_10k_steps} MB per rank per 10,000 steps, extrapolated linearly before thinning (the "
          f"writer keeps about 2,000 sampled steps of a long run); {e1['bytes_per_sampled_step']:,} bytes per sampled "
          f"step, {e1['bytes_per_step']:,} bytes per step, {e1['fixed_bytes'] / 1024:.0f} KiB the rest (whole pages)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.run_dir, args.steps, args.every)
        return 0
    real = args.real_ranks or args.ranks
    base = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="modscope-multirank-"))
    trained = train_run(base, args.ranks, real, args.steps)
    every1 = train_every1(base)
    results = describe_stores(trained, every1)
    results["queries_ms"] = measure_queries(trained.run_dir, args.repeat)
    results["browser"], overview_loads = measure_browser(trained.run_dir, args.repeat)
    print_report(results, trained, every1, overview_loads)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
