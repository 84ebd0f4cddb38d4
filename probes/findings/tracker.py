"""The finding tracker: the active set, when each finding was first seen and how often, and the difference
to the store after every evaluation (only new or changed findings are rewritten).

Findings about a state (an unregistered module, a dead layer) are counted in sampled steps: first and
last step and count are the tracker's. Findings about events carry their own (see probes.findings.events)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

from ..model.index import ModelIndex
from ..store import records
from ..store.records import Op
from .finding import Finding, sort_findings


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
        self._counts: dict[tuple[str, str], int] = {}      # state findings: sampled steps seen in
        self._lock = threading.Lock()          # findings() may be called from another thread

    def active(self) -> list[Finding]:
        """The current findings, most severe first."""
        with self._lock:
            return sort_findings(t.finding for t in self._active.values())

    def update(self, step: int, current: Iterable[Finding], index: ModelIndex, sampled: bool) -> list[Op]:
        """Make ``current`` the active set; the store operations that record the difference. ``sampled``:
        the evaluation of a sampled step (state findings count it)."""
        new: dict[tuple[str, str], TrackedFinding] = {}
        for given in current:
            key = given.key
            if given.is_event:
                first = given.first_step if given.first_step is not None else self._first_seen.setdefault(key, step)
                f = given
            else:
                first = self._first_seen.setdefault(key, step)
                count = self._counts.get(key, 0) + (1 if sampled or key not in self._counts else 0)
                self._counts[key] = count
                f = dataclasses.replace(given, first_step=first, count=count, step=step)
            new[key] = TrackedFinding(f, index.module_for_finding(f.code, f.path), first)
        with self._lock:
            old, self._active = self._active, new
        resolved = [k for k in old if k not in new]
        for k in resolved:
            self._counts.pop(k, None)
        changed = [t for k, t in new.items() if k not in old or _differs(old[k], t)]
        return records.findings_ops(self.rank, changed, resolved, step, count_states=sampled)

    def rewrite_ops(self, step: int) -> list[Op]:
        """Every active finding written again (after the store missed writes)."""
        with self._lock:
            active = list(self._active.values())
        return records.findings_ops(self.rank, active, [], step, count_states=False)


def _differs(a: TrackedFinding, b: TrackedFinding) -> bool:
    fa, fb = a.finding, b.finding
    if fa.is_event and (fa.count != fb.count or fa.step != fb.step):
        return True
    return (fa.message != fb.message or fa.evidence != fb.evidence or a.module_id != b.module_id
            or fa.severity != fb.severity or fa.cause != fb.cause)
