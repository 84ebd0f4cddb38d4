"""``modscope findings``: the active findings of a run or a snapshot, as text or JSON, and the
exit status a CI job fails on.

Plain functions over plain data: :func:`open_sources` opens the stores, :func:`collect` turns
their findings into JSON-ready dicts (one per run, code and path, the ranks merged),
:func:`exit_status` applies ``--fail-on`` and :func:`format_text` / :func:`format_json` print.
The stores are read with :class:`dashboard.data.Store`, one file at a time; when a multi-rank
reader exists, only :func:`open_sources` changes.

A run directory can hold several runs (every ``probes.watch()`` is a run of its own: a GAN watched
by ``modscope run`` writes two): every run in it is read, and each finding names its run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from probes.schema import LEGACY_STORE_FILENAME, SEVERITY_ORDER, Severity, display_path, parse_store_filename

from .data import Store, StoreError

LEVELS = tuple(str(s) for s in SEVERITY_ORDER)          # error, warning, info: worst first


class FindingsError(Exception):
    """A store that cannot be read, or an argument that does not fit it: one line."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One store file and the run it belongs to."""

    run_id: str
    store: Store


def open_sources(*, run: str | os.PathLike[str] | None = None,
                 snapshot: str | os.PathLike[str] | None = None) -> list[Source]:
    """The stores to read: every run of a run directory (or the one store file named), or a
    snapshot. Raises FindingsError naming the path when there is nothing readable."""
    if (run is None) == (snapshot is None):
        raise FindingsError("expected exactly one of --run DIR or --snapshot FILE")
    try:
        if snapshot is not None:
            store = Store.open_snapshot(snapshot)
            return [Source(_meta_run_id(store, Path(snapshot).stem), store)]
        path = Path(str(run))
        if not path.exists():
            raise FindingsError(f"--run {path}: no such file or directory")
        if path.is_dir():
            sources = _run_dir_sources(path)
        else:
            sources = [Source(_file_run_id(path), Store.open_run(path))]
        ready = [s for s in sources if s.store.ready()]
    except StoreError as exc:
        raise FindingsError(str(exc)) from None
    if not ready:
        raise FindingsError(f"--run {run}: no store yet (nothing written to this run); expected a run "
                            "directory that probes.watch() or modscope run wrote to")
    return ready


def _run_dir_sources(d: Path) -> list[Source]:
    legacy = d / LEGACY_STORE_FILENAME
    found = []
    for p in sorted(d.iterdir()):
        name = parse_store_filename(p.name)
        if name is not None and p.is_file():
            found.append((name.run_id, name.rank, p))
    if legacy.is_file():
        found.append(("", 0, legacy))
    return [Source(run_id, Store.open_run(p)) for run_id, _, p in sorted(found, key=lambda t: (t[0], t[1]))]


def _file_run_id(p: Path) -> str:
    name = parse_store_filename(p.name)
    return name.run_id if name is not None else ""


def _meta_run_id(store: Store, default: str) -> str:
    try:
        value = store.meta().get("run_id")
    except StoreError:
        return default
    return str(value) if value else default


def collect(sources: Sequence[Source], rank: int | None = None) -> list[dict[str, Any]]:
    """The active findings as JSON-ready dicts: ``code severity path message fix ranks steps cause
    run``, one per (run, code, path) with the ranks that report it; most severe first.

    ``rank``: only that rank's findings (FindingsError when no store holds that rank)."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    seen_ranks: set[int] = set()
    for src in sources:
        try:
            ranks = src.store.ranks()
            seen_ranks.update(ranks)
            for r in ranks:
                if rank is not None and r != rank:
                    continue
                for f in src.store.findings(r, active=True):
                    _merge(merged, src.run_id, r, f)
        except StoreError as exc:
            raise FindingsError(str(exc)) from None
    if rank is not None and rank not in seen_ranks:
        raise FindingsError(f"--rank {rank}: no such rank in this run; expected one of "
                            f"{', '.join(str(r) for r in sorted(seen_ranks))}")
    out = list(merged.values())
    out.sort(key=lambda f: (SEVERITY_ORDER.get(f["severity"], 9), f["run"], f["path"], f["code"]))
    return out


def _merge(merged: dict[tuple[str, str, str], dict[str, Any]], run_id: str, rank: int, f: dict[str, Any]) -> None:
    key = (run_id, str(f["code"]), str(f["path"]))
    first, last, count = f.get("first_step"), f.get("last_step"), int(f.get("count") or 1)
    have = merged.get(key)
    if have is None:
        cause = {"code": f["cause_code"], "path": f.get("cause_path")} if f.get("cause_code") else None
        merged[key] = {
            "code": str(f["code"]), "severity": str(f["severity"]), "path": str(f["path"]),
            "message": f.get("message"), "fix": f.get("fix"), "ranks": [rank],
            "steps": {"first": first, "last": last, "count": count}, "cause": cause, "run": run_id,
        }
        return
    have["ranks"] = sorted({*have["ranks"], rank})
    if SEVERITY_ORDER.get(f["severity"], 9) < SEVERITY_ORDER.get(have["severity"], 9):
        have["severity"] = str(f["severity"])
    steps = have["steps"]
    steps["first"] = _opt(min, steps["first"], first)
    steps["last"] = _opt(max, steps["last"], last)
    steps["count"] += count


def _opt(pick: Any, a: int | None, b: int | None) -> int | None:
    values = [v for v in (a, b) if v is not None]
    return pick(values) if values else None


def exit_status(findings: Iterable[dict[str, Any]], fail_on: str | None) -> int:
    """1 when a finding at ``fail_on`` or worse exists (``error`` < ``warning`` < ``info``), else 0."""
    if fail_on is None:
        return 0
    limit = SEVERITY_ORDER[Severity(fail_on)]
    return 1 if any(SEVERITY_ORDER.get(f["severity"], 9) <= limit for f in findings) else 0


def format_json(findings: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(findings), indent=2)


def format_text(findings: Sequence[dict[str, Any]], where: str) -> str:
    """One block per finding (severity, code, path, ranks and steps; the message; the fix), after a
    one-line count."""
    counts = {level: sum(1 for f in findings if f["severity"] == level) for level in LEVELS}
    runs = sorted({f["run"] for f in findings})
    head = ", ".join(f"{n} {level}{'s' if n != 1 and level != 'info' else ''}" for level, n in counts.items())
    lines = [f"{where}: {head}" + (f" in {len(runs)} runs" if len(runs) > 1 else "")]
    if not findings:
        lines[0] = f"{where}: no active findings"
    for f in findings:
        steps = f["steps"]
        span = "" if steps["first"] is None else (
            f"step {steps['first']}" if steps["first"] == steps["last"] else f"steps {steps['first']}-{steps['last']}")
        ranks = f"rank{'s' if len(f['ranks']) > 1 else ''} {','.join(str(r) for r in f['ranks'])}"
        where_run = f"run {f['run']}, " if len(runs) > 1 else ""
        lines.append(f"{f['severity']:<8}{f['code']}  {display_path(f['path'])}  ({where_run}{ranks}"
                     f"{', ' + span if span else ''})")
        lines.append(f"        {f['message']}")
        if f.get("cause"):
            lines.append(f"        caused by: {f['cause']['code']} at {display_path(f['cause']['path'] or '')}")
        if f.get("fix"):
            lines.append(f"        fix: {f['fix']}")
    return "\n".join(lines)
