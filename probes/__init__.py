"""modscope probes: live per-module statistics, structural audit and findings for PyTorch.

    import probes
    with probes.watch(model, optimizer) as w:      # run_dir defaults to ./runs/<time>
        for x, y in data:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
            w.step(loss)                           # optional: records the loss
    print(w.findings())

Then ``python app.py --run runs/<time>`` shows it in the dashboard.
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

from torch import nn

from .audit import audit
from .findings import CODES, Finding
from .schema import SCHEMA_VERSION, STORE_FILENAME
from .structure import normalize_optimizers
from .watcher import Watcher

__all__ = ["watch", "audit", "Watcher", "Finding", "CODES", "SCHEMA_VERSION", "STORE_FILENAME", "__version__"]
__version__ = "0.1.0"


def watch(model: nn.Module, optimizer: Any = None, *, run_dir: str | os.PathLike | None = None,
          every: int | None = None, overhead: float = 0.01, window: int = 16,
          run_name: str | None = None) -> Watcher:
    """Watch ``model`` (and its optimizer or list of optimizers) and stream statistics to a store.

    Args:
        model: the ``nn.Module`` whose forward you call.
        optimizer: ``None``, an optimizer, or a list of them (GAN). Steps end at
            ``optimizer.step()``; without one, call ``w.step()`` once per step.
        run_dir: directory for the store (``modscope.sqlite``); default ``./runs/<time>``.
        every: sample every N-th step. ``None`` (default) chooses the interval from the measured
            cost so that the average overhead stays under ``overhead``.
        overhead: overhead budget as a fraction of step time (default 0.01 = 1%).
        window: sampled steps in the window of the dead-unit/constant-output detectors.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__qualname__}: {model!r:.80}")
    optimizers = normalize_optimizers(optimizer)
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"every must be a positive int or None, got {every!r}")
    if every is None:
        if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0 < overhead <= 1:
            raise ValueError(f"overhead must be a fraction in (0, 1], got {overhead!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    rank, world_size = _rank()
    if run_dir is None:
        stamp = os.environ.get("TORCHELASTIC_RUN_ID") if world_size > 1 else None
        stamp = stamp or datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        run_dir = Path("runs") / stamp
    elif not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir must be a str, os.PathLike or None, got {type(run_dir).__qualname__}: {run_dir!r:.80}")
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run_dir {str(run_dir)!r} exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"run_dir {str(run_dir)!r} cannot be created: {exc.strerror}") from None
    if not os.access(run_dir, os.W_OK):
        raise ValueError(f"run_dir {str(run_dir)!r} is not writable")
    return Watcher(model, optimizers, run_dir, every=every, overhead=None if every else float(overhead),
                   window=window, rank=rank, world_size=world_size,
                   run_name=run_name or run_dir.name)


def _rank() -> tuple[int, int]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:       # a broken distributed setup must not stop training
        pass
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1
