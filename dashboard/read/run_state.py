"""What a run is doing, said for the pages: its ranks' states, its health, and its findings merged over the
ranks."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .crossrank import format_ranks
from .run_scan import FILE_KEY
from .shown_text import clip
from .store import (
    Liveness,
    Row,
    RunState,
    WriteTrouble,
    severity_rank,
)


def merge_findings(per_rank: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[Row]:
    """One entry per (code, path) over the ranks: ``ranks`` that report it, the worst severity, the
    first and last step over the ranks, ``count`` summed, active on any rank; message, fix, evidence and
    cause from the lowest rank that reports it; ``module_ids``: each rank's module id."""
    out: dict[tuple[str, str], Row] = {}
    for rank in sorted(per_rank):
        for f in per_rank[rank]:
            key = (str(f["code"]), str(f["path"]))
            have = out.get(key)
            if have is None:
                row = dict(f)
                row.update(ranks=[rank], module_ids={rank: f.get("module_id")}, count=int(f.get("count") or 1),
                           active=int(f.get("active", 1) or 0))
                out[key] = row
                continue
            have["ranks"].append(rank)
            have["module_ids"][rank] = f.get("module_id")
            if severity_rank(f["severity"]) < severity_rank(have["severity"]):
                have["severity"] = f["severity"]
            have["first_step"] = _pick(min, have.get("first_step"), f.get("first_step"))
            have["last_step"] = _pick(max, have.get("last_step"), f.get("last_step"))
            have["count"] += int(f.get("count") or 1)
            have["active"] = max(have["active"], int(f.get("active", 1) or 0))
            if not have.get("cause_code") and f.get("cause_code"):
                have["cause_code"], have["cause_path"] = f["cause_code"], f.get("cause_path")
    return sorted(out.values(), key=finding_order)


def or_default(value: int | None, default: int) -> int:
    return default if value is None else value


def _pick(fn: Any, a: Any, b: Any) -> Any:
    values = [v for v in (a, b) if v is not None]
    return fn(values) if values else None


def finding_order(f: Mapping[str, Any]) -> tuple[int, int, str, str]:
    """Worst first, active before resolved, then by path and code."""
    return severity_rank(f["severity"]), -int(f.get("active", 1) or 0), str(f["path"]), str(f["code"])


@dataclass(frozen=True)
class RunInfo:
    """One line of the run selector."""

    key: str
    run_id: str | None
    name: str | None
    started_at: float | None
    ranks: tuple[int, ...]
    status: str

    def label(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at)) if self.started_at else "?"
        ident = self.run_id or self.key.removeprefix(FILE_KEY)
        ranks = format_ranks(self.ranks) if self.ranks else "no rank"
        name = f" · {clip(self.name)}" if self.name and self.name != ident else ""     # a name can be long
        return f"{ident}{name} · {when} · {ranks} · {self.status}"


@dataclass(frozen=True)
class RunHealth:
    """What one poll knows about a run's writers: each rank's state, failed commits, and warnings
    (an unreadable rank file; a store in WAL mode written from another host)."""

    states: dict[int, Liveness]
    troubles: list[tuple[int, WriteTrouble]]
    warnings: list[str]


def state_word(life: Liveness) -> str:
    """The state without its duration ('stalled', 'ended without close'), to group ranks by."""
    return str(life.state)


def others_note(states: Mapping[int, Liveness], view: int) -> str:
    """Ranks other than ``view`` whose writer stalled or ended: 'rank 1 ended without close' ..."""
    groups: dict[str, list[int]] = {}
    for rank, life in sorted(states.items()):
        if rank != view and life.state in (RunState.STALLED, RunState.ENDED):
            groups.setdefault(state_word(life), []).append(rank)
    return "; ".join(f"{format_ranks(ranks)} {word}" for word, ranks in groups.items())


def run_status(states: Mapping[int, Liveness]) -> str:
    """A run's status over its ranks: 'closed' when every rank closed, 'running' while one runs (with
    the ranks that stalled or ended), else the ranks' states."""
    if not states:
        return "no rank yet"
    words = {r: state_word(life) for r, life in states.items()}
    if all(w == RunState.CLOSED for w in words.values()):
        return "closed"
    bad = others_note(states, -1)
    if any(life.state is RunState.RUNNING for life in states.values()):
        return "running" + (f" ({bad})" if bad else "")
    return bad or ", ".join(sorted(set(words.values())))
