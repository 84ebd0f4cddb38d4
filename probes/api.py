"""``probes.watch``: argument checks up front, then a :class:`~probes.watcher.Watcher`."""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .findings.finding import Finding, sort_findings
from .findings.structural import structural_findings
from .limits import check_dense, check_every, check_overhead, check_run_name, check_window
from .model.structure import build_structure, normalize_optimizers, unwrap
from .notebook import ipython_shell
from .store.rundir import agree_run_id
from .watcher import Boundaries, Watcher, WatchSettings

# the open watcher of each model (the user's module, inside any wrapper), weakly: a model is watched by one
# watcher at a time. Re-running a notebook cell that calls watch() must not leave the first watcher's hooks on
# the model, doubling the cost and writing two runs of one training.
_WATCHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Watcher]] = weakref.WeakKeyDictionary()
# the watcher a notebook cell's top-level code opened, by the cell's code position, with the cell's execution
# count: a cell run again that builds a new model (the model's cell run again too, "Run All") watches another
# model, and the watcher it opened before, on a model nobody trains any more, would stay open (its thread, its
# store "running") until the kernel exits
_CELL_WATCHERS: dict[tuple[str, int], tuple[weakref.ref[Watcher], object]] = {}


# the public entry point: its options are keyword-only, each checked below, and gathered into WatchSettings
def watch(model: nn.Module, optimizer: Any = None, *, run_dir: str | os.PathLike[str] | None = None,  # noqa: PLR0913
          every: int | None = None, overhead: float = 0.01, window: int = 16,
          run_name: str | None = None, boundaries: str = "optimizer", dense: bool | int = True) -> Watcher:
    """Watch ``model`` (and its optimizer or list of optimizers) and stream statistics to a store.

    Args:
        model: the ``nn.Module`` whose forward you call.
        optimizer: ``None``, an optimizer, or a list of them (GAN). Steps end at ``optimizer.step()``;
            without one, call ``w.step()`` once per step.
        run_dir: the run directory; default ``./runs/<run id>``. Every ``watch()`` is a run of its own, with
            its own store in the directory (``modscope-<run id>-rank<R>.sqlite``): earlier runs stay apart.
        every: sample every N-th step (1 to 1,000,000). ``None`` (default) chooses the interval from the measured
            cost so that the average overhead stays under ``overhead``.
        overhead: overhead budget as a fraction of step time, in (0, 1] (default 0.01 = 1%).
        window: sampled steps in the window of the dead-unit/constant-output detectors (1 to 256).
        run_name: a name shown in the dashboard (default: the run directory's name), printable, at most 200
            characters.
        boundaries: ``"optimizer"`` (default): steps end at the watched optimizers' ``step()``.
            ``"external"``: a framework integration calls ``begin_optimizer_step()`` and ``end_step()``.
        dense: the dense tier (every tensor's gradient and weight norm on steps between full samples). ``True``
            (default): its interval is chosen within the budget (with ``every``: every step); ``False``: off;
            ``N``: every N-th step.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__qualname__}: {model!r:.80}")
    if isinstance(unwrap(model), torch.jit.ScriptModule):
        raise TypeError(f"model is a TorchScript module ({type(model).__qualname__}): PyTorch runs no hooks on it; "
                        "watch the nn.Module before torch.jit.script (a scripted submodule is fine)")
    optimizers = normalize_optimizers(optimizer)
    check_every(every)
    if every is None:
        check_overhead(overhead)
    check_window(window)
    check_dense(dense)
    if boundaries not in tuple(Boundaries):
        raise ValueError(f"boundaries must be one of {[str(b) for b in Boundaries]}, got {boundaries!r:.80}")
    check_run_name(run_name)
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir must be a str, os.PathLike or None, got {type(run_dir).__qualname__}: "
                        f"{run_dir!r:.80}")
    rank, world_size = process_rank()
    run_id = agree_run_id(rank, world_size)
    run_dir = Path("runs") / run_id if run_dir is None else Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run_dir {str(run_dir)!r} exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"run_dir {str(run_dir)!r} cannot be created: {exc.strerror}") from None
    if not os.access(run_dir, os.W_OK):
        raise ValueError(f"run_dir {str(run_dir)!r} is not writable")
    close_previous_watcher(model)
    site = _notebook_cell_site()
    if site is not None:
        close_cell_watcher(*site)
    watcher = Watcher(model, optimizers, run_dir, WatchSettings(
        run_id=run_id, run_name=run_name or run_dir.name, every=every, overhead=None if every else float(overhead),
        window=window, rank=rank, world_size=world_size, boundaries=Boundaries(boundaries), dense=dense))
    _WATCHED[unwrap(model)] = weakref.ref(watcher)
    if site is not None:
        _CELL_WATCHERS[site[0]] = (weakref.ref(watcher), site[1])
    return watcher


def _notebook_cell_site() -> tuple[tuple[str, int], object] | None:
    """((file, line), execution count) of a watch() called by the top-level code of an IPython cell (or of a
    script IPython's %run runs); None elsewhere."""
    shell = ipython_shell()
    if shell is None:
        return None
    try:
        frame = sys._getframe(2)                      # watch()'s caller
        if frame.f_code.co_name != "<module>":       # inside a function: called as often as the code wants
            return None
        return (frame.f_code.co_filename, frame.f_lineno), shell.execution_count
    except Exception:
        return None


def close_cell_watcher(position: tuple[str, int], execution_count: object) -> None:
    """Close the watcher the same cell code opened in an earlier run of the cell, with a warning naming its run."""
    entry = _CELL_WATCHERS.pop(position, None)
    if entry is None:
        return
    previous = entry[0]()
    if previous is None or previous.closed:
        return
    if entry[1] == execution_count:                   # the same run of the cell: a loop watching several models
        _CELL_WATCHERS[position] = entry
        return
    previous.close()               # before the warning, which -W error turns into an exception
    warnings.warn(f"modscope: this cell ran probes.watch() again: the watcher it opened before (run "
                  f"{previous.run_id!r}, {previous.store_path}) is now closed (close a watcher with w.close() or "
                  "`with probes.watch(...)`)", stacklevel=3)


def watcher_of(model: nn.Module) -> Watcher | None:
    """The open watcher of ``model`` (or of the module it wraps), if any."""
    ref = _WATCHED.get(unwrap(model))
    watcher = ref() if ref is not None else None
    return None if watcher is None or watcher.closed else watcher


def close_previous_watcher(model: nn.Module) -> None:
    """Close the open watcher of ``model`` (or of the module it wraps), with a warning that names its run."""
    previous = watcher_of(model)
    _WATCHED.pop(unwrap(model), None)
    if previous is None:
        return
    previous.close()               # before the warning, which -W error turns into an exception
    warnings.warn(f"modscope: {type(unwrap(model)).__name__} was already watched by run {previous.run_id!r} "
                  f"({previous.store_path}); that watcher is now closed, since a model is watched by one watcher "
                  "at a time (close a watcher with w.close() or `with probes.watch(...)`)", stacklevel=3)


def begin_optimizer_step(optimizer: Any) -> None:
    """Say that the gradients of ``optimizer`` are final for this step: call it after backward (and after any
    unscaling and clipping) where modscope cannot see that moment itself, typically inside a closure given to
    ``optimizer.step(closure)`` (LBFGS) under a framework that owns the step. Every open watcher of ``optimizer``
    reads the step's gradients there; only the first call of a step counts (LBFGS evaluates its closure several
    times per step, the first before any update), and a step that is not sampled costs one lookup.
    ``optimizer``: a torch optimizer, or a framework's wrapper of one (Lightning's ``LightningOptimizer``,
    accelerate's ``AcceleratedOptimizer``)."""
    candidates = _optimizer_and_inner(optimizer)
    if not any(isinstance(o, torch.optim.Optimizer) for o in candidates):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a framework's wrapper of one), got "
                        f"{type(optimizer).__qualname__}: {optimizer!r:.80}")
    watchers = [w for ref in list(_WATCHED.values()) if (w := ref()) is not None and not w.closed]
    for opt in candidates:
        told = False
        for w in watchers:
            try:
                w.begin_optimizer_step(opt)
                told = True
            except ValueError:            # not one of its optimizers
                continue
        if told:
            return


def _optimizer_and_inner(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it wraps (``_optimizer``: Lightning's; ``optimizer``: accelerate's)."""
    out = [optimizer]
    for _ in range(4):
        inner = getattr(out[-1], "_optimizer", None) or getattr(out[-1], "optimizer", None)
        if inner is None or any(inner is o for o in out):
            break
        out.append(inner)
    return out


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's when initialised, else torchrun's environment."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:       # a broken distributed setup must not stop training
        pass
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def audit(model: nn.Module, optimizer: Any = None) -> list[Finding]:
    """Static structural audit of ``model`` (no forward pass): unregistered modules and tensors,
    optimizer membership, stale optimizer entries, frozen and shared parameters."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__qualname__}: {model!r:.80}")
    optimizers = normalize_optimizers(optimizer)
    return sort_findings(structural_findings(build_structure(model, optimizers)))
