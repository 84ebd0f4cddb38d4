"""Host synchronisations per training step on CUDA, with modscope's dense tier on and off (needs a CUDA device).

    python -m bench.gpu_dense_sync                        # gpt, cnn, tanh-mlp; 40 counted steps each
    python -m bench.gpu_dense_sync --models hf-gpt2-small --steps 100

Each configuration trains its own copy of the model: bare; watched with full samples at step 0 only
(``every=10**6``) and the dense tier off (``dense=False``); the same with the dense tier on every step
(``dense=1``). After a few warm-up steps (the full sample at step 0 and its deferred read), it counts over
``--steps`` steps: the implicit syncs torch's sync debug mode reports (``torch.cuda.set_sync_debug_mode("warn")``,
each warning counted: an ``.item()``, a blocking copy...), and the reads of a host copy (CUDA events waited on)
and how many of those had to wait. The dense tier's design: no implicit sync at all; its values are copied
non-blocking, every 64 dense steps (or 2 s) and read once the copy has landed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

import probes
from bench.models import registry
from bench.overhead import _syncs_of

WARMUP = 5


def count(name: str, dense: bool | int | None, steps: int, workdir: Path) -> dict[str, float]:
    """Syncs per step of one configuration (``dense`` None: bare)."""
    factory, batch_fn, loss_fn = registry("cuda")[name]
    torch.manual_seed(0)
    model = factory().to("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = None if dense is None else probes.watch(model, opt, run_dir=workdir, every=10 ** 6, dense=dense)

    def step() -> None:
        x, y = batch_fn()
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if watcher is not None:
            watcher.step(loss)
    try:
        for _ in range(WARMUP):
            step()
        counted = _syncs_of(step, steps)
    finally:
        if watcher is not None:
            watcher.close()
    return {k: v / steps for k, v in counted.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,cnn,tanh-mlp", help="comma list of bench.models' registry names")
    ap.add_argument("--steps", type=int, default=40, help="steps counted per configuration")
    ap.add_argument("--json", help="write the counts as JSON to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_dense_sync needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    known = registry("cuda")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in known]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; expected some of {sorted(known)}")
    print(f"torch {torch.__version__}  {torch.cuda.get_device_name()}  {args.steps} steps counted per configuration")
    print(f"{'model':14s} {'configuration':22s} {'implicit syncs/step':>20s} {'copy reads/step':>16s} "
          f"{'of which waited':>16s}")
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            results[name] = {}
            for label, dense in (("bare", None), ("watched, dense off", False), ("watched, dense on", 1)):
                c = results[name][label] = count(name, dense, args.steps, Path(tmp) / name / label.replace(" ", ""))
                print(f"{name:14s} {label:22s} {c['implicit']:20.2f} {c['copy_reads']:16.2f} {c['copy_waits']:16.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
