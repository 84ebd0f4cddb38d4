"""Runs: the rank files of one run read as one, and the runs of a run directory.

A run directory holds one store per (run, rank) (``modscope-<run id>-rank<R>.sqlite``): every
``probes.watch()`` is a run of its own (sequential trainings), and the ranks of one distributed job
share its run id. :class:`RunDir` is what the dashboard opened: a run directory (its runs, listed
newest first and followed while they are written) or one store file (a version-1 run's
``modscope.sqlite`` holding every rank, a snapshot, one rank's file). :class:`Run` is one run: its
files, each rank's queries routed to the :class:`~dashboard.read.store.Store` holding that rank, and the
views the pages need merged over the ranks: the per-rank overview rows (with the writer's health),
the findings listed once with the ranks they occur on, the findings no single process sees
(:mod:`dashboard.read.crossrank`), root causes with their consequences folded under them, and a snapshot
of every rank as one file. Rows of two runs are never mixed: a :class:`Run` only reads its own files.

Plain data in and out (dicts, lists, small frozen dataclasses); no SQL here (dashboard/read/store.py holds
all of it), no Dash, no torch. ``modscope findings`` calls :meth:`Run.findings_merged`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from probes.schema import RunStatus

from . import crossrank
from .compare import compare_stores
from .crossrank import format_ranks
from .run_scan import FILE_KEY, MAX_RUNS, RunEntry, scan_runs
from .run_state import RunHealth, RunInfo, finding_order, merge_findings, or_default, others_note, run_status
from .store import (
    MAX_FINDINGS,
    Heartbeat,
    Liveness,
    Row,
    Store,
    StoreError,
    StoreNotReadyError,
    fold_causes,
    in_wal_mode,
    liveness,
    process_alive,
    root_counts,
    snapshot_bytes,
    snapshot_liveness,
    snapshot_with_step,
    status_text,
    writer_present,
)

__all__ = ["NEWEST", "Run", "RunDir", "RunEntry", "RunHealth", "RunInfo", "as_run_dir", "compare_runs", "fold_causes",
           "format_ranks", "merge_findings", "others_note", "root_counts", "scan_runs"]

NEWEST = "@newest"              # the run selector's "follow the newest run" (never a run id: those start alnum)
MAX_RANK_COLUMNS = 16           # ranks side by side in the module detail
CROSSRANK_INTERVAL_S = 2.0      # the cross-rank comparison runs again at most this often while a run is written


# -- the files of a directory ---------------------------------------------------------------------------








# -- findings across ranks ---------------------------------------------------------------------------------








# -- plain results ------------------------------------------------------------------------------------










# -- one run ---------------------------------------------------------------------------------------------
class Run:
    """The rank files of one run (or one file holding several ranks), read as one.

    Each rank's queries go to the store holding it (:meth:`at`); the merged views are below. A rank
    file that cannot be read is left out (and named in :meth:`health`'s warnings) while another rank
    can be read; when none can, its one-line error is raised."""

    def __init__(self, source: RunDir, entry: RunEntry) -> None:
        self._source = source
        self.entry = entry
        self._lock = threading.Lock()
        self._cross: tuple[tuple[Any, ...], float, list[Row]] | None = None
        self._merged: dict[tuple[Any, ...], list[Row]] = {}
        self.problems: dict[Path, str] = {}

    def __repr__(self) -> str:
        return f"Run(key={self.key!r}, files={[str(f) for f in self.files]})"

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def files(self) -> tuple[Path, ...]:
        return self.entry.files

    @property
    def where(self) -> Path:
        return self._source.where

    @property
    def live(self) -> bool:
        return self._source.live

    def refresh(self, entry: RunEntry) -> None:
        """The directory listing saw this run again (a rank file may have appeared)."""
        with self._lock:
            self.entry = entry

    # -- routing ----------------------------------------------------------------------------
    def _routing(self) -> dict[int, Store]:
        route: dict[int, Store] = {}
        problems: dict[Path, str] = {}
        first_error: StoreError | None = None
        for path, file_rank in zip(self.entry.files, self.entry.file_ranks, strict=True):
            try:
                store = self._source.store(path)
                if not store.ready():
                    continue
                ranks = [file_rank] if file_rank is not None else store.ranks()
            except StoreNotReadyError:
                continue
            except StoreError as exc:
                problems[path] = str(exc)
                first_error = first_error or exc
                continue
            for r in ranks:
                route.setdefault(r, store)
        self.problems = problems
        if not route and first_error is not None:
            raise first_error
        return route

    def ready(self) -> bool:
        """True once one of its files holds a readable store (raises its error when none can be read)."""
        return bool(self._routing())

    def stores(self) -> dict[int, Store]:
        """rank -> the store holding it (StoreNotReadyError before the first one exists)."""
        route = self._routing()
        if not route:
            raise StoreNotReadyError(f"{self.where}: waiting for the first sample")
        return dict(sorted(route.items()))

    def ranks(self) -> list[int]:
        return list(self.stores())

    def view_rank(self, rank: int | None = None) -> int:
        """``rank`` when this run has it, else its lowest rank."""
        ranks = self.ranks()
        return rank if rank is not None and rank in ranks else ranks[0]

    def at(self, rank: int) -> Store:
        """The store holding ``rank``."""
        route = self.stores()
        if rank not in route:
            raise StoreError(f"{self.where}: rank {rank} is not in run {self.label_id()} "
                             f"(it has {format_ranks(route)})")
        return route[rank]

    def label_id(self) -> str:
        return self.entry.run_id or self.key.removeprefix(FILE_KEY)

    # -- run level ---------------------------------------------------------------------------
    def meta(self) -> Row:
        stores = self.stores()
        return stores[min(stores)].meta()

    def run_id(self) -> str | None:
        """The run id: the file names' (the writer's), else what the store's meta says."""
        if self.entry.run_id:
            return self.entry.run_id
        value = self.meta().get("run_id")
        return str(value) if value else None

    def info(self, now: float | None = None) -> RunInfo:
        """The run selector's line: run id, name, start time, ranks, status."""
        try:
            route = self.stores()
        except StoreNotReadyError:
            return RunInfo(self.key, self.entry.run_id, None, None,
                           tuple(r for r in self.entry.file_ranks if r is not None), "starting")
        meta = route[min(route)].meta()
        states = self.states(now)
        started = meta.get("created_at")
        return RunInfo(self.key, self.run_id(), meta.get("run_name"),
                       float(started) if isinstance(started, (int, float)) else None, tuple(route), run_status(states))

    def states(self, now: float | None = None, beats: Mapping[int, Heartbeat] | None = None) -> dict[int, Liveness]:
        """Each rank's writer: running, closed, stalled (no heartbeat for max(2 min, 5 median steps), or
        max(30 s, 5 median steps) behind the other ranks' newest heartbeat) or ended without close (its
        process is gone, known on its own host only). A snapshot says what it recorded."""
        route = self.stores()
        now = time.time() if now is None else now
        if beats is None:
            beats = {r: s.heartbeat(r) for r, s in route.items()}
        out: dict[int, Liveness] = {}
        for r, beat in beats.items():
            store = route[r]
            if not store.live:
                out[r] = snapshot_liveness(beat)
                continue
            others = [b.updated_at for k, b in beats.items()
                      if k != r and b.updated_at is not None and b.status == RunStatus.RUNNING]
            behind = max(others) - beat.updated_at if others and beat.updated_at is not None else None
            out[r] = liveness(beat, now=now, alive=process_alive(beat.pid, beat.hostname), behind_s=behind)
        return out

    def health(self, now: float | None = None) -> RunHealth:
        """States, failed commits and warnings of every rank (what the poll shows)."""
        route = self.stores()
        beats = {r: s.heartbeat(r) for r, s in route.items()}
        states = self.states(now, beats)
        troubles = []
        for r, store in route.items():
            t = store.write_trouble(r)
            if t is not None:
                troubles.append((r, t))
        warnings = [f"{path.name}: left out ({problem})" for path, problem in self.problems.items()]
        warnings += sorted({s.schema_note for s in route.values() if s.schema_note})    # objects ignored (store_guard)
        if self.live:
            me = socket.gethostname()
            seen: set[Path] = set()
            for r, store in route.items():
                if store.path in seen:
                    continue
                seen.add(store.path)
                host = beats[r].hostname
                if host and host != me and in_wal_mode(store.path):
                    warnings.append(
                        f"rank {r} is written on {host} in WAL mode: WAL's shared-memory index is not shared "
                        "between hosts, so what this dashboard reads of that rank may be inconsistent (its "
                        "writer uses the rollback journal on network filesystems and in multi-node jobs: "
                        "MODSCOPE_JOURNAL=delete)")
        return RunHealth(states, troubles, warnings)

    def change_signature(self, rank: int) -> tuple[Any, ...]:
        """What live polling compares: the view rank's own signature, every rank's findings and progress."""
        route = self.stores()
        findings = tuple(x for r, s in route.items() for x in s.findings_signature(r))
        progress = tuple(x for r, s in route.items() if r != rank for x in (r, or_default(s.last_step(r), -1)))
        return route[rank].change_signature(rank), findings, progress

    def rank_rows(self, now: float | None = None) -> list[Row]:
        """The Overview's per-rank table: step, median step time of the recent steps, overhead, samples
        stored and dropped, failed commits, host, and the writer's state."""
        route = self.stores()
        states = self.states(now)
        rows = []
        for r, store in route.items():
            row = store.rank_summary(r)
            life = states[r]
            row.update(state=str(life.state), status_text=status_text(life))
            rows.append(row)
        return rows

    def overview(self, rank: int | None = None) -> Row:
        """The view rank's overview, with the run's identity, its ranks and its root causes by severity
        (merged over the ranks, with the cross-rank findings)."""
        view = self.view_rank(rank)
        route = self.stores()
        ov = route[view].overview(view)
        merged = self.findings_merged(active=True, rank=view)
        ov.update(run_key=self.key, run_id=self.run_id(), ranks=list(route), rank_count=len(route),
                  root_causes=root_counts(fold_causes(merged)), findings_total=len(merged),
                  findings_merged=root_counts(merged))
        return ov

    # -- findings ------------------------------------------------------------------------------
    def cross_rank_findings(self) -> list[Row]:
        """rank-divergence and rank-straggler, computed here from every rank's stored values; computed
        again when a rank has a new step, at most every ``crossrank_interval_s`` while a run is written."""
        route = self.stores()
        if len(route) < 2:
            return []
        key = tuple((r, s.last_step(r)) for r, s in route.items())
        with self._lock:
            cached = self._cross
        now = time.monotonic()
        if cached is not None and (cached[0] == key or now - cached[1] < self._source.crossrank_interval_s):
            return cached[2]
        found = crossrank.cross_rank_findings(route)
        with self._lock:
            self._cross = (key, now, found)
        return found

    def findings_merged(self, active: bool | None = True, *, rank: int | None = None, cross_rank: bool = True,
                        limit: int = MAX_FINDINGS) -> list[Row]:
        """Every finding of the run once, with the ranks it occurs on: ``code severity path message fix
        evidence ranks first_step last_step count active cause_code cause_path``, plus ``module_id`` /
        ``module_path`` (the module it is drawn on, on ``rank``: the view rank, default the lowest) and
        ``run_id``; the cross-rank findings (``cross_rank: True``) included. Worst first.

        ``active``: True for current findings (what ``modscope findings`` prints), False for resolved
        ones, None for both."""
        route = self.stores()
        view = self.view_rank(rank)
        cross = self.cross_rank_findings() if cross_rank and active is not False else []
        key = (active, view, limit, tuple(x for r, s in route.items() for x in s.findings_signature(r)),
               id(cross), len(route))
        with self._lock:
            hit = self._merged.get(key)
        if hit is not None:
            return [dict(f) for f in hit]
        merged = merge_findings({r: s.findings(r, active=active, limit=limit) for r, s in route.items()})
        merged += [dict(f, module_ids={}) for f in cross]
        store = route[view]
        missing = [f["path"] for f in merged if f["module_ids"].get(view) is None]
        found = store.modules_for_paths(view, missing) if missing else {}
        run_id = self.run_id()
        for f in merged:
            own = f["module_ids"].get(view)
            if own is not None:
                f["module_id"] = own    # module_path: the lowest rank's (a path is the same module on every rank)
            else:
                m = found.get(f["path"])
                f["module_id"], f["module_path"] = (m["module_id"], m["path"]) if m else (None, None)
                f["module_removed_step"] = m.get("removed_step") if m else None
            f["run_id"] = run_id
            f.pop("module_ids", None)
            f.setdefault("cross_rank", False)
        merged.sort(key=finding_order)
        with self._lock:
            if len(self._merged) > 16:
                self._merged.clear()
            self._merged[key] = merged
        return [dict(f) for f in merged]

    def folded_findings(self, active: bool | None = True, *, rank: int | None = None) -> list[Row]:
        """:meth:`findings_merged` with the consequences folded under their root causes."""
        return fold_causes(self.findings_merged(active, rank=rank))

    # -- module detail ----------------------------------------------------------------------------
    def local_grad_norms(self, rank: int, module_id: int) -> Row:
        """The module's tensors' gradients before the all-reduce, one column per rank (the module found
        by its path on every rank, removed at the same step if it was removed): ``{"ranks", "steps":
        {rank: step}, "rows": [{"name", "path", "values": {rank: norm}}], "more_ranks"}``."""
        route = self.stores()
        m = route[rank].module(rank, module_id) if rank in route else None
        if m is None:
            return {"ranks": [], "steps": {}, "rows": [], "more_ranks": 0}
        ranks = list(route)[:MAX_RANK_COLUMNS]
        rows: dict[str, Row] = {}
        steps: dict[int, int | None] = {}
        for r in ranks:
            store = route[r]
            mr = m if r == rank else store.module_like(r, m["path"], m.get("removed_step"))
            if mr is None:
                continue
            for p in store.module_params(r, mr["module_id"]):
                row = rows.setdefault(p["name"], {"name": p["name"], "path": p["path"], "values": {}})
                row["values"][r] = p["local_grad_norm"]
                if p.get("stat_step") is not None:
                    steps[r] = max(steps.get(r) or 0, int(p["stat_step"]))
        return {"ranks": ranks, "steps": steps, "rows": list(rows.values()), "more_ranks": len(route) - len(ranks)}

    # -- snapshots ----------------------------------------------------------------------------------
    def snapshot_files(self) -> list[Path]:
        """The files a snapshot of this run copies: every readable file of it, in rank order."""
        out: list[Path] = []
        for _, store in self.stores().items():
            if store.path not in out:
                out.append(store.path)
        return out

    def snapshot_bytes(self) -> bytes:
        """Every rank of this run as one consistent file (``probes.schema.snapshot`` of its rank files)."""
        return snapshot_bytes(self.snapshot_files())

    def snapshot_with_step(self, rank: int | None = None) -> tuple[bytes, int | None]:
        """:meth:`snapshot_bytes` and the newest step of ``rank`` (default the lowest) in that copy."""
        return snapshot_with_step(self.snapshot_files(), self.view_rank(rank))


# -- what the dashboard opened ------------------------------------------------------------------------------
class RunDir:
    """A run directory (its runs, newest first; followed while written) or one store file.

    ``live``: the files may still be written (opened read-only, never immutable); otherwise a file is
    opened immutable unless a writer may be at it (``writer_present``). Store objects are kept per file,
    Run objects per run key; the listing is read again on every call (one ``scandir``)."""

    def __init__(self, target: str | os.PathLike[str], *, live: bool, timeout_s: float = 5.0,
                 crossrank_interval_s: float = CROSSRANK_INTERVAL_S, seed: Store | None = None) -> None:
        self.where = Path(target)
        self.live = live
        self.timeout_s = timeout_s
        self.crossrank_interval_s = crossrank_interval_s
        self._lock = threading.Lock()
        self._stores: dict[Path, Store] = {}
        self._runs: dict[str, Run] = {}
        if seed is not None:
            self._stores[seed.path] = seed

    def __repr__(self) -> str:
        return f"RunDir({str(self.where)!r}, live={self.live})"

    @classmethod
    def from_store(cls, store: Store, **kw: Any) -> RunDir:
        """What the command line opened as a Store: its run directory when it follows (or reviews) one,
        else its file."""
        target = store.run_dir if store.run_dir is not None else store.path
        return cls(target, live=store.live, timeout_s=store.timeout_s, seed=store, **kw)

    @classmethod
    def open(cls, target: str | os.PathLike[str], *, live: bool = True, **kw: Any) -> RunDir:
        """A run directory or a store file, for ``modscope findings`` and tests: ``RunDir.open(p).runs()``
        lists the runs, ``.run(key)`` opens one."""
        return cls(target, live=live, **kw)

    @property
    def path(self) -> Path:
        return self.where

    def store(self, path: Path) -> Store:
        """The (one) Store of ``path``."""
        with self._lock:
            store = self._stores.get(path)
        if store is None:
            store = Store(path, live=self.live or writer_present(path) or not path.exists(), timeout_s=self.timeout_s)
            with self._lock:
                store = self._stores.setdefault(path, store)
        return store

    def entries(self) -> list[RunEntry]:
        return scan_runs(self.where)

    def run(self, key: str | None = None, *, strict: bool = False) -> Run:
        """The run ``key`` (a run id or a file key); the newest for None, ``NEWEST`` or (unless
        ``strict``: then StoreError naming it) a key that is not (or no longer) there. A directory with
        no store yet gives an empty run (not ready)."""
        entries = self.entries()
        entry = next((e for e in entries if e.key == key), None) if key not in (None, NEWEST) else None
        if entry is None and strict and key not in (None, NEWEST):
            have = ", ".join(e.key for e in entries) or "none yet"
            raise StoreError(f"{self.where}: no run {key!r} here (runs: {have})")
        if entry is None:
            entry = entries[0] if entries else RunEntry("", None, (), (), 0.0)
        with self._lock:
            run = self._runs.get(entry.key)
            if run is None:
                run = self._runs[entry.key] = Run(self, entry)
                if len(self._runs) > 4 * MAX_RUNS:
                    self._runs = {entry.key: run}
        if run.entry != entry:
            run.refresh(entry)
        return run

    def runs(self, now: float | None = None) -> list[RunInfo]:
        """Every run, newest first, described (run id, name, start time, ranks, status); a run whose
        files cannot be read says so in its status."""
        out = []
        for entry in self.entries():
            run = self.run(entry.key)
            try:
                out.append(run.info(now))
            except StoreError as exc:
                out.append(RunInfo(entry.key, entry.run_id, None, None,
                                   tuple(r for r in entry.file_ranks if r is not None), f"unreadable: {exc}"))
        return out

    def ready(self) -> bool:
        return self.run().ready()


# -- compare ------------------------------------------------------------------------------------------
def compare_runs(a: Run, b: Run, rank: int | None = None) -> Row:
    """The "before / after" table of two runs: each one's ``rank`` (default its lowest) for the tree,
    the statistics and the checkpoint keys, and each run's findings merged over its ranks."""
    ra, rb = a.view_rank(rank), b.view_rank(rank)
    return compare_stores(a.at(ra), b.at(rb), ra, rank_b=rb,
                          findings_a=a.findings_merged(active=True, rank=ra),
                          findings_b=b.findings_merged(active=True, rank=rb))


def as_run_dir(target: Store | RunDir) -> RunDir:
    return target if isinstance(target, RunDir) else RunDir.from_store(target)

