"""A rank's store session: the writer lock, the writer, the rank's identity and counters, and what to do
when the store missed writes.

The identity (meta and the rank's row) is kept: when commits succeed again after failing (a full disk),
it is written again together with whatever the caller says was lost (the tree, the current findings).
"""

from __future__ import annotations

import collections
import os
import platform
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from .._version import __version__
from ..schema import RunStatus, snapshot
from . import records, run_files
from .errors import ErrorLog
from .records import Op
from .rundir import RunFiles, WriterLock, journal_mode
from .writer import StoreWriter

HEARTBEAT_S = 5.0             # the store's heartbeat (ranks.updated_at) moves at least this often while training
# Long runs stay bounded: every sampled step of the last THIN_RECENT is kept; older samples (and older
# unsampled step rows) are thinned to about THIN_OLD evenly spaced ones. The dense tier's rows likewise, counted
# in dense steps.
THIN_RECENT = 1000
THIN_OLD = 1000
THIN_EVERY = 250              # sampled steps between thinning passes (run by the writer thread)


class StoreSession:
    def __init__(self, files: RunFiles, *, run_name: str, world_size: int, model_class: str, device: str,
                 sampling: dict[str, Any]) -> None:
        self.files = files
        self.rank = files.rank
        self._lock = WriterLock(files)
        self._lock.acquire()
        self.journal = journal_mode(files.run_dir)
        try:
            self.writer = StoreWriter(files.store, journal=self.journal)
        except BaseException:
            self._lock.release()
            run_files.remove_own(files.status)
            raise
        now = time.time()
        self._identity = [
            *records.meta_ops(run_name, now, {"rank_count": world_size, "world_size": world_size,
                                              "run_id": files.run_id, "journal_mode": self.journal,
                                              "modscope_version": __version__}),
            *records.rank_ops({
                "rank": self.rank, "world_size": world_size, "hostname": socket.gethostname(), "pid": os.getpid(),
                "model_class": model_class, "torch_version": torch.__version__,
                "python_version": platform.python_version(), "device": device, "sampling": sampling,
                "started_at": now, "updated_at": now, "status": RunStatus.RUNNING, "step": 0})]
        self.writer.submit(self._identity, droppable=False)
        self._last_counters = 0.0
        self._errors_logged = 0
        self._recoveries_seen = 0
        self._recent_samples: collections.deque[int] = collections.deque(maxlen=THIN_RECENT)
        self._samples = 0
        self._recent_series: collections.deque[int] = collections.deque(maxlen=THIN_RECENT)
        self._series = 0

    def submit(self, ops: list[Op], droppable: bool = True) -> None:
        self.writer.submit(ops, droppable)

    def sampled(self, step: int) -> None:
        """A sampled step was stored: now and then, thin the old ones (the writer thread does the work)."""
        self._recent_samples.append(step)
        self._samples += 1
        if self._samples % THIN_EVERY == 0 and len(self._recent_samples) >= THIN_RECENT:
            cutoff = self._recent_samples[-THIN_RECENT]
            self.writer.submit(records.thin_ops(self.rank, cutoff, max(1, -(-cutoff // THIN_OLD))), droppable=False)

    def series_taken(self, step: int) -> None:
        """The dense tier ran at ``step``: now and then, thin its old rows (the writer thread does the work)."""
        self._recent_series.append(step)
        self._series += 1
        if self._series % THIN_EVERY == 0 and len(self._recent_series) >= THIN_RECENT:
            cutoff = self._recent_series[0]
            self.writer.submit(records.thin_series_ops(self.rank, cutoff, max(1, -(-cutoff // THIN_OLD))),
                               droppable=False)

    def counters_due(self, errors: ErrorLog) -> bool:
        """Counters go with every sampled step, and with any step once a heartbeat is due or something changed."""
        w = self.writer
        return (errors.dirty or time.monotonic() - self._last_counters >= HEARTBEAT_S
                or w.recoveries != self._recoveries_seen or w.write_errors != self._errors_logged)

    def write_counters(self, step: int, errors: ErrorLog, overhead: float | None, lost: Callable[[], list[Op]],
                       status: RunStatus = RunStatus.RUNNING, closed_at: float | None = None) -> None:
        """The rank's counters and errors; failed commits are recorded as probe errors (with SQLite's
        message) and, once commits succeed again, the identity and ``lost()`` are written again."""
        self._last_counters = time.monotonic()
        w = self.writer
        if w.write_errors != self._errors_logged and w.last_error:
            errors.record_message("store-write", w.last_error.split(":", 1)[0], w.last_error, step,
                                  count=w.write_errors - self._errors_logged)
            self._errors_logged = w.write_errors
        ops: list[Op] = []
        if w.recoveries != self._recoveries_seen:
            self._recoveries_seen = w.recoveries
            ops += [*self._identity, *lost()]
            errors.dirty = True
        ops.append(records.rank_counters_op(self.rank, records.RankCounters(
            step, time.time(), w.written, w.dropped, errors.total, overhead, status, closed_at, w.write_errors,
            w.last_error)))
        if errors.dirty:
            ops.append(records.errors_op(self.rank, errors.entries))
            errors.dirty = False
        w.submit(ops, droppable=False)

    def snapshot(self, dest: str | os.PathLike[str]) -> os.PathLike[str]:
        """Every rank of this run present in the directory, as one file."""
        return snapshot(self.files.siblings() or [self.files.store], dest)

    def close(self, retry_failed: bool = True) -> None:
        self.writer.close()
        self._lock.release()
