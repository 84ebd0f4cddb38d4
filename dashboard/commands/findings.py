"""``modscope findings``: the active findings of a run or a snapshot, as text or JSON, and the
exit status a CI job fails on.

Plain functions over plain data: :func:`open_runs` opens the runs (:class:`dashboard.read.run.RunDir`, the
dashboard's reader: every rank file of a run read as one run), :func:`collect` turns their findings,
merged over the ranks and with the cross-rank findings (``rank-divergence``, ``rank-straggler``), into
JSON-ready dicts, :func:`exit_status` applies ``--fail-on`` and :func:`format_text` / :func:`format_json`
print.

A run directory can hold several runs (every ``probes.watch()`` is a run of its own: a GAN watched
by ``modscope run`` writes two): every run in it is read, and each finding names its run.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from probes.schema import SEVERITY_ORDER, Severity, count_text, display_path, printable

from ..read.caps import FindingsCap, findings_cap
from ..read.run import Run, RunDir, merge_findings
from ..read.run_folders import run_folders, run_folders_text
from ..read.store import StoreError
from .args import ABOUT, Parser, check_store_target, fail

LEVELS = tuple(str(s) for s in SEVERITY_ORDER)          # error, warning, info: worst first


class FindingsError(Exception):
    """A store that cannot be read, or an argument that does not fit it: one line."""


def open_runs(*, run: str | os.PathLike[str] | None = None,
              snapshot: str | os.PathLike[str] | None = None) -> list[Run]:
    """The runs to read: every run of a run directory (or the one store file named), or a snapshot (a
    directory: its runs, read-only, as ``serve`` and ``export`` take it).
    Raises FindingsError naming the path when there is nothing readable."""
    if (run is None) == (snapshot is None):
        raise FindingsError("expected exactly one of --run DIR or --snapshot FILE")
    flag, target = ("--snapshot", snapshot) if snapshot is not None else ("--run", run)
    path = Path(str(target))
    if not path.exists():
        raise FindingsError(f"{flag} {path}: no such file or directory")
    try:
        source = RunDir.open(path, live=snapshot is None)
        runs = [source.run(info.key, strict=True) for info in source.runs()]
        ready = [r for r in runs if r.ready()]
    except StoreError as exc:
        raise FindingsError(str(exc)) from None
    folders = run_folders(path) if snapshot is None else []
    if not ready and folders:
        raise FindingsError(run_folders_text(flag, path, folders, "modscope findings"))
    if not ready:
        raise FindingsError(f"{flag} {path}: no store yet (nothing written to this run); expected a run "
                            "directory that probes.watch() or modscope run wrote to")
    return ready


def collect(runs: Sequence[Run], rank: int | None = None) -> list[dict[str, Any]]:
    """The active findings as JSON-ready dicts: ``code severity path message fix ranks steps cause
    run``, one per (run, code, path) with the ranks that report it; most severe first.

    ``rank``: only that rank's own findings, and the cross-rank ones it takes part in (FindingsError
    when no run has that rank)."""
    out: list[dict[str, Any]] = []
    seen_ranks: set[int] = set()
    try:
        for run in runs:
            ranks = run.ranks()
            seen_ranks.update(ranks)
            if rank is None:
                rows = run.findings_merged(active=True)
            elif rank in ranks:
                rows = merge_findings({rank: run.at(rank).findings(rank, active=True)})
                rows += [f for f in run.cross_rank_findings() if rank in f["ranks"]]
            else:
                continue
            name = run.run_id() or run.label_id()
            out += [_as_json(f, name) for f in rows]
    except StoreError as exc:
        raise FindingsError(str(exc)) from None
    if rank is not None and rank not in seen_ranks:
        raise FindingsError(f"--rank {rank}: no such rank in this run; expected one of "
                            f"{', '.join(str(r) for r in sorted(seen_ranks))}")
    out.sort(key=lambda f: (SEVERITY_ORDER.get(f["severity"], 9), f["run"], f["path"], f["code"]))
    return out


def _as_json(f: Mapping[str, Any], run_id: str) -> dict[str, Any]:
    cause = {"code": f["cause_code"], "path": f.get("cause_path")} if f.get("cause_code") else None
    return {"code": str(f["code"]), "severity": str(f["severity"]), "path": str(f["path"]),
            "message": f.get("message"), "fix": f.get("fix"), "ranks": sorted(int(r) for r in f["ranks"]),
            "steps": {"first": f.get("first_step"), "last": f.get("last_step"), "count": int(f.get("count") or 1)},
            "cause": cause, "run": run_id}


def cap_notes(runs: Sequence[Run], rank: int | None = None) -> list[str]:
    """One line per run whose findings were more than a read takes (caps.py): how many more there were."""
    notes = []
    try:
        for run in runs:
            cap = findings_cap(run)
            if cap is not None and rank is not None:
                cap = FindingsCap(cap.limit, {r: n for r, n in cap.totals.items() if r == rank}) \
                    if rank in cap.totals else None
            if cap is not None:
                notes.append(printable(f"{cap.text()}" + (f" (run {run.run_id() or run.label_id()})"
                                                            if len(runs) > 1 else "")))
    except StoreError as exc:
        raise FindingsError(str(exc)) from None
    return notes


def exit_status(findings: Iterable[dict[str, Any]], fail_on: str | None) -> int:
    """1 when a finding at ``fail_on`` or worse exists (``error`` < ``warning`` < ``info``), else 0."""
    if fail_on is None:
        return 0
    limit = SEVERITY_ORDER[Severity(fail_on)]
    return 1 if any(SEVERITY_ORDER.get(f["severity"], 9) <= limit for f in findings) else 0


def format_json(findings: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(findings), indent=2)


def format_text(findings: Sequence[dict[str, Any]], where: str, notes: Sequence[str] = ()) -> str:
    """One block per root cause (severity, code, path, ranks and steps; the message; the fix), with one line
    per finding it explains under it (the layers of a plain list do not update *because* they are
    unregistered: the fix is the cause's), after a one-line count (``schema.count_text``: root causes by
    severity, then the consequences) and the ``notes`` (cap_notes)."""
    runs = sorted({f["run"] for f in findings})
    keys = {(f["run"], f["code"], f["path"]) for f in findings}

    def cause_key(f: Mapping[str, Any]) -> tuple[str, str, str] | None:
        c = f.get("cause")
        key = (f["run"], c["code"], c["path"] or "") if c else None
        return key if key in keys else None
    explained: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for f in findings:
        if (key := cause_key(f)) is not None:
            explained.setdefault(key, []).append(dict(f))
    roots = [f for f in findings if cause_key(f) is None]
    counts = {level: sum(1 for f in roots if f["severity"] == level) for level in LEVELS}
    head = count_text(counts, len(findings) - len(roots))        # as the dashboard and `modscope run` count
    lines = [f"{where}: {head}" + (f" in {len(runs)} runs" if len(runs) > 1 else "")]
    if not findings:
        lines[0] = f"{where}: no active findings"
    lines += [f"note: {n}" for n in notes]

    def span(f: Mapping[str, Any]) -> str:
        steps = f["steps"]
        return "" if steps["first"] is None else (
            f"step {steps['first']}" if steps["first"] == steps["last"] else f"steps {steps['first']}-{steps['last']}")
    for f in roots:
        ranks = f"rank{'s' if len(f['ranks']) > 1 else ''} {','.join(str(r) for r in f['ranks'])}"
        where_run = f"run {f['run']}, " if len(runs) > 1 else ""
        lines.append(f"{f['severity']:<8}{f['code']}  {display_path(f['path'])}  ({where_run}{ranks}"
                     f"{', ' + span(f) if span(f) else ''})")
        lines.append(f"        {f['message']}")
        if f.get("cause"):           # its cause is not active any more
            lines.append(f"        caused by: {f['cause']['code']} at {display_path(f['cause']['path'] or '')}")
        if f.get("fix"):
            lines.append(f"        fix: {f['fix']}")
        for c in explained.get((f["run"], f["code"], f["path"]), []):
            lines.append(f"        explains: {c['severity']} {c['code']}  {display_path(c['path'])}"
                         f"{'  (' + span(c) + ')' if span(c) else ''}")
    return "\n".join(printable(line) for line in lines)      # names and messages are the model's, or a store's


def findings_main(argv: Sequence[str], prog: str = "modscope") -> int:
    """Print the active findings; 1 when one at ``--fail-on`` or worse exists, 2 when the store
    cannot be read."""
    p = Parser(prog=f"{prog} findings", description=ABOUT["findings"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory (every run in it) or one store file")
    src.add_argument("--snapshot", metavar="FILE", help="a snapshot file")
    p.add_argument("--rank", type=int, default=None, help="only this rank (default: every rank, merged)")
    p.add_argument("--json", action="store_true", help="a JSON list of objects (code, severity, path, message, "
                                                       "fix, ranks, steps, cause, run)")
    p.add_argument("--fail-on", choices=LEVELS, default=None, metavar="LEVEL",
                   help="exit 1 when a finding at LEVEL (error, warning or info) or worse exists")
    args = p.parse_args(list(argv))
    for option, value in (("--run", args.run), ("--snapshot", args.snapshot)):
        if value is not None:
            check_store_target(option, value)
    try:
        runs = open_runs(run=args.run, snapshot=args.snapshot)
        found, notes = collect(runs, rank=args.rank), cap_notes(runs, rank=args.rank)
    except FindingsError as exc:
        fail(str(exc))
    print(format_json(found) if args.json else format_text(found, str(args.run or args.snapshot), notes))
    if args.json and notes:
        print("\n".join(f"modscope: note: {n}" for n in notes), file=sys.stderr)     # stdout stays JSON
    return exit_status(found, args.fail_on)
