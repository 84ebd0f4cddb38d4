"""The dense tier's cost under the default budget: the first 200 steps of bare training, modscope's default (dense
tier on) and modscope's default with ``dense=False``, side by side, for the GPT-style and CNN models of
bench/overhead.py and a 6-layer tanh MLP (width 256, batch 128, SGD).

    python -m bench.dense_tier                          # gpt, cnn, tanh-mlp; 200 steps; one torch thread
    python -m bench.dense_tier --models tanh-mlp --steps 500 --json out.json

The three configurations train their own copy of the model (same seed, same batches) step by step interleaved, in
a fresh random order each step, so that the machine's drift falls on all three alike. modscope times a step from
the end of the one before (in a training loop, what the loop does between steps is part of its step): here the
other configurations' steps run in between, so each watched step's clock is started where its own step starts. The
overhead is the ratio of total step times over every step from the first (the start's full samples included);
``watch()`` and ``close()`` are timed apart. The coverage is read from each run's store: the steps with
per-parameter gradient norms (dense series and full samples together) and the full samples.
"""
from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import torch

import probes
from bench.models import registry
from bench.overhead import sync

CONFIGS = {"bare": None, "dense on": True, "dense off": False}


class Run:
    """One configuration's copy of the model, its optimizer and (but bare) its watcher."""

    def __init__(self, name: str, dense: bool | None, factory, batch_fn, loss_fn, sgd: bool, device: str,
                 run_dir: Path) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = factory().to(device)
        self.opt = (torch.optim.SGD(self.model.parameters(), lr=0.05) if sgd
                    else torch.optim.AdamW(self.model.parameters(), lr=1e-4))
        self.batch_fn, self.loss_fn, self.device = batch_fn, loss_fn, device
        self.watcher = None
        self.setup_ms = self.close_ms = 0.0
        if dense is not None:
            t0 = time.perf_counter()
            self.watcher = probes.watch(self.model, self.opt, run_dir=run_dir, dense=dense)
            self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.step_ms: list[float] = []

    def step(self, batch) -> None:
        x, y = batch
        sync(self.device)
        t0 = time.perf_counter()
        if self.watcher is not None:          # its step starts here, not where this run's last step ended
            self.watcher._probe.step_t0 = t0
        loss = self.loss_fn(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.watcher is not None:
            self.watcher.step(loss)
        sync(self.device)
        self.step_ms.append((time.perf_counter() - t0) * 1e3)

    def close(self) -> None:
        if self.watcher is not None:
            t0 = time.perf_counter()
            self.watcher.close()
            self.close_ms = (time.perf_counter() - t0) * 1e3


def coverage(store: Path, steps: int) -> dict:
    """The steps with gradient norms (param_series and param_stats together), and the full samples."""
    con = sqlite3.connect(store)
    try:
        dense = {s for s, in con.execute("SELECT DISTINCT step FROM param_series WHERE grad_norm IS NOT NULL")}
        full = sorted(s for s, in con.execute("SELECT DISTINCT step FROM param_stats"))
    finally:
        con.close()
    return {"grad_norm_steps": len(dense | set(full)) / steps, "dense_steps": len(dense) / steps,
            "full_samples": full}


def bench_model(name: str, steps: int, device: str, workdir: Path) -> dict:
    factory, batch_fn, loss_fn = registry(device)[name]
    runs = [Run(c, dense, factory, batch_fn, loss_fn, name == "tanh-mlp", device, workdir / name / c.replace(" ", "-"))
            for c, dense in CONFIGS.items()]
    batches = [batch_fn() for _ in range(steps)]        # the same batches for all three
    order = random.Random(0)
    try:
        for batch in batches:
            for run in order.sample(runs, len(runs)):
                run.step(batch)
    finally:
        for run in runs:
            run.close()
    bare = sum(runs[0].step_ms)
    result: dict = {"bare_ms_per_step": bare / steps}
    for run in runs[1:]:
        assert run.watcher is not None
        total = sum(run.step_ms)
        result[run.name] = {
            "overhead": total / bare - 1,
            "overhead_with_setup_and_close": (total + run.setup_ms + run.close_ms) / bare - 1,
            "self_reported": run.watcher._policy.overhead(),
            "schedule": run.watcher._policy.schedule._asdict(),
            **coverage(run.watcher.store_path, steps),
        }
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,cnn,tanh-mlp", help="comma list of bench.models' registry names")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: see benchmarks.md)")
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    known = registry(args.device)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in known]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; expected some of {sorted(known)}")
    if args.steps < 1:
        ap.error(f"--steps must be a positive int, got {args.steps}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}  device={args.device}  threads={torch.get_num_threads()}  "
          f"{args.steps} steps from the first, interleaved; default budget (1%)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            r = results[name] = bench_model(name, args.steps, args.device, Path(tmp))
            print(f"\n{name}: bare {r['bare_ms_per_step']:.1f} ms/step")
            print(f"  {'':10s} {'overhead':>9s} {'+watch/close':>13s} {'self':>6s} {'grad-norm steps':>16s} "
                  f"{'dense':>6s}  schedule (full, dense)  full samples")
            for config in ("dense on", "dense off"):
                c = r[config]
                own = "-" if c["self_reported"] is None else f"{c['self_reported']:.2%}"
                full = c["full_samples"]
                shown = ", ".join(map(str, full[:12])) + (", ..." if len(full) > 12 else "")
                print(f"  {config:10s} {c['overhead']:+9.2%} {c['overhead_with_setup_and_close']:+13.2%} {own:>6s} "
                      f"{c['grad_norm_steps']:16.0%} {c['dense_steps']:6.0%}  "
                      f"({c['schedule']['interval']}, {c['schedule']['dense']}){'':13s}{shown}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
