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

``--against REV`` measures the per-call cost of this tree and of the ``probes`` of a git revision side by side:
two worker processes, one per version, take turns round by round, so that the machine's drift weighs on both
alike and the ratio between them holds on a machine faster or slower than the one a target was set on.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


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


class PerCallRun:
    """A bare model and a watched copy (every=1), warmed; :meth:`round` times one round of the per-call
    measurement, :meth:`result` sums them up. ``probes``: the package measured (this tree's or a revision's)."""

    def __init__(self, probes, blocks: int, workdir: Path) -> None:
        self.blocks = blocks
        self.bare = make(blocks)
        self.watched = make(blocks)
        self.w = probes.watch(self.watched[0], self.watched[1], run_dir=workdir / f"every1-{blocks}", every=1)
        self.calls = module_calls(self.bare[0], self.bare[2])
        self.t_bare: list[float] = []
        self.t_alone: list[float] = []
        self.t_watched: list[float] = []
        self.writer_cpu: list[float] = []
        for _ in range(8):  # warm both: with 3, the first model of a run measured 1.3-1.5x slow (allocator, caches)
            one_step(*self.bare)
            one_step(*self.watched, w=self.w)

    def round(self) -> None:
        # the store's writer thread writes a sample while training goes on: its work must weigh on the next
        # watched step, as in a real run, not on a bare one. So: the writer idle, a bare step; a watched step
        # (the writer still idle: the probe's own cost), whose writes overlap the watched step after it
        w = self.w
        w._writer.flush()
        self.t_bare.append(one_step(*self.bare))
        self.t_alone.append(one_step(*self.watched, w=w))
        cpu0, main0 = time.process_time(), time.thread_time()
        self.t_watched.append(one_step(*self.watched, w=w))
        w._writer.flush()
        self.writer_cpu.append(((time.process_time() - cpu0) - (time.thread_time() - main0)) * 1e3)

    def result(self) -> dict:
        w = self.w
        w._writer.flush()
        con = sqlite3.connect(w.store_path)
        probe = [r[0] for r in con.execute("SELECT probe_ms FROM steps WHERE step >= 8 AND probe_ms IS NOT NULL")]
        con.close()
        w.close()
        calls = self.calls
        extra = statistics.median(self.t_watched) - statistics.median(self.t_bare)
        alone = statistics.median(self.t_alone) - statistics.median(self.t_bare)
        return {"blocks": self.blocks, "modules": sum(1 for _ in self.bare[0].modules()) + 3, "calls": calls,
                "bare_ms": statistics.median(self.t_bare), "sampled_ms": statistics.median(self.t_watched),
                "per_call_us": extra / calls * 1e3, "writer_idle_per_call_us": alone / calls * 1e3,
                "self_per_call_us": statistics.median(probe) / calls * 1e3 if probe else None,
                "writer_cpu_per_call_us": statistics.median(self.writer_cpu) / calls * 1e3}


def per_call(blocks: int, rounds: int, workdir: Path) -> dict:
    run = PerCallRun(importlib.import_module("probes"), blocks, workdir)
    for _ in range(rounds):
        run.round()
    return run.result()


def revision_probes(rev: str, into: Path) -> Path:
    """The ``probes`` package of git revision ``rev``, unpacked under ``into``; returns the folder to put
    first on sys.path. A clear error when ``rev`` is not a revision of this repository."""
    proc = subprocess.run(["git", "archive", "--format=tar", rev, "probes"], check=False, cwd=ROOT,
                          capture_output=True)
    if proc.returncode != 0:
        reason = proc.stderr.decode(errors="replace").strip().splitlines()
        raise SystemExit(f"--against {rev!r}: not a git revision with a probes/ folder in {ROOT} "
                         f"({reason[-1] if reason else 'git archive failed'})")
    target = into / "against"
    target.mkdir(parents=True)
    tar = into / "probes.tar"
    tar.write_bytes(proc.stdout)
    with tarfile.open(tar) as archive:
        if hasattr(tarfile, "data_filter"):     # Python >= 3.11.4: no links or paths out of the folder
            archive.extractall(target, filter="data")
        else:
            archive.extractall(target)
    return target


def side_by_side(rev: str, blocks: int, rounds: int, threads: int, workdir: Path) -> dict:
    """Per-call cost of this tree and of revision ``rev``, measured by two worker processes that take turns,
    round by round (only one of them runs at a time)."""
    against = revision_probes(rev, workdir)
    workers = {}
    try:
        for name, path in (("this tree", ""), (rev, str(against))):
            workers[name] = subprocess.Popen(
                [sys.executable, "-m", "bench.many_modules", "--worker", path, "--blocks", str(blocks),
                 "--threads", str(threads)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            _ask(workers[name], "ready")             # built and warmed one after the other, not at once
        for _ in range(rounds):
            for proc in workers.values():
                _ask(proc, "round")
        results = {name: json.loads(_ask(proc, "result")) for name, proc in workers.items()}
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return {"blocks": blocks, "against": rev, "this_tree": results["this tree"], "revision": results[rev]}


def _ask(proc: subprocess.Popen, command: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the benchmark worker exited with code {proc.wait()} (its error is above)")
    return line.strip()


def worker(probes_path: str, blocks: int) -> int:
    """One side of :func:`side_by_side`: answers 'ready', 'round' and 'result' on stdin, one line each."""
    if probes_path:
        sys.path.insert(0, probes_path)      # before the first import of probes: the revision's package
    probes = importlib.import_module("probes")
    with tempfile.TemporaryDirectory(prefix="modscope-bench-") as d:
        run = None
        for command in sys.stdin:
            command = command.strip()
            if command == "ready":
                run = PerCallRun(probes, blocks, Path(d))
                print("ready", flush=True)
            elif command == "round" and run is not None:
                run.round()
                print("done", flush=True)
            elif command == "result" and run is not None:
                print(json.dumps(run.result()), flush=True)
                return 0
            else:
                print(f"unexpected command {command!r}: expected ready, round or result", file=sys.stderr)
                return 2
    return 0


def start_of_run(blocks: int, checkpoints: list[int], workdir: Path) -> list[dict]:
    """The first steps with the default budget against bare training, step by step interleaved (bare,
    watched, bare, watched ...) so that the machine's drift weighs on both alike; one run as long as the
    longest checkpoint, the cumulative times read at each."""
    bare = make(blocks)
    watched = make(blocks)
    for _ in range(2):                               # warm the allocator and the kernels of both copies
        one_step(*bare)
    w = importlib.import_module("probes").watch(watched[0], watched[1], run_dir=workdir / f"default-{blocks}")
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
    ap.add_argument("--against", metavar="REV",
                    help="also measure the per-call cost of the probes of git revision REV, side by side")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)    # one side of --against (a path, or '' for this tree)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker is not None:
        return worker(args.worker, int(args.blocks))
    out: dict = {"torch": torch.__version__, "threads": args.threads, "per_call": [], "start": []}
    with tempfile.TemporaryDirectory(prefix="modscope-bench-") as d:
        for blocks in (int(b) for b in args.blocks.split(",") if b):
            if args.against:
                pair = side_by_side(args.against, blocks, args.rounds, args.threads, Path(d) / str(blocks))
                out.setdefault("against", []).append(pair)
                mine, theirs = pair["this_tree"], pair["revision"]
                print(f"{blocks:>5} blocks, side by side: per call while the previous sample is written, this tree "
                      f"{mine['per_call_us']:.1f} us, {args.against} {theirs['per_call_us']:.1f} us "
                      f"({theirs['per_call_us'] / mine['per_call_us']:.1f}x less); with the writer idle "
                      f"{mine['writer_idle_per_call_us']:.1f} us against {theirs['writer_idle_per_call_us']:.1f} us "
                      f"({theirs['writer_idle_per_call_us'] / mine['writer_idle_per_call_us']:.1f}x less); bare step "
                      f"{mine['bare_ms']:.1f} / {theirs['bare_ms']:.1f} ms", flush=True)
                continue
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
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
