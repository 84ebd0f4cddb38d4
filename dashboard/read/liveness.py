"""Whether a run is being written: the writer's heartbeat, the process behind it, and how that reads."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes.schema import (
    RunStatus,
    StrEnum,
)

# A running process whose heartbeat (ranks.updated_at) is older than this is "stalled".
STALL_MIN_S = 120.0


STALL_STEP_FACTOR = 5.0     # ... or than this many median step times, when steps are slow


STALL_BEHIND_MIN_S = 30.0   # a rank this far behind the other ranks' heartbeats is stalled (writers beat every 5 s)


@dataclass(frozen=True)
class StoreInfo:
    path: Path
    schema_version: int
    tables: tuple[str, ...]


@dataclass(frozen=True)
class ChangeSignature:
    """What live polling compares between two looks at a store: a page reads again only when
    this changed. ``structure`` changes only when the tree's rows or badges must change."""

    last_step: int | None
    stats_step: int | None
    structure: tuple[int, ...]     # modules, then active findings: count, code, path, severity sums
    status: str | None
    samples_dropped: int
    probe_errors: int
    write_errors: int


class RunState(StrEnum):
    """What the header says about the process writing a store."""

    RUNNING = "running"
    CLOSED = "closed"
    STALLED = "stalled"                          # alive (or elsewhere), but no heartbeat for a while
    ENDED = "ended without close"                # the process is gone and never closed the store
    COPIED_RUNNING = "running when copied"       # a snapshot taken while the run was running
    UNKNOWN = "unknown"                          # no rank row yet


@dataclass(frozen=True)
class Heartbeat:
    """What a store says about its writer's process (``ranks``)."""

    status: str | None
    updated_at: float | None
    pid: int | None
    hostname: str | None
    median_step_s: float | None

    def stall_after_s(self) -> float:
        """Silence longer than this is a stall: 2 min, or 5 median steps when steps are slower."""
        return max(STALL_MIN_S, STALL_STEP_FACTOR * (self.median_step_s or 0.0))


@dataclass(frozen=True)
class Liveness:
    state: RunState
    silent_s: float | None = None        # seconds since the last heartbeat (STALLED)


def process_alive(pid: int | None, hostname: str | None) -> bool | None:
    """Whether process ``pid`` lives, when it ran on this host; None when that cannot be known
    here (another host, no pid)."""
    if pid is None or pid <= 0 or not hostname or hostname != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                      # it exists, owned by someone else
    except OSError:
        return None
    return True


def liveness(beat: Heartbeat, *, now: float, alive: bool | None, behind_s: float | None = None) -> Liveness:
    """The state of a live store's writer from its heartbeat and (on this host) its process.

    ``behind_s``: how much older this writer's heartbeat is than the newest one of the other ranks
    of its run. A rank silent for max(``STALL_BEHIND_MIN_S``, 5 median steps) while the others go on
    is stalled at once (the 2-minute rule is for a run that is silent as a whole)."""
    if beat.status == RunStatus.CLOSED:
        return Liveness(RunState.CLOSED)
    if beat.status is None:
        return Liveness(RunState.UNKNOWN)
    if alive is False:
        return Liveness(RunState.ENDED)
    silent = None if beat.updated_at is None else max(0.0, now - beat.updated_at)
    if silent is not None and silent > beat.stall_after_s():
        return Liveness(RunState.STALLED, silent)
    behind_limit = max(STALL_BEHIND_MIN_S, STALL_STEP_FACTOR * (beat.median_step_s or 0.0))
    if silent is not None and behind_s is not None and behind_s > behind_limit:
        return Liveness(RunState.STALLED, silent)
    return Liveness(RunState.RUNNING)


def snapshot_liveness(beat: Heartbeat) -> Liveness:
    """What a snapshot (a store nothing writes any more) says of its writer: closed, or running when copied."""
    if beat.status is None:
        return Liveness(RunState.UNKNOWN)
    return Liveness(RunState.CLOSED if beat.status == RunStatus.CLOSED else RunState.COPIED_RUNNING)


def duration_text(seconds: float) -> str:
    """Seconds under a minute, else whole minutes (hours and days when longer): '40 s', '2 min',
    '1 h 5 min', '3 d 4 h'."""
    if seconds < 60:
        return f"{int(seconds)} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def status_text(life: Liveness) -> str:
    """What the header (and the per-rank table) says about a writer: 'running', 'closed',
    'stalled: no update for 3 min', 'ended without close (process gone)' ..."""
    if life.state is RunState.STALLED:
        return f"stalled: no update for {duration_text(life.silent_s or 0.0)}"
    if life.state is RunState.ENDED:
        return "ended without close (process gone)"
    if life.state is RunState.UNKNOWN:
        return "starting"
    return str(life.state)


@dataclass(frozen=True)
class WriteTrouble:
    """Commits of the store that failed (disk full, I/O error): now (``failing``) or earlier."""

    failing: bool
    failing_since: float | None
    error: str | None
    failed_commits: int
    dropped_samples: int


@dataclass(frozen=True)
class CloseValues:
    """A rank's replicated tensors when its watcher closed: after the optimizer step of ``after_step``."""

    after_step: int
    values: dict[str, tuple[Any, Any]]      # path -> (fingerprint, data_norm)


