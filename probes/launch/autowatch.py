"""Zero-code watching: find what a script trains and watch it, without an edit to the script.

:func:`install` is called by :mod:`probes.launch.autorun` (``modscope run``) in the process it starts,
and only there: nothing installs it through ``sitecustomize`` or ``PYTHONPATH``, so a child
process (DataLoader workers, spawned or forked, ``multiprocessing``, ``subprocess``) is never
instrumented.

How the model is found:

1. From the start, two global module hooks (a forward pre-hook and an always-called forward
   hook) keep a depth counter and remember the modules called at the top level (no other module
   of theirs running): the model's forward, and anything else a script calls directly.
2. PyTorch's global optimizer step post-hook sees every optimizer step. At the first step of
   the run the module hooks are removed: with a global module hook, no module takes PyTorch's
   no-hook fast path, so they live only until the forward that precedes the first step has run
   (or ``MAX_TRACKED_CALLS`` top-level calls, when no optimizer steps that soon).
3. At an optimizer's second step, its model is the outermost top-level module whose registered
   parameters hold (by identity) the most of the optimizer's parameters; when no top-level module
   holds all of them (a model built after the first step, or an optimizer spanning two top-level
   modules) one scan of ``gc.get_objects()`` finds the outermost module holding all of them. The
   optimizers that stepped since its first step and hold parameters of that model are watched
   with it (Muon + AdamW on one model: one watcher; a GAN's two models with their own optimizers:
   two watchers), by :func:`probes.watch` into the one run directory (a run each).

4. When the adopting step runs inside a Lightning or Hugging Face ``Trainer`` (one is on the call
   stack, stepping that optimizer), that Trainer gets modscope's callback instead
   (:mod:`probes.integrations.zero_code`): the framework says when gradients are final and when a
   step ends, as with the callback passed by hand, and the callback starts at the next batch.

Watching therefore starts at an optimizer's third step: the first tells that it exists, the
second which optimizers step together. An optimizer that stepped only once is watched at exit
(its structure and structural findings are stored). Nothing raised here reaches the script:
a failure is printed once, as one line on stderr, and the script goes on unwatched.
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from ..api import process_rank, watch, watcher_of
from ..capture.eager import hide_global_hook_warning, restore_warning_filters
from ..limits import check_every, check_overhead
from ..model.structure import unwrap
from ..schema import printable
from ..watcher import Watcher
from .backward_loss import BackwardLosses

__all__ = ["AutoWatch", "install"]

_in_fork_child = False          # set in every process forked from one that imported this module
# Top-level module calls after which the forward tracking stops even if no optimizer stepped yet (a
# long evaluation first, an inference-only script, an optimizer that is no torch.optim.Optimizer):
# the modules seen so far stay candidates, and the fast path comes back.
MAX_TRACKED_CALLS = 100


def _mark_fork_child() -> None:
    global _in_fork_child
    _in_fork_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_fork_child)


def _elsewhere() -> bool:
    """True in a process the bootstrap did not start in: a forked child (a DataLoader worker with the
    fork start method inherits the hooks) or a DataLoader worker of any kind."""
    if _in_fork_child:
        return True
    try:
        return torch.utils.data.get_worker_info() is not None
    except Exception:
        return False


def _optimizer_params(opt: Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group.get("params", ()) if isinstance(p, torch.Tensor)]


def _coverage(module: nn.Module, wanted: set[int]) -> int:
    """How many of the tensors ``wanted`` (by id) the module's registered parameters hold."""
    return sum(1 for p in module.parameters() if id(p) in wanted)


def _outermost(modules: Iterable[nn.Module]) -> nn.Module | None:
    """The module that contains the most modules (among nested candidates: the outermost)."""
    best, size = None, -1
    for m in modules:
        n = sum(1 for _ in m.modules())
        if n > size:
            best, size = m, n
    return best


class AutoWatch:
    """The discovery hooks and the watchers they started. Made by :func:`install`; :meth:`close`
    removes every hook and closes the watchers (idempotent)."""

    def __init__(self, run_dir: str | os.PathLike[str], *, every: int | None = None, overhead: float = 0.01,
                 out: TextIO | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.every = every
        self.overhead = overhead
        self.watchers: list[Watcher] = []
        self.frameworks: list[Any] = []      # framework callbacks added to a Trainer (integrations.zero_code)
        self._names: dict[int, str] = {}     # id(watcher) -> its model's class name
        self.discovery_s = 0.0               # time spent finding models at optimizer steps
        self.tracking_s = 0.0                # wall time the global module hooks were installed
        self.top_level_calls = 0             # top-level module calls seen while they were
        self._out = out
        self._lock = threading.RLock()
        self._local = threading.local()      # the module call depth, per thread
        self._top: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._pending: dict[int, tuple[weakref.ref[Optimizer], int]] = {}    # id(opt) -> (ref, order)
        self._order = itertools.count()
        self._done: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._left: dict[str, str] = {}          # run dir -> model class: models the script watches itself
        self._module_handles: list[RemovableHandle] = []
        self._warning_filter: Any = None
        self._opt_handle: RemovableHandle | None = None
        self._tracking_since = 0.0
        self._noted: set[str] = set()
        self._closed = False
        # the loss of each step: what backward() ran on (the script never hands it to modscope)
        self._losses = BackwardLosses()
        self._loss_optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()   # those of watchers taking it

    # ----------------------------------------------------------------------------- lifecycle
    def start(self) -> AutoWatch:
        self._module_handles = [
            register_module_forward_pre_hook(self._on_forward_pre),
            register_module_forward_hook(self._on_forward, always_call=True),
        ]
        self._warning_filter = hide_global_hook_warning()      # torch.compile wrappers warn about these hooks
        self._tracking_since = time.perf_counter()
        self._opt_handle = register_optimizer_step_post_hook(self._on_step)
        self._losses.install()
        return self

    def close(self) -> None:
        """Remove the hooks, watch what stepped only once (its structure), close every watcher and
        print a one-line summary per model."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_tracking()
        if self._opt_handle is not None:
            self._opt_handle.remove()
            self._opt_handle = None
        self._losses.remove()
        if _elsewhere():
            return
        for ref, _ in sorted(self._pending.values(), key=lambda v: v[1]):
            opt = ref()
            if opt is not None and opt not in self._done:
                self._guarded(functools.partial(self._adopt, opt))
        self._pending.clear()
        for attached in self.frameworks:
            if attached.watcher is not None:
                self._names[id(attached.watcher)] = attached.model_name
                self._guarded(functools.partial(self._summarise, attached.watcher))
        for w in self.watchers:
            self._guarded(functools.partial(self._summarise, w))
        if not self.watchers and not any(a.watcher is not None for a in self.frameworks):
            if self._left:                       # watched, by the script itself: where its findings are
                for run_dir, name in self._left.items():
                    self._say(f"modscope: {name} was watched by the script's own probes.watch() "
                              f"(modscope findings --run {run_dir})")
            else:
                self._say("modscope: no model was watched (no torch.optim optimizer stepped with the "
                          "parameters of an nn.Module)")

    def _summarise(self, w: Watcher) -> None:
        w.close()
        findings = w.findings()        # after close: what the store holds (close judges what ran after the last step)
        if process_rank()[0] != 0:
            return
        text = findings.count_text()          # root causes first, as the dashboard counts them
        self._say(f"modscope: {self._names.get(id(w), 'model')}: {text} (modscope findings --run {self.run_dir})")

    # ----------------------------------------------------------------------------- hooks
    def _on_forward_pre(self, module: nn.Module, args: Any) -> None:
        if _in_fork_child:
            return
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._top.add(module)
            self.top_level_calls += 1
            if self.top_level_calls >= MAX_TRACKED_CALLS:
                with self._lock:
                    self._stop_tracking()        # safe in a hook: PyTorch iterates a copy of the hooks
                return
        self._local.depth = depth + 1

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth > 0:
            self._local.depth = depth - 1

    def _on_step(self, opt: Optimizer, args: Any, kwargs: Any) -> None:
        if opt not in self._loss_optimizers:
            self._losses.discard()               # the loss of a step no watcher of ours records
        if opt in self._done or self._closed or _elsewhere():
            return
        t0 = time.perf_counter()
        with self._lock:
            if self._module_handles:
                self._stop_tracking()            # the forward of the first step has run
            entry = self._pending.get(id(opt))
            if entry is None or entry[0]() is not opt:
                self._pending[id(opt)] = (weakref.ref(opt), next(self._order))
            else:
                self._guarded(functools.partial(self._adopt, opt))
        self.discovery_s += time.perf_counter() - t0

    def _stop_tracking(self) -> None:
        if self._module_handles:
            for h in self._module_handles:
                h.remove()
            self._module_handles = []
            self.tracking_s = time.perf_counter() - self._tracking_since
        if self._warning_filter is not None:
            restore_warning_filters(self._warning_filter)
            self._warning_filter = None

    # ----------------------------------------------------------------------------- adoption
    def _adopt(self, opt: Optimizer) -> None:
        """Find ``opt``'s model and watch it with the optimizers that step with it."""
        self._done.add(opt)
        self._pending.pop(id(opt), None)
        if self._adopt_framework(opt):
            return
        params = _optimizer_params(opt)
        model = self._find_model({id(p) for p in params})
        if model is None:
            self._note(f"modscope: {type(opt).__name__} steps tensors that no nn.Module holds: not watched")
            return
        if model in self._watched:
            self._note(f"modscope: {type(opt).__name__} steps parameters of {type(model).__name__}, which is "
                       "already watched with another optimizer: its parameters show as not in the optimizer")
            return
        own = watcher_of(model)
        if own is not None:
            name = type(unwrap(model)).__name__
            self._left.setdefault(str(own.run_dir), name)
            self._note(f"modscope: {name} is already watched by the script's own probes.watch() "
                       f"({own.run_dir}): left to it")
            return
        held = {id(p) for p in model.parameters()}
        group = [opt]
        for ref, _ in sorted(self._pending.values(), key=lambda v: v[1]):
            other = ref()
            if other is not None and other is not opt and any(id(p) in held for p in _optimizer_params(other)):
                group.append(other)
        for other in group:
            self._done.add(other)
            self._pending.pop(id(other), None)
        w = watch(model, group if len(group) > 1 else opt, run_dir=self.run_dir, every=self.every,
                  overhead=self.overhead)
        w.loss_source = self._losses.take
        self._loss_optimizers.update(group)
        name = type(unwrap(model)).__name__            # the user's class, not a DDP or compile wrapper's
        self._names[id(w)] = name
        self._watched.add(model)
        self.watchers.append(w)
        if process_rank()[0] == 0:
            self._say(f"modscope: watching {name} -> {self.run_dir}")

    def _adopt_framework(self, opt: Optimizer) -> bool:
        """Under a Lightning or Hugging Face Trainer that steps ``opt``: its callback watches (it prints the
        ``watching`` line when it starts, at the next batch)."""
        try:
            from ..integrations import zero_code
            attached = zero_code.attach(opt, self.run_dir, every=self.every, overhead=self.overhead)
        except Exception as exc:             # then a plain watch, as without a framework
            self._note(f"modscope: framework callback not attached: {type(exc).__name__}: {exc}")
            return False
        if attached is None:
            return False
        for other in attached.optimizers:
            self._done.add(other)
            self._pending.pop(id(other), None)
        self.frameworks.append(attached)
        return True

    def _find_model(self, wanted: set[int]) -> nn.Module | None:
        if not wanted:
            return None
        top = list(self._top)
        scored = [(c, m) for m in top if (c := _coverage(m, wanted))]
        if scored:
            best = max(c for c, _ in scored)
            if best == len(wanted):
                return _outermost(m for c, m in scored if c == best)
        # a model whose forward was not seen (built later), or an optimizer over several top-level
        # modules: the outermost module anywhere that holds all of them
        # type(o), not isinstance: isinstance reads o.__class__, which some proxies compute (and warn about)
        holders = [o for o in gc.get_objects()
                   if issubclass(type(o), nn.Module) and _coverage(o, wanted) == len(wanted)]
        found = _outermost(holders)
        if found is not None:
            return found
        return _outermost(m for c, m in scored if c == max(c for c, _ in scored)) if scored else None

    # ----------------------------------------------------------------------------- messages
    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:                 # discovery must never stop the script
            first = (str(exc).strip().splitlines() or [""])[0]
            self._note(f"modscope: not watching: {type(exc).__name__}: {first}")

    def _note(self, line: str) -> None:
        if line not in self._noted:
            self._noted.add(line)
            self._say(line)

    def _say(self, line: str) -> None:
        try:
            print(printable(line), file=self._out or sys.stderr, flush=True)
        except Exception:
            pass


def install(run_dir: str | os.PathLike[str], *, every: int | None = None, overhead: float = 0.01,
            out: TextIO | None = None) -> AutoWatch:
    """Start discovering (see the module's docstring); returns the :class:`AutoWatch` to close at
    the end of the script. Arguments are checked here, as :func:`probes.watch` checks them."""
    if not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir must be a str or os.PathLike, got {type(run_dir).__qualname__}: {run_dir!r:.80}")
    check_every(every)
    return AutoWatch(run_dir, every=every, overhead=check_overhead(overhead), out=out).start()
