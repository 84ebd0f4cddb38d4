"""The finding tracker: the active set, when each finding was first seen, and the difference to the
store after every evaluation (only new or changed findings are rewritten)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

from . import records
from .findings import Finding, sort_findings
from .model_index import ModelIndex
from .store import Op


@dataclasses.dataclass(frozen=True)
class TrackedFinding:
    finding: Finding
    module_id: int | None         # where the tree draws it
    first_step: int


class FindingTracker:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._active: dict[tuple[str, str], TrackedFinding] = {}
        self._first_seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()          # findings() may be called from another thread

    def active(self) -> list[Finding]:
        """The current findings, most severe first."""
        with self._lock:
            return sort_findings(t.finding for t in self._active.values())

    def update(self, step: int, current: Iterable[Finding], index: ModelIndex) -> list[Op]:
        """Make ``current`` the active set; the store operations that record the difference."""
        new: dict[tuple[str, str], TrackedFinding] = {}
        for f in current:
            first = self._first_seen.setdefault(f.key, step)
            new[f.key] = TrackedFinding(f, index.module_for_finding(f.code, f.path), first)
        with self._lock:
            old, self._active = self._active, new
        resolved = [k for k in old if k not in new]
        changed = [t for k, t in new.items() if k not in old or _differs(old[k], t)]
        return records.findings_ops(self.rank, changed, resolved, step)

    def rewrite_ops(self, step: int) -> list[Op]:
        """Every active finding written again (after the store missed writes)."""
        with self._lock:
            active = list(self._active.values())
        return records.findings_ops(self.rank, active, [], step)


def _differs(a: TrackedFinding, b: TrackedFinding) -> bool:
    return (a.finding.message != b.finding.message or a.finding.evidence != b.finding.evidence
            or a.module_id != b.module_id or a.finding.severity != b.finding.severity)
