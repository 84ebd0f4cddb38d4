"""Models made of many small modules: the host cost of a sampled step per module call, and the cost of
the start of a run under the default budget.

    python -m bench.many_modules                          # 1,000 and 5,000 residual blocks
    python -m bench.many_modules --blocks 5000 --start 200,2000

Each block is a residual Linear(16, 16) + ReLU (3 modules: 5,000 blocks are 15,001 modules). Prints, side
by side in one run:
- per-call host time of a sampled step: (median sampled-step time - median bare-step time) / module calls
  (every=1 against bare, interleaved; each bare step starts with the store's writer idle, and so does the watched
  step after it, whose writes then overlap the next watched step as in a run: both are printed), modscope's own
  accounting (probe_ms / calls),
  and the CPU time of the store's writer thread (on another core, in parallel with training);
- the start of a run: total time of the first N steps with the default budget against bare (fresh
  models and watchers, same seed), and the first step at which each expected finding appeared.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import probes


class Residual(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()
        with torch.no_grad():          # small residual branches: 5,000 of them keep the stream finite
            self.fc.weight.mul_(0.0005)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class Deep(nn.Module):
    """``blocks`` residual blocks, and one more kept in a plain list (a bug the run must find)."""

    def __init__(self, blocks: int, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Residual(width) for _ in range(blocks)])
        self.extra = [Residual(width)]              # unregistered: findings must appear early
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.extra[0](self.blocks(x)))


def make(blocks: int, seed: int = 0):
    torch.manual_seed(seed)
    model = Deep(blocks)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 2, (8,), generator=g)
    return model, opt, x, y


def one_step(model, opt, x, y, w=None) -> float:
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if w is not None:
        w.step(loss)
    return (time.perf_counter() - t0) * 1e3


def module_calls(model: nn.Module, x: torch.Tensor) -> int:
    calls = 0

    def count(*_):
        nonlocal calls
        calls += 1
    h = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        with torch.no_grad():
            model(x)
    finally:
        h.remove()
    return calls


def per_call(blocks: int, rounds: int, workdir: Path) -> dict:
    bare = make(blocks)
    watched = make(blocks)
    w = probes.watch(watched[0], watched[1], run_dir=workdir / f"every1-{blocks}", every=1)
    calls = module_calls(bare[0], bare[2])
    for _ in range(8):     # warm both: with 3, the first model of a run measured 1.3-1.5x slow (allocator, caches)
        one_step(*bare)
        one_step(*watched, w=w)
    t_bare, t_alone, t_watched, writer_cpu = [], [], [], []
    for _ in range(rounds):
        # the store's writer thread writes a sample while training goes on: its work must weigh on the next
        # watched step, as in a real run, not on a bare one. So: the writer idle, a bare step; a watched step
        # (the writer still idle: the probe's own cost), whose writes overlap the watched step after it
        w._writer.flush()
        t_bare.append(one_step(*bare))
        t_alone.append(one_step(*watched, w=w))
        cpu0, main0 = time.process_time(), time.thread_time()
        t_watched.append(one_step(*watched, w=w))
        w._writer.flush()
        writer_cpu.append(((time.process_time() - cpu0) - (time.thread_time() - main0)) * 1e3)
    w._writer.flush()
    import sqlite3
    con = sqlite3.connect(w.store_path)
    probe = [r[0] for r in con.execute("SELECT probe_ms FROM steps WHERE step >= 8 AND probe_ms IS NOT NULL")]
    con.close()
    w.close()
    extra = statistics.median(t_watched) - statistics.median(t_bare)
    alone = statistics.median(t_alone) - statistics.median(t_bare)
    return {"blocks": blocks, "modules": sum(1 for _ in bare[0].modules()) + 3, "calls": calls,
            "bare_ms": statistics.median(t_bare), "sampled_ms": statistics.median(t_watched),
            "per_call_us": extra / calls * 1e3, "writer_idle_per_call_us": alone / calls * 1e3,
            "self_per_call_us": statistics.median(probe) / calls * 1e3,
            "writer_cpu_per_call_us": statistics.median(writer_cpu) / calls * 1e3}


def start_of_run(blocks: int, checkpoints: list[int], workdir: Path) -> list[dict]:
    """The first steps with the default budget against bare training, step by step interleaved (bare,
    watched, bare, watched ...) so that the machine's drift weighs on both alike; one run as long as the
    longest checkpoint, the cumulative times read at each."""
    bare = make(blocks)
    watched = make(blocks)
    for _ in range(2):                               # warm the allocator and the kernels of both copies
        one_step(*bare)
    w = probes.watch(watched[0], watched[1], run_dir=workdir / f"default-{blocks}")
    first_seen: dict[str, int] = {}
    t_bare = t_watched = 0.0
    at: dict[int, tuple[float, float]] = {}
    for step in range(max(checkpoints)):
        t_bare += one_step(*bare)
        t_watched += one_step(*watched, w=w)
        if step < 8:
            for f in w.findings():
                first_seen.setdefault(f.code, step)
        if step + 1 in checkpoints:
            at[step + 1] = (t_bare, t_watched)
    import sqlite3
    w._writer.flush()
    con = sqlite3.connect(w.store_path)
    sampled = [r[0] for r in con.execute("SELECT step FROM steps WHERE sampled = 1 ORDER BY step")]
    con.close()
    w.close()
    return [{"blocks": blocks, "steps": n, "bare_ms": b, "watched_ms": t, "overhead": t / b - 1,
             "sampled_steps": [s for s in sampled if s < n], "first_seen": first_seen}
            for n, (b, t) in sorted(at.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="1000,5000", help="comma list of block counts")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved sampled/bare step pairs")
    ap.add_argument("--start", default="200,2000", help="comma list of run lengths for the start-of-run cost")
    ap.add_argument("--start-blocks", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: dict = {"torch": torch.__version__, "threads": args.threads, "per_call": [], "start": []}
    with tempfile.TemporaryDirectory(prefix="modscope-bench-") as d:
        for blocks in (int(b) for b in args.blocks.split(",") if b):
            r = per_call(blocks, args.rounds, Path(d))
            out["per_call"].append(r)
            print(f"{r['blocks']:>5} blocks ({r['modules']:,} modules, {r['calls']:,} calls/forward): bare "
                  f"{r['bare_ms']:.1f} ms, sampled {r['sampled_ms']:.1f} ms -> {r['per_call_us']:.1f} us per call "
                  f"while the previous sample is written, {r['writer_idle_per_call_us']:.1f} us with the writer idle "
                  f"(self-reported {r['self_per_call_us']:.1f} us; the store's writer thread, on another core, "
                  f"{r['writer_cpu_per_call_us']:.1f} us CPU)", flush=True)
        checkpoints = [int(s) for s in args.start.split(",") if s]
        for r in start_of_run(args.start_blocks, checkpoints, Path(d)) if checkpoints else []:
            steps = r["steps"]
            out["start"].append(r)
            print(f"first {steps} steps, {args.start_blocks} blocks, default budget: {r['overhead']:+.1%} over bare "
                  f"(sampled steps {r['sampled_steps']}); findings first seen at steps {r['first_seen']}",
                  flush=True)
    if args.json:
        import json
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
