"""What no single process sees: findings computed in the reader by comparing the ranks of one run.

``rank-divergence`` (error): a parameter or buffer that data parallelism keeps identical on every rank
(its ``fingerprint`` -- a sum of a few fixed strided values -- and its ``data_norm``, taken at the same
point of every sampled step on every rank, and once more when each rank's watcher closes) differs between
ranks at the newest point compared: the ranks' close, when two or more closed after the same step, else
the newest step sampled on two or more of them. So replicas that drift apart are found by the end of the
run however sparse the samples were. ``rank-straggler`` (warning): one rank's median own time per step
(``steps.compute_ms``: its wall time less the time it waited for the other ranks; the wall time for a store
without it) is at least 1.5x the median of the other ranks' in at least 80% of the recent windows of
steps. Nothing is added to the training loop: the writers store per-rank values, the comparison happens
here.

Torch-free and SQL-free: the values come from :class:`dashboard.read.store.Store` queries (``sampled_steps``,
``tensor_values``, ``tensor_history``, ``close_values``, ``step_times``, ``compute_times``); the comparison and
the texts are plain functions of plain data, tested on their own. Severities and fixes come from
``probes.schema.CODES``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from probes.schema import CODES, FindingCode, display_path

from .store import MAX_TENSORS, Row, Store

REL_TOL = 1e-6                 # replicas hold bit-identical values; this only absorbs printing/rounding noise
ABS_TOL = 1e-9                 # ... and values at zero
MAX_STEPS = 2000               # newest sampled steps of each rank looked at
MAX_HISTORY_STEPS = 1000       # newest common steps searched for the step a divergence started
MAX_DIVERGED = 20              # diverged tensors whose history is searched (all are reported)
STRAGGLER_FACTOR = 1.5
STRAGGLER_SHARE = 0.8          # of the windows compared
STRAGGLER_STEPS = 512          # newest steps of each rank
STRAGGLER_WINDOW = 32          # steps per window (by step number, the same windows on every rank)
STRAGGLER_MIN_WINDOWS = 3
STRAGGLER_MIN_STEPS = 4        # steps of a rank in a window for its median to count

QUANTITIES = ("fingerprint", "data_norm")


# -- text ------------------------------------------------------------------------------------------------
def format_ranks(ranks: Iterable[int], *, word: bool = True) -> str:
    """'rank 3', 'ranks 0–7', 'ranks 0–3, 5, 7–8' (consecutive ranks as ranges)."""
    rs = sorted({int(r) for r in ranks})
    if not rs:
        return "no rank" if word else ""
    parts: list[str] = []
    start = prev = rs[0]
    for r in [*rs[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}" if prev > start + 1 else f"{start}, {prev}")
        if r is not None:
            start = prev = r
    text = ", ".join(parts)
    if not word:
        return text
    return f"rank {text}" if len(rs) == 1 else f"ranks {text}"


def _num(x: Any) -> str:
    if x is None:
        return "none"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{float(x):.9g}"


# -- agreement ------------------------------------------------------------------------------------------
def same(a: Any, b: Any) -> bool:
    """Whether two stored values agree (NaN agrees with NaN; a missing value agrees with anything)."""
    if a is None or b is None:
        return True
    fa, fb = float(a), float(b)
    if math.isnan(fa) or math.isnan(fb):
        return math.isnan(fa) and math.isnan(fb)
    return math.isclose(fa, fb, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def groups(values: Mapping[int, Any]) -> list[list[int]]:
    """The ranks grouped by agreeing value (missing values left out), largest group first; a tie goes
    to the group holding the lowest rank (rank 0 is the reference)."""
    out: list[tuple[Any, list[int]]] = []
    for rank in sorted(values):
        v = values[rank]
        if v is None:
            continue
        for ref, members in out:
            if same(ref, v):
                members.append(rank)
                break
        else:
            out.append((v, [rank]))
    return sorted((members for _, members in out), key=lambda m: (-len(m), m[0]))


@dataclass(frozen=True)
class Disagreement:
    """One tensor whose replicas differ at one step."""

    quantity: str                        # 'fingerprint' or 'data_norm': the first that differs
    agree: tuple[int, ...]               # the largest group of ranks that agree
    disagree: tuple[int, ...]            # every other rank compared
    values: dict[int, dict[str, Any]]    # rank -> {"fingerprint": x, "data_norm": y}


def compare(values: Mapping[int, tuple[Any, Any]]) -> Disagreement | None:
    """Compare one tensor's (fingerprint, data_norm) over the ranks that have it at one step."""
    if len(values) < 2:
        return None
    for i, quantity in enumerate(QUANTITIES):
        g = groups({r: v[i] for r, v in values.items()})
        if len(g) > 1:
            agree = tuple(g[0])
            disagree = tuple(sorted(r for members in g[1:] for r in members))
            return Disagreement(quantity, agree, disagree,
                                {r: dict(zip(QUANTITIES, v, strict=True)) for r, v in sorted(values.items())})
    return None


# -- rank-divergence ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Divergence:
    path: str
    step: int                 # the newest step compared (it differs there); at close: the step after the last one
    first_step: int           # the oldest step of the run of compared steps, ending at ``step``, at which it differs
    since_start: bool         # it differed already at the oldest step searched (``first_step`` is a bound)
    count: int                # compared steps at which it differed
    steps_compared: int
    at: Disagreement
    at_close: bool = False    # ``step`` is the ranks' close (the values after the optimizer step of ``step - 1``)
    agreed_at: int | None = None   # the newest compared step before ``first_step`` at which the ranks agreed


def common_steps(steps: Mapping[int, Sequence[int]]) -> list[int]:
    """Steps sampled on at least two ranks, oldest first."""
    seen: dict[int, int] = {}
    for rank_steps in steps.values():
        for s in set(rank_steps):
            seen[s] = seen.get(s, 0) + 1
    return sorted(s for s, n in seen.items() if n >= 2)


def close_point(stores: Mapping[int, Store]) -> tuple[int, dict[int, dict[str, tuple[Any, Any]]]] | None:
    """(step, rank -> path -> (fingerprint, data_norm)) of the ranks' close, for the ranks whose watcher closed
    after the same step (the latest such step two or more share); the step is the one after it (the state a
    sample of that step would have seen at its first forward). None when fewer than two ranks closed alike."""
    closed = {r: c for r, s in stores.items() if (c := s.close_values(r)) is not None}
    by_step: dict[int, list[int]] = {}
    for r, c in closed.items():
        by_step.setdefault(c.after_step, []).append(r)
    shared = [step for step, ranks in by_step.items() if len(ranks) >= 2]
    if not shared:
        return None
    after = max(shared)
    return after + 1, {r: closed[r].values for r in by_step[after]}


def divergences(stores: Mapping[int, Store], *, max_steps: int = MAX_STEPS,
                max_history: int = MAX_HISTORY_STEPS) -> list[Divergence]:
    """Tensors that differ between ranks at the newest point compared (the ranks' close, else the newest step
    sampled on two or more ranks), with the step from which on they have differed (searched over the newest
    ``max_history`` common steps) and the last step before it at which they agreed."""
    if len(stores) < 2:
        return []
    steps = {r: s.sampled_steps(r, max_steps) for r, s in stores.items()}
    closing = close_point(stores)
    common = [s for s in common_steps(steps) if closing is None or s < closing[0]]
    if closing is not None:
        newest, at_newest = closing
    elif common:
        newest = common[-1]
        at_newest = {r: stores[r].tensor_values(r, newest) for r, rank_steps in steps.items() if newest in rank_steps}
    else:
        return []
    paths = sorted({p for values in at_newest.values() for p in values})
    found: dict[str, Disagreement] = {}
    for path in paths:
        d = compare({r: values[path] for r, values in at_newest.items() if path in values})
        if d is not None:
            found[path] = d
    if not found:
        return []
    window = [*common[-max_history:], *([newest] if closing is not None else [])]
    history = _histories(stores, sorted(found)[:MAX_DIVERGED], window[0])
    for rank, values in (closing[1].items() if closing is not None else ()):
        for path in found:
            if path in values:
                history.setdefault(path, {}).setdefault(newest, {})[rank] = values[path]
    out = []
    for path, d in sorted(found.items()):
        first, count, since_start, agreed = newest, 1, False, None
        per_step = history.get(path)
        if per_step:
            first, count, since_start, agreed = _run_back(per_step, window)
        out.append(Divergence(path, newest, first, since_start, count, len(window), d, closing is not None, agreed))
    return out


def _histories(stores: Mapping[int, Store], paths: Sequence[str],
               since_step: int) -> dict[str, dict[int, dict[int, tuple[Any, Any]]]]:
    """path -> step -> rank -> (fingerprint, data_norm)."""
    out: dict[str, dict[int, dict[int, tuple[Any, Any]]]] = {}
    if not paths:
        return out
    for rank, store in stores.items():
        for path, rows in store.tensor_history(rank, paths, since_step, MAX_TENSORS).items():
            for step, fp, dn in rows:
                out.setdefault(path, {}).setdefault(step, {})[rank] = (fp, dn)
    return out


def _run_back(per_step: Mapping[int, Mapping[int, tuple[Any, Any]]],
              window: Sequence[int]) -> tuple[int, int, bool, int | None]:
    """(first step, count, since the start of the window, the step before it at which they agreed): walking back
    from the newest compared step while the ranks disagree."""
    differing = [s for s in window if s in per_step and compare(per_step[s]) is not None]
    compared = [s for s in window if s in per_step and len(per_step[s]) >= 2]
    if not compared:
        return window[-1], 1, False, None
    first, agreed = compared[-1], None
    for s in reversed(compared):
        if compare(per_step[s]) is None:
            agreed = s
            break
        first = s
    return first, max(1, len(differing)), first == compared[0], agreed


def divergence_finding(d: Divergence) -> Row:
    info = CODES[FindingCode.RANK_DIVERGENCE]
    dis = d.at.values[d.at.disagree[0]][d.at.quantity]
    ref = d.at.values[d.at.agree[0]][d.at.quantity]
    verb = "disagrees" if len(d.at.disagree) == 1 else "disagree"
    quantity = "fingerprint" if d.at.quantity == "fingerprint" else "data norm"
    # the close is the state after the last step: shown as that step (a sample's values are its start's)
    last = d.step - 1 if d.at_close else d.step
    first = last if d.first_step == d.step else d.first_step
    if d.first_step != d.step:
        since = f"it has differed at every compared step since step {first}" + (
            " (the oldest compared)" if d.since_start else "")
    else:
        since = "first seen there"
    if d.agreed_at is not None:
        since += f"; the ranks agreed at step {d.agreed_at}, the compared step before"
    where = f"when the ranks closed (after step {last}):" if d.at_close else f"at step {last}:"
    message = (f"{display_path(d.path)} differs between ranks {where} {format_ranks(d.at.disagree)} "
               f"{verb} with {format_ranks(d.at.agree)} ({quantity} {_num(dis)} vs {_num(ref)}); {since}. "
               "Data parallelism keeps every replica of it identical: something changed it on some ranks only.")
    return {
        "code": FindingCode.RANK_DIVERGENCE.value, "severity": info.severity.value, "path": d.path,
        "message": message, "fix": info.fix,
        "evidence": {"step": last, "first_step": first, "quantity": d.at.quantity,
                     "values": {str(r): v for r, v in d.at.values.items()},
                     "agree": list(d.at.agree), "disagree": list(d.at.disagree),
                     "steps_compared": d.steps_compared, "differed_since_oldest_compared": d.since_start,
                     "at_close": d.at_close, "agreed_at": d.agreed_at},
        "ranks": list(d.at.disagree), "first_step": first, "last_step": last, "count": d.count,
        "cause_code": None, "cause_path": None, "active": 1, "cross_rank": True,
    }


# -- rank-straggler --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Straggler:
    rank: int
    windows: int                 # windows in which it was compared with other ranks
    slow: int                    # ... in which it was at least STRAGGLER_FACTOR x the others' median
    median_ms: float             # its median step time over its recent steps
    others_ms: float             # the median of the other ranks' medians
    ratios: list[float] = field(default_factory=list)
    first_step: int = 0
    last_step: int = 0
    own_time: bool = False       # compared on the ranks' own time (steps.compute_ms), not their wall time


def stragglers(times: Mapping[int, Sequence[tuple[int, float]]], *, window: int = STRAGGLER_WINDOW,
               factor: float = STRAGGLER_FACTOR, share: float = STRAGGLER_SHARE,
               min_windows: int = STRAGGLER_MIN_WINDOWS) -> list[Straggler]:
    """Ranks whose step time is consistently at least ``factor`` x the median of the others: per window
    of ``window`` steps (by step number, so every rank's window holds the same steps) each rank's
    median; a rank is slow in a window when its median is >= ``factor`` x the median of the other ranks'
    medians; a straggler when slow in >= ``share`` of at least ``min_windows`` windows."""
    if len(times) < 2:
        return []
    per_window: dict[int, dict[int, float]] = {}
    span: dict[int, list[int]] = {}
    for rank, rows in times.items():
        buckets: dict[int, list[float]] = {}
        for step, ms in rows:
            if ms is not None and math.isfinite(ms) and ms >= 0:
                buckets.setdefault(step // window, []).append(ms)
        for w, values in buckets.items():
            if len(values) >= STRAGGLER_MIN_STEPS:
                per_window.setdefault(w, {})[rank] = statistics.median(values)
                span.setdefault(w, []).append(rank)
    compared: dict[int, int] = {}
    slow: dict[int, int] = {}
    ratios: dict[int, list[float]] = {}
    steps_of: dict[int, list[int]] = {}
    for w, medians in per_window.items():
        if len(medians) < 2:
            continue
        for rank, ms in medians.items():
            others = statistics.median(v for r, v in medians.items() if r != rank)
            compared[rank] = compared.get(rank, 0) + 1
            ratio = ms / others if others > 0 else (math.inf if ms > 0 else 1.0)
            ratios.setdefault(rank, []).append(ratio)
            if ratio >= factor:
                slow[rank] = slow.get(rank, 0) + 1
                steps_of.setdefault(rank, []).append(w)
    out = []
    for rank, n in sorted(compared.items()):
        k = slow.get(rank, 0)
        if n >= min_windows and k >= share * n:
            mine = [ms for _, ms in times[rank] if ms is not None and math.isfinite(ms)]
            theirs = [statistics.median([ms for _, ms in rows if ms is not None and math.isfinite(ms)])
                      for r, rows in times.items() if r != rank and rows]
            ws = steps_of.get(rank, [0])
            last = max((step for step, _ in times[rank]), default=0)
            out.append(Straggler(rank, n, k, statistics.median(mine) if mine else 0.0,
                                 statistics.median(theirs) if theirs else 0.0, ratios.get(rank, []),
                                 min(ws) * window, min(max(ws) * window + window - 1, last)))
    return out


def straggler_finding(s: Straggler) -> Row:
    info = CODES[FindingCode.RANK_STRAGGLER]
    ratio = statistics.median(s.ratios) if s.ratios else 0.0
    what = "own time per step (outside the waits for the other ranks) is" if s.own_time else "steps take"
    message = (f"rank {s.rank}'s {what} {ratio:.1f}× the median of the other ranks' ({s.median_ms:.3g} ms "
               f"against {s.others_ms:.3g} ms) in {s.slow} of {s.windows} windows of {STRAGGLER_WINDOW} steps: "
               "the other ranks wait for it at every gradient all-reduce.")
    return {
        "code": FindingCode.RANK_STRAGGLER.value, "severity": info.severity.value, "path": "",
        "message": message, "fix": info.fix,
        "evidence": {"rank": s.rank, "windows_compared": s.windows, "windows_slow": s.slow,
                     "median_step_ms": s.median_ms, "others_median_step_ms": s.others_ms,
                     "median_ratio": ratio, "window_steps": STRAGGLER_WINDOW, "factor": STRAGGLER_FACTOR,
                     "time": "own" if s.own_time else "wall"},
        "ranks": [s.rank], "first_step": s.first_step, "last_step": s.last_step, "count": s.slow,
        "cause_code": None, "cause_path": None, "active": 1, "cross_rank": True,
    }


# -- both ---------------------------------------------------------------------------------------------
def cross_rank_findings(stores: Mapping[int, Store]) -> list[Row]:
    """The findings of comparing the ranks ``stores`` hold (rank -> the store holding it)."""
    if len(stores) < 2:
        return []
    out = [divergence_finding(d) for d in divergences(stores)]
    # each rank's own time where every rank stored it: under synchronous data parallelism the wall times are equal
    own = {r: s.compute_times(r, STRAGGLER_STEPS) for r, s in stores.items()}
    use_own = all(own.values())
    times = own if use_own else {r: s.step_times(r, STRAGGLER_STEPS) for r, s in stores.items()}
    out += [straggler_finding(dataclasses.replace(s, own_time=use_own)) for s in stragglers(times)]
    return out
