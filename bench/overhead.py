"""Training-step overhead of modscope vs bare training, an ideal minimal probe, wandb.watch and
TensorBoard histograms. Configurations are interleaved in one process (A B C A B C ...) so the
ratios hold on a noisy machine; each configuration trains its own copy of the model.

    python -m bench.overhead                         # mlp, cnn, gpt; all installed configs
    python -m bench.overhead --models gpt,cnn --rounds 8 --rss
    python -m bench.overhead --device cuda --models hf-gpt2-small --sync-count

Prints median ms/step per configuration and the overhead over bare training (median of paired
per-round ratios; for the default budget, which samples a step now and then, also the ratio of
total times over every step, which counts the sampled steps a median would hide).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

import probes
from bench.models import registry

ALL_CONFIGS = ["bare", "modscope-default", "modscope-every1", "ideal", "wandb", "tensorboard"]
# not run by default: the floor of any exact per-module statistic (FloorProbe), and the floor of the
# statistics every=1 stores (StoredFloorProbe)
EXTRA_CONFIGS = ["floor", "floor-every1"]


class IdealProbe:
    """The reference for the limit: forward hooks on every leaf module computing mean, std,
    zero fraction, abs-max and non-finite count into one preallocated buffer; one host copy
    per step. No tree, no gradients, no store."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.leaves = [m for m in model.modules() if not list(m.children())]
        dev = next(model.parameters()).device
        self.buf = torch.zeros(len(self.leaves) * 4, 5, device=dev)
        self.row = 0
        self.handles = [m.register_forward_hook(self._hook) for m in self.leaves]

    def _hook(self, module, args, out):
        x = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or self.row >= len(self.buf):
            return
        with torch.no_grad():
            # the fastest exact kernels we know (Welford's std_mean is ~60x slower on CPU)
            flat = x.detach().reshape(-1).float()
            n = flat.numel()
            mean = flat.mean()
            sq = torch.dot(flat, flat) / n
            amax, amin = flat.amax(), flat.amin()             # 2x faster than torch.aminmax on CPU
            std = (sq - mean * mean).clamp_min(0).sqrt()
            zero = (flat == 0).sum(dtype=torch.int32) / n    # int32: 1.7x faster than the int64 default
            if flat.device.type == "cpu" and bool(torch.isfinite(sq)):
                nonfinite = torch.zeros(())      # reading a CPU scalar costs no sync
            else:
                nonfinite = (n - torch.isfinite(flat).sum()).float()
            self.buf[self.row] = torch.stack([mean, std, zero, torch.maximum(amax, -amin), nonfinite])
        self.row += 1

    def step(self):
        host = self.buf[:self.row].cpu()          # the one host copy of the step
        self.row = 0
        return host

    def close(self):
        for h in self.handles:
            h.remove()


class FloorProbe:
    """The floor of an exact per-module probe, for reading the figures: forward hooks on every
    leaf doing only the four full passes that exact mean, std, abs-max and per-unit dead
    detection need (sum, sum of squares, per-unit max and min); nothing is kept or copied."""

    def __init__(self, model: torch.nn.Module) -> None:
        leaves = [m for m in model.modules() if not list(m.children())]
        self.handles = [m.register_forward_hook(self._hook) for m in leaves]

    @staticmethod
    def _hook(module, args, out):
        x = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
            return
        xf = x.detach()
        flat = xf.reshape(-1)
        dims = (0, *range(2, xf.dim())) if xf.dim() == 4 else tuple(range(xf.dim() - 1))
        _ = (flat.sum(), torch.dot(flat, flat), xf.amax(dims), xf.amin(dims))

    def step(self):
        return None

    def close(self):
        for h in self.handles:
            h.remove()


class StoredFloorProbe:
    """The floor of what modscope every=1 stores, for reading point 2 of the figures: the exact passes its
    statistics need and nothing else. Forward: FloorProbe's four passes on each distinct float output of
    every module (every=1 keeps a row for every module, leaf or not; an output a wrapper returns unchanged
    is measured once, as every=1 does). Backward: one pass (a dot product) over each such output's
    gradient, for ``out_grad_norm``. After the optimizer step: the norm of every parameter's gradient and
    data (``grad_norm``, ``data_norm``) with torch's fastest exact kernel, ``_foreach_norm``. Left out, so
    that this stays below every=1's true floor: histograms, zero fraction and update norms (strided samples
    of a few thousand values), non-finite counts, gradient-arrival hooks, findings and the store."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        # the outputs measured this step, by (id, version); weakly, as every=1 does: a freed output's id may be
        # the next output's
        self.seen: dict[tuple[int, int], weakref.ref] = {}
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()]

    def _hook(self, module, args, out):
        x = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.numel():
            return
        key = (id(x), x._version)
        seen = self.seen.get(key)
        if seen is not None and seen() is x:
            return
        self.seen[key] = weakref.ref(x)
        xf = x.detach()
        flat = xf.reshape(-1)
        if xf.dim() >= 2:
            dims = (0, *range(2, xf.dim())) if xf.dim() == 4 else tuple(range(xf.dim() - 1))
            _ = (flat.sum(), torch.dot(flat, flat), xf.amax(dims), xf.amin(dims))
        else:
            _ = (flat.sum(), torch.dot(flat, flat))
        if x.requires_grad:
            x.register_hook(self._grad_hook)

    @staticmethod
    def _grad_hook(grad):
        flat = grad.detach().reshape(-1)
        _ = torch.dot(flat, flat)

    def step(self):
        self.seen.clear()
        grads = [p.grad for p in self.params if p.grad is not None]
        _ = (torch._foreach_norm(grads) if grads else None, torch._foreach_norm(self.params))

    def close(self):
        for h in self.handles:
            h.remove()


class Harness:
    def __init__(self, config, factory, batch_fn, loss_fn, device, workdir: Path, compile_backend=None):
        torch.manual_seed(0)
        self.config = config
        self.model = factory().to(device)
        self.model.train()
        # what the training loop calls: the model, or (--compile) the compiled model
        self.called = torch.compile(self.model, backend=compile_backend) if compile_backend else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batch_fn, self.loss_fn, self.device = batch_fn, loss_fn, device
        self.watcher = self.ideal = self.tb = self.wandb_run = None
        run_dir = workdir / config
        if config == "modscope-default":
            self.watcher = probes.watch(self.called, self.opt, run_dir=run_dir)
        elif config == "modscope-every1":
            self.watcher = probes.watch(self.called, self.opt, run_dir=run_dir, every=1)
        elif config == "ideal":
            self.ideal = IdealProbe(self.model)
        elif config == "floor":
            self.ideal = FloorProbe(self.model)
        elif config == "floor-every1":
            self.ideal = StoredFloorProbe(self.model)
        elif config == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir))
        elif config == "wandb":
            import wandb
            os.environ.setdefault("WANDB_SILENT", "true")
            workdir.mkdir(parents=True, exist_ok=True)
            self.wandb_run = wandb.init(mode="offline", dir=str(workdir), project="modscope-bench")
            wandb.watch(self.model, log="all", log_freq=1)     # wandb.watch logs through the global run
        self.n = 0

    def step(self, phases: list | None = None) -> None:
        """One training step; with ``phases``, append (forward, backward, optimizer + probe) ms
        (each phase ends with a device sync then, so use it only for the breakdown)."""
        x, y = self.batch_fn()
        t0 = time.perf_counter()
        out = self.called(x)
        loss = self.loss_fn(out, y)
        if phases is not None:
            sync(self.device)
            t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if phases is not None:
            sync(self.device)
            t2 = time.perf_counter()
        if self.tb is not None:
            for name, p in self.model.named_parameters():
                self.tb.add_histogram(name, p, self.n)
                if p.grad is not None:
                    self.tb.add_histogram(name + ".grad", p.grad, self.n)
        self.opt.step()
        if self.watcher is not None:
            self.watcher.step(loss)
        if self.ideal is not None:
            self.ideal.step()
        if self.wandb_run is not None:
            self.wandb_run.log({"loss": loss.item()})
        self.n += 1
        if phases is not None:
            sync(self.device)
            t3 = time.perf_counter()
            phases.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        if self.ideal is not None:
            self.ideal.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def available(config: str) -> bool:
    if config == "wandb":
        return importlib.util.find_spec("wandb") is not None
    if config == "tensorboard":
        return importlib.util.find_spec("tensorboard") is not None
    return True


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass(frozen=True)
class BenchSettings:
    """How each model is measured: ``rounds`` interleaved rounds of ``steps`` timed steps per configuration,
    after ``warmup`` untimed steps, on ``device``, the runs' files under ``workdir``; ``phases``: one more step
    per block split by phase; ``compile_backend``: torch.compile every configuration's model with it."""
    rounds: int
    steps: int
    warmup: int
    device: str
    workdir: Path
    phases: bool = False
    compile_backend: str | None = None


def bench_model(name: str, configs: list[str], settings: BenchSettings) -> dict[str, Any]:
    rounds, steps, warmup, device = settings.rounds, settings.steps, settings.warmup, settings.device
    phases = settings.phases
    factory, batch_fn, loss_fn = registry(device)[name]
    harnesses = [Harness(c, factory, batch_fn, loss_fn, device, settings.workdir / name, settings.compile_backend)
                 for c in configs]
    times: dict[str, list[float]] = {c: [] for c in configs}
    phase_ms: dict[str, list[tuple[float, float, float]]] = {c: [] for c in configs}
    every_step: dict[str, list[float]] = {c: [] for c in configs}     # the untimed first step of a block too
    per_round: dict[str, list[float]] = {c: [] for c in configs}
    try:
        for h in harnesses:                        # warm-up (allocator, first-step costs)
            for _ in range(warmup):
                h.step()
        order = random.Random(0)
        for _ in range(rounds):
            # interleaved, in a fresh random order each round (A C B, B A C, ...): a config's
            # background work (TensorBoard's writer thread, wandb's process) must not always land
            # on the same neighbour. Each block starts after a pause and one untimed step.
            for h in order.sample(harnesses, len(harnesses)):
                time.sleep(0.05)
                sync(device)
                t0 = time.perf_counter()
                h.step()
                sync(device)
                every_step[h.config].append((time.perf_counter() - t0) * 1e3)
                block = []
                for _ in range(steps):
                    sync(device)
                    t0 = time.perf_counter()
                    h.step()
                    sync(device)
                    block.append((time.perf_counter() - t0) * 1e3)
                times[h.config].extend(block)
                every_step[h.config].extend(block)
                per_round[h.config].append(statistics.median(block))
                if phases:                         # one more step, split by phase (not in the times)
                    h.step(phase_ms[h.config])
        measured = {}
        for h in harnesses:
            if h.watcher is not None:
                measured[h.config] = h.watcher._policy.overhead()
    finally:
        for h in harnesses:
            h.close()
    med = {c: statistics.median(v) for c, v in times.items()}
    # overhead from paired ratios: each round's block against the bare block next to it, so slow
    # drifts of the machine cancel out
    over = {c: statistics.median(a / b for a, b in zip(per_round[c], per_round["bare"], strict=True)) - 1
            for c in configs}
    # a configuration that samples now and then (the default budget) costs on a few steps only: a
    # median hides them, so its overhead is the ratio of total times over every step of the run
    total = {c: sum(every_step[c]) / sum(every_step["bare"]) - 1 for c in configs}
    result = {"median_ms": med, "overhead": over, "overhead_total_time": total,
              "n": {c: len(v) for c, v in times.items()}, "self_reported": measured}
    for floor in ("floor", "floor-every1"):         # point 2 of issue 14: overheads as multiples of a floor's
        if floor in over and over[floor] > 0:
            result[f"x_{floor}"] = {c: over[c] / over[floor] for c in configs if c not in ("bare", floor)}
    if phases:
        result["phases_ms"] = {c: [statistics.median(col) for col in zip(*v, strict=True)]
                               for c, v in phase_ms.items()}
    return result


def child_rss(name: str, config: str, steps: int, device: str) -> None:
    factory, batch_fn, loss_fn = registry(device)[name]
    with tempfile.TemporaryDirectory() as d:
        h = Harness(config, factory, batch_fn, loss_fn, device, Path(d))
        for _ in range(steps):
            h.step()
        h.close()
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve from the parent benchmark process
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"maxrss_mb": hwm_kb / 1024}))


def rss(name: str, config: str, steps: int, device: str) -> float:
    out = subprocess.run([sys.executable, "-m", "bench.overhead", "--child-rss", name, config, str(steps),
                          "--device", device], capture_output=True, text=True, check=True,
                         cwd=str(Path(__file__).resolve().parent.parent))
    return json.loads(out.stdout.strip().splitlines()[-1])["maxrss_mb"]


SYNC_STEPS = 6      # sampled steps over which --sync-count counts


def count_syncs(name: str, device: str, workdir: Path) -> dict[str, float]:
    """Host syncs of modscope's sampled steps (CUDA only), per sampled step, over SYNC_STEPS steps at every=1 against
    as many bare steps: ``implicit``, those the sync debug mode reports (an ``.item()``, a blocking copy... in a hook
    or at a step's end: the design has none), and ``copy_reads``/``copy_waits``, the reads of a sampled step's one
    host copy and how many of them had to wait for it (an event not complete yet: the design's one sync at most)."""
    factory, batch_fn, loss_fn = registry(device)[name]
    h = Harness("bare", factory, batch_fn, loss_fn, device, workdir)
    try:
        for _ in range(2):
            h.step()
        bare = _syncs_of(h.step, SYNC_STEPS)
        h.watcher = probes.watch(h.model, h.opt, run_dir=workdir / "sync", every=1)
        h.step()                          # the first sampled step: the hooks' one-off work
        watched = _syncs_of(h.step, SYNC_STEPS)
    finally:
        h.close()
    return {"implicit": (watched["implicit"] - bare["implicit"]) / SYNC_STEPS,
            "copy_reads": watched["copy_reads"] / SYNC_STEPS, "copy_waits": watched["copy_waits"] / SYNC_STEPS}


def _syncs_of(step, steps: int) -> dict[str, int]:
    """What ``steps`` calls of ``step`` sync: implicit syncs (torch.cuda.set_sync_debug_mode's warnings), and the
    CUDA events waited on (torch.cuda.Event.synchronize: modscope's reads of a host copy), those not complete."""
    counts = {"copy_reads": 0, "copy_waits": 0}
    event_sync = torch.cuda.Event.synchronize

    def counted(event) -> None:
        counts["copy_reads"] += 1
        counts["copy_waits"] += not event.query()
        event_sync(event)
    torch.cuda.synchronize()
    torch.cuda.Event.synchronize = counted
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        torch.cuda.Event.synchronize = event_sync
    return {**counts, "implicit": sum(1 for c in caught if "synchroniz" in str(c.message))}


def floor_ratio(overhead: float, floor_overhead: float, floor: str) -> str:
    """An overhead as a multiple of a floor's, for the printed table (a short run can measure a floor at or below
    bare: no multiple of that means anything)."""
    if floor_overhead > 0:
        return f"  {overhead / floor_overhead:5.2f}x {floor}'s overhead"
    return f"  ({floor}'s overhead {floor_overhead:+.2%}: no multiple)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,cnn,gpt", help="comma list of: mlp, cnn, gpt, hf-gpt2, hf-gpt2-small")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS),
                    help=f"comma list of: {', '.join(ALL_CONFIGS + EXTRA_CONFIGS)} (default: all but the floors)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=2, help="steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=10,
                    help="untimed steps first (>= 8: the default budget samples the first 8 steps)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--rss", action="store_true", help="also peak RSS of bare vs modscope every=1 (subprocesses)")
    ap.add_argument("--sync-count", action="store_true", help="count host syncs per sampled step (CUDA)")
    ap.add_argument("--phases", action="store_true",
                    help="also split one extra step per block into forward / backward / optimizer + probe")
    ap.add_argument("--compile", metavar="BACKEND", default=None,
                    help="torch.compile every configuration's model with this backend (e.g. inductor, eager); "
                         "modscope watches the compiled model (its sampled steps run eagerly)")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--child-rss", nargs=3, metavar=("MODEL", "CONFIG", "STEPS"), help=argparse.SUPPRESS)
    return ap


class ConfigChoice(NamedTuple):
    run: list[str]          # the configurations measured, bare always among them (first unless named)
    skipped: list[str]      # those asked for whose package is not installed


def choose_configs(ap: argparse.ArgumentParser, names: str) -> ConfigChoice:
    configs = [c for c in names.split(",") if c]
    unknown = [c for c in configs if c not in ALL_CONFIGS + EXTRA_CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; expected some of {ALL_CONFIGS + EXTRA_CONFIGS}")
    skipped = [c for c in configs if not available(c)]
    configs = [c for c in configs if available(c)]
    if "bare" not in configs:
        configs.insert(0, "bare")
    return ConfigChoice(configs, skipped)


def comparisons(c: str, r: dict[str, Any]) -> str:
    """What follows configuration ``c``'s overhead in the table: its multiples of the reference probes'
    overheads and of wandb's, the default budget's total-time ratio, and what modscope reported itself."""
    ov = r["overhead"]
    over = ov[c]
    extra = ""
    if c.startswith("modscope") and "ideal" in ov and ov["ideal"] > 0:
        extra += f"  {over / ov['ideal']:5.2f}x ideal's overhead"
    if c != "floor" and "floor" in ov and c not in ("bare", "modscope-default"):
        extra += floor_ratio(over, ov["floor"], "floor")
    if c == "modscope-every1" and "floor-every1" in ov:
        extra += floor_ratio(over, ov["floor-every1"], "floor-every1")
    if c.startswith("modscope") and "wandb" in ov and over > 0:
        extra += f"  {ov['wandb'] / over:6.1f}x less than wandb"
    if c == "modscope-default":
        extra += f"  total-time ratio {r['overhead_total_time'][c]:+.2%}"
    if c in r["self_reported"] and r["self_reported"][c] is not None:
        extra += f"  (self-reported {r['self_reported'][c]:.2%})"
    return extra


def print_overheads(name: str, configs: list[str], r: dict[str, Any]) -> None:
    med, ov = r["median_ms"], r["overhead"]
    print(f"\n{name}: median ms/step, overhead vs bare (median of paired per-round ratios)")
    for c in configs:
        print(f"  {c:18s} {med[c]:9.2f} ms  {ov[c]:+8.2%}{comparisons(c, r)}")


def print_phases(configs: list[str], r: dict[str, Any]) -> None:
    base = r["phases_ms"]["bare"]
    print("  by phase, median ms (+ over bare): forward | backward | optimizer step + probe")
    for c in configs:
        f = r["phases_ms"][c]
        cells = (f"{v:7.1f} ({v - b:+6.1f})" for v, b in zip(f, base, strict=True))
        print(f"  {c:18s} " + " | ".join(cells))


def measure_rss(name: str, args: argparse.Namespace, r: dict[str, Any]) -> None:
    steps = max(20, args.steps * 2)
    rb = rss(name, "bare", steps, args.device)
    rm = rss(name, "modscope-every1", steps, args.device)
    r["rss_mb"] = {"bare": rb, "modscope-every1": rm}
    print(f"  peak RSS: bare {rb:.0f} MB, modscope every=1 {rm:.0f} MB ({rm - rb:+.0f} MB)")


def measure_syncs(name: str, args: argparse.Namespace, workdir: Path, r: dict[str, Any]) -> None:
    syncs = r["syncs_per_sampled_step"] = count_syncs(name, args.device, workdir)
    print(f"  host syncs per sampled step (every=1, {SYNC_STEPS} steps): {syncs['implicit']:.2f} implicit "
          f"(sync debug mode, against bare), {syncs['copy_reads']:.2f} reads of the host copy, "
          f"{syncs['copy_waits']:.2f} of which waited for it")


def run_model(name: str, configs: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Every measure of one model, printed as it comes; the results for the JSON."""
    settings = BenchSettings(rounds=args.rounds, steps=args.steps, warmup=args.warmup, device=args.device,
                             workdir=workdir, phases=args.phases, compile_backend=args.compile)
    r = bench_model(name, configs, settings)
    print_overheads(name, configs, r)
    if args.phases:
        print_phases(configs, r)
    if args.rss:
        measure_rss(name, args, r)
    if args.sync_count and args.device.startswith("cuda"):
        measure_syncs(name, args, workdir, r)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_rss:
        child_rss(args.child_rss[0], args.child_rss[1], int(args.child_rss[2]), args.device)
        return 0
    configs, skipped = choose_configs(ap, args.configs)
    models = [m for m in args.models.split(",") if m]
    print(f"torch {torch.__version__}  device={args.device}  threads={torch.get_num_threads()}  "
          + (f"compiled ({args.compile})  " if args.compile else "") +
          f"rounds={args.rounds} x steps={args.steps} (interleaved)" +
          (f"  skipped (not installed): {skipped}" if skipped else ""))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            results[name] = run_model(name, configs, args, Path(tmp))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
