"""Every statistic a watched training stores, compared with what a git revision's probes store for the same
training: the check that a change to the probes kept the numerics bit-identical.

    python -m bench.stored_stats --against 3429c8d        # 'identical: ...' (exit 0) or the first rows that differ (1)
    python -m bench.stored_stats --dump rows.json         # this tree's rows

Nine small models, each trained 6 steps with every step sampled and fixed seeds, in a real SQLite store: an MLP,
a ResNet-style CNN (BatchNorm, in-place ReLU, in-place residual add), GPT-style (tied weights, dropout), an LSTM,
a model whose output turns NaN/Inf, one with dead ReLU units, one with saturated tanh units, one that calls a
module twice (with a frozen part and a large output), and 40 residual blocks of the many-module benchmark with
a block kept in a plain list. Compared: every row of ``module_stats`` (histograms as stored), ``param_stats`` and
``findings``, and the probe errors. Each side runs in its own process (``--worker``), one after the other.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench import models
from bench.many_modules import ROOT, revision_probes
from bench.many_modules import make as deep

STEPS = 6
TABLES = {
    "module_stats": "SELECT module_id, step, calls, numel, mean, std, absmax, zero_frac, dead_frac, sat_frac, "
                    "nonfinite, out_grad_norm, training, grad_enabled, hex(hist) FROM module_stats "
                    "ORDER BY module_id, step",
    "param_stats": "SELECT * FROM param_stats ORDER BY param_id, step",
    "findings": "SELECT code, path, severity, module_id, message, evidence, first_step, last_step, active, count, "
                "cause_code, cause_path FROM findings ORDER BY code, path",
    "probe_errors": "SELECT location, error_type, count FROM probe_errors ORDER BY location, error_type",
}


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm, self.out = nn.Embedding(50, 16), nn.LSTM(16, 24, num_layers=2, batch_first=True), \
            nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(self.emb(x))[0])


class TurnsNonFinite(nn.Module):
    """From the fourth step on, a log of negative values: NaN, then Inf downstream."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head, self.calls = nn.Linear(16, 16), nn.Linear(16, 3), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc(x)
        return self.head(torch.log(h) if self.calls > 3 else h)


class DeadUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.head = nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
        with torch.no_grad():
            self.fc.bias[:8] = -100.0              # half the units never fire

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


class Saturated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.head = nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        with torch.no_grad():
            self.fc.weight.mul_(40.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


class CalledTwice(nn.Module):
    """One Linear called twice, a tanh, a frozen Linear, and an output of 6,400 values (above batch.SMALL_OUTPUT)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.frozen, self.head = nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3)
        self.wide = nn.Linear(16, 800)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.frozen(self.act(self.fc(self.act(self.fc(x))))))
        return self.head(h) + self.wide(h).mean() * 0.0


Batch = Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def _vectors(width: int, classes: int) -> Batch:
    return lambda g: (torch.randn(8, width, generator=g), torch.randint(0, classes, (8,), generator=g))


def _tokens(vocab: int, classes: int) -> Batch:
    return lambda g: (torch.randint(0, vocab, (4, 16), generator=g), torch.randint(0, classes, (4, 16), generator=g))


def cases() -> Iterator[tuple[str, Callable[[], nn.Module], Batch]]:
    """(name, model factory, batch of inputs and class targets)."""
    yield "mlp", lambda: models.MLP(din=32, hidden=64, depth=3, dout=10), _vectors(32, 10)
    yield "cnn", lambda: models.ResNet(width=8), \
        lambda g: (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))
    yield "gpt", lambda: models.GPT(vocab=64, d=32, layers=2, heads=4, block=16), _tokens(64, 64)
    yield "lstm", Tagger, _tokens(50, 5)
    yield "nonfinite", TurnsNonFinite, _vectors(16, 3)
    yield "dead-units", DeadUnits, _vectors(16, 3)
    yield "saturated", Saturated, _vectors(16, 3)
    yield "called-twice", CalledTwice, _vectors(16, 3)
    yield "deep-40", lambda: deep(40)[0], _vectors(16, 2)


def stored_rows(probes, workdir: Path) -> dict[str, dict[str, list[list[object]]]]:
    """Model name -> table -> its rows (as JSON lists), each model trained STEPS steps, watched at every step."""
    import sqlite3
    out: dict[str, dict[str, list[list[object]]]] = {}
    torch.set_num_threads(1)
    for name, factory, batch in cases():
        torch.manual_seed(0)
        model = factory()
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        with probes.watch(model, opt, run_dir=workdir / name, every=1) as w:
            for _ in range(STEPS):
                x, y = batch(g)
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)
            store = w.store_path
        con = sqlite3.connect(store)
        out[name] = {table: [list(r) for r in con.execute(sql)] for table, sql in TABLES.items()}
        con.close()
    return out


def first_difference(ours: dict, theirs: dict, tables: Sequence[str] = tuple(TABLES)) -> str | None:
    """The first model and table (of ``tables``) whose rows differ, with the first differing row of each side; None
    if none."""
    for name in sorted(set(ours) | set(theirs)):
        if name not in ours or name not in theirs:
            return f"{name}: stored by one side only"
        for table in tables:
            a, b = ours[name].get(table, []), theirs[name].get(table, [])
            if a != b:
                i = next((i for i, (ra, rb) in enumerate(zip(a, b, strict=False)) if ra != rb), min(len(a), len(b)))
                return (f"{name}.{table}: {len(a)} rows against {len(b)}; row {i}: "
                        f"{a[i] if i < len(a) else None} against {b[i] if i < len(b) else None}")
    return None


def _run_worker(probes_path: str, dump: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.stored_stats", "--worker", probes_path, "--dump", str(dump)],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the worker for {probes_path or 'this tree'!r} exited with code {proc.returncode}: "
                         f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no message'}")
    return json.loads(dump.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="compare with the probes of this git revision")
    ap.add_argument("--dump", type=Path, help="write this tree's rows as JSON to this file")
    ap.add_argument("--skip", default="", metavar="TABLES",
                    help=f"comma list of tables not to compare (a planned change of findings: --skip findings); of: "
                         f"{', '.join(TABLES)}")
    ap.add_argument("--worker", help=argparse.SUPPRESS)     # a folder to put first on sys.path ('' for this tree)
    args = ap.parse_args(argv)
    if args.worker is not None:
        if args.worker:
            sys.path.insert(0, args.worker)     # before the first import of probes: the revision's package
        import probes
        with tempfile.TemporaryDirectory(prefix="modscope-stats-") as d:
            rows = stored_rows(probes, Path(d))
        args.dump.write_text(json.dumps(rows, default=repr))
        return 0
    if args.against is None and args.dump is None:
        ap.error("give --against REV, --dump FILE, or both")
    skipped = [t for t in args.skip.split(",") if t]
    unknown = [t for t in skipped if t not in TABLES]
    if unknown:
        ap.error(f"--skip {unknown[0]!r}: not a table; expected some of {', '.join(TABLES)}")
    tables = [t for t in TABLES if t not in skipped]
    with tempfile.TemporaryDirectory(prefix="modscope-stats-") as d:
        work = Path(d)
        ours = _run_worker("", args.dump or work / "this-tree.json")
        if args.against is None:
            rows = sum(len(t["module_stats"]) for t in ours.values())
            print(f"{args.dump}: {rows} module rows of {len(ours)} models")
            return 0
        theirs = _run_worker(str(revision_probes(args.against, work)), work / "revision.json")
    difference = first_difference(ours, theirs, tables)
    counts = {table: sum(len(m[table]) for m in ours.values()) for table in tables}
    if difference is None:
        compared = ", ".join(f"{n} {t} rows" for t, n in counts.items())
        print(f"identical to {args.against}: {len(ours)} models, {compared}"
              + (f" (not compared: {', '.join(skipped)})" if skipped else ""))
        return 0
    print(f"differs from {args.against}: {difference}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
