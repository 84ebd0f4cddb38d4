"""The queries about the run: its overview and loss, probe errors, and what ranks compare."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from probes.schema import (
    ModuleKind,
    RunStatus,
    Severity,
    TensorKind,
)

from .connection import MAX_POINTS, MAX_STEP_LIST, MAX_TENSORS, RECENT_STEPS, REMOVED, Row, _finite, _int, _loads
from .errors import StoreNotReadyError
from .files import snapshot_bytes
from .finding_queries import FindingQueries
from .liveness import CloseValues


class RunQueries(FindingQueries):
    def overview(self, rank: int = 0) -> Row:
        meta = self.meta()
        rkd = self._rank_row(rank)
        steps = self._one("SELECT COUNT(*) AS n, MAX(step) AS last, SUM(sampled) AS sampled, "
                          "SUM(probe_ms) AS probe_ms, SUM(step_ms) AS step_ms "
                          "FROM steps WHERE rank = ?", (rank,))
        sev = {str(s): 0 for s in Severity}
        for r in self._query("SELECT severity, COUNT(*) AS n FROM findings "
                             "WHERE rank = ? AND active = 1 GROUP BY severity LIMIT 10",
                             (rank,), limit=10):
            sev[r["severity"]] = r["n"]
        # the model as it is now: modules and tensors that left it are counted apart
        mods = {r["kind"]: r["n"] for r in self._query(
            f"SELECT CASE WHEN {self._current('modules')} THEN kind ELSE '{REMOVED}' END AS kind, COUNT(*) AS n "
            "FROM modules WHERE rank = ? GROUP BY 1 LIMIT 10", (rank,), limit=10)}
        params = self._one(
            f"SELECT COALESCE(SUM(CASE WHEN kind = '{TensorKind.PARAMETER}' THEN numel END), 0) AS total, "
            f"COALESCE(SUM(CASE WHEN kind = '{TensorKind.PARAMETER}' AND requires_grad = 1 THEN numel END), 0) "
            "AS trainable, "
            "COALESCE(SUM(CASE WHEN in_optimizer = 1 THEN numel END), 0) AS in_optimizer, "
            f"COALESCE(SUM(CASE WHEN kind = '{TensorKind.TENSOR}' THEN numel END), 0) AS unregistered, "
            "COALESCE(SUM(in_state_dict), 0) AS state_dict_tensors "
            f"FROM params WHERE rank = ? AND {self._current('params')}", (rank,))
        root = self._one("SELECT type FROM modules WHERE rank = ? AND parent_id IS NULL "
                         "ORDER BY module_id LIMIT 1", (rank,))
        overhead = rkd.get("overhead")
        if overhead is None and steps and steps["step_ms"]:
            overhead = (steps["probe_ms"] or 0.0) / steps["step_ms"]
        samples_stored = steps["sampled"] if steps and steps["sampled"] is not None else 0
        return {
            "path": str(self.path),
            "rank": rank,
            "live": self.live,
            "run_name": meta.get("run_name") or self.path.parent.name,
            "created_at": meta.get("created_at"),
            "model_class": rkd.get("model_class") or (root["type"] if root else None),
            "torch_version": rkd.get("torch_version"),
            "device": rkd.get("device"),
            "sampling": _loads(rkd.get("sampling"), rkd.get("sampling")),
            "status": rkd.get("status"),
            "world_size": rkd.get("world_size") or 1,
            # the newest step row (what the header says); the writer's counter before the first one
            "step": steps["last"] if steps and steps["last"] is not None else rkd.get("step"),
            "steps_recorded": steps["n"] if steps else 0,
            "samples_stored": samples_stored,
            "samples_written": rkd.get("samples_written", 0),
            "samples_dropped": rkd.get("samples_dropped", 0),
            "probe_errors": rkd.get("probe_errors", 0),
            "write_errors": rkd.get("write_errors", 0),
            "last_error": rkd.get("last_error"),
            "overhead": _finite(overhead),
            "findings": sev,
            "modules": {str(k): mods.get(str(k), 0) for k in ModuleKind},
            "modules_removed": mods.get(REMOVED, 0),       # no longer part of the model (removed or replaced)
            "params": dict(params) if params else {},
            "started_at": rkd.get("started_at"),
            "updated_at": rkd.get("updated_at"),
            "closed_at": rkd.get("closed_at"),
            "pid": rkd.get("pid"),
            "hostname": rkd.get("hostname"),
        }

    def loss_series(self, rank: int = 0, since_step: int | None = None, max_points: int = MAX_POINTS) -> Row:
        """Loss per step. With ``since_step``: only newer steps (live polling), raw.
        Otherwise downsampled to ``max_points`` buckets (mean loss per bucket)."""
        if since_step is not None:
            rows = self._query("SELECT step, loss FROM steps WHERE rank = ? AND step > ? "
                               "AND loss IS NOT NULL ORDER BY step LIMIT ?",
                               (rank, since_step, max_points), limit=max_points)
            return {"step": [r["step"] for r in rows], "loss": [_finite(r["loss"]) for r in rows],
                    "last": rows[-1]["step"] if rows else since_step}
        rng = self._one("SELECT COUNT(*) AS n, MIN(step) AS lo, MAX(step) AS hi FROM steps "
                        "WHERE rank = ? AND loss IS NOT NULL", (rank,))
        if not rng or not rng["n"]:
            return {"step": [], "loss": [], "last": self.last_step(rank)}
        bucket = max(1, math.ceil((rng["hi"] - rng["lo"] + 1) / max_points))
        rows = self._query("SELECT MAX(step) AS step, AVG(loss) AS loss FROM steps "
                           "WHERE rank = ? AND loss IS NOT NULL GROUP BY step / ? "
                           "ORDER BY step LIMIT ?", (rank, bucket, max_points + 1),
                           limit=max_points + 1)
        return {"step": [r["step"] for r in rows], "loss": [_finite(r["loss"]) for r in rows],
                "last": rng["hi"]}

    def probe_errors(self, rank: int = 0, limit: int = 200) -> list[Row]:
        return [dict(r) for r in self._query(
            "SELECT location, error_type, message, count, first_step, last_step FROM probe_errors "
            "WHERE rank = ? ORDER BY count DESC LIMIT ?", (rank, limit), limit=limit)]

    def optimizer_count(self, rank: int = 0) -> int:
        """How many optimizers hold parameters of this rank (distinct ``params.opt_index``)."""
        row = self._one("SELECT COUNT(DISTINCT opt_index) AS n FROM params WHERE rank = ? "
                        f"AND opt_index IS NOT NULL AND {self._current('params')}", (rank,))
        return _int(row["n"]) if row else 0

    # -- across ranks (dashboard.read.run, dashboard.read.crossrank) ------------------------------------
    def rank_summary(self, rank: int) -> Row:
        """One rank's line of the Overview's per-rank table: the writer's row (host, pid, counters,
        heartbeat) and what its steps say (last step, samples stored, median of the recent step times,
        measured overhead)."""
        rkd = self._rank_row(rank)
        steps = self._one("SELECT COUNT(*) AS n, MAX(step) AS last, SUM(sampled) AS sampled, "
                          "SUM(probe_ms) AS probe_ms, SUM(step_ms) AS step_ms FROM steps WHERE rank = ?", (rank,))
        recent = [float(r["step_ms"]) for r in self._query(
            "SELECT step_ms FROM steps WHERE rank = ? AND step_ms IS NOT NULL ORDER BY step DESC LIMIT ?",
            (rank, RECENT_STEPS), limit=RECENT_STEPS)]
        overhead = rkd.get("overhead")
        if overhead is None and steps and steps["step_ms"]:
            overhead = (steps["probe_ms"] or 0.0) / steps["step_ms"]
        return {
            "rank": rank,
            "hostname": rkd.get("hostname"), "pid": rkd.get("pid"), "device": rkd.get("device"),
            "world_size": rkd.get("world_size") or 1, "status": rkd.get("status"),
            "step": steps["last"] if steps and steps["last"] is not None else rkd.get("step"),
            "median_step_ms": _finite(statistics.median(recent)) if recent else None,
            "overhead": _finite(overhead),
            "samples_stored": _int(steps["sampled"]) if steps else 0,
            "samples_dropped": _int(rkd.get("samples_dropped")),
            "probe_errors": _int(rkd.get("probe_errors")),
            "write_errors": _int(rkd.get("write_errors")),
            "updated_at": rkd.get("updated_at"),
        }

    def sampled_steps(self, rank: int, limit: int = MAX_STEP_LIST) -> list[int]:
        """The newest ``limit`` sampled steps of ``rank``, newest first."""
        return [int(r["step"]) for r in self._query(
            "SELECT step FROM steps WHERE rank = ? AND sampled = 1 ORDER BY step DESC LIMIT ?",
            (rank, limit), limit=limit)]

    def step_times(self, rank: int, limit: int = MAX_STEP_LIST) -> list[tuple[int, float]]:
        """(step, step_ms) of the newest ``limit`` steps of ``rank`` that have a duration, newest first."""
        return [(int(r["step"]), float(r["step_ms"])) for r in self._query(
            "SELECT step, step_ms FROM steps WHERE rank = ? AND step_ms IS NOT NULL ORDER BY step DESC LIMIT ?",
            (rank, limit), limit=limit)]

    def compute_times(self, rank: int, limit: int = MAX_STEP_LIST) -> list[tuple[int, float]]:
        """(step, compute_ms) of the newest ``limit`` steps of ``rank`` that have this rank's own time (a job of
        several processes), newest first."""
        column = self._column("steps", "compute_ms")
        return [(int(r["step"]), float(r["ms"])) for r in self._query(
            f"SELECT step, {column} AS ms FROM steps WHERE rank = ? AND {column} IS NOT NULL ORDER BY step DESC "
            "LIMIT ?", (rank, limit), limit=limit)]

    def close_values(self, rank: int, limit: int = MAX_TENSORS) -> CloseValues | None:
        """What ``rank`` stored of its replicated tensors when its watcher closed (after the optimizer step of
        ``ranks.step``), or None (still running, one process, or a store older than them)."""
        fp, dn = self._column("params", "close_fingerprint"), self._column("params", "close_data_norm")
        rank_row = self._one("SELECT status, step FROM ranks WHERE rank = ?", (rank,))
        if rank_row is None or rank_row["status"] != RunStatus.CLOSED or rank_row["step"] is None:
            return None
        rows = self._query(f"SELECT path, {fp} AS fp, {dn} AS dn FROM params WHERE rank = ? AND {fp} IS NOT NULL "
                           f"AND {self._current('params')} LIMIT ?", (rank, limit), limit=limit)
        if not rows:
            return None
        return CloseValues(int(rank_row["step"]), {str(r["path"]): (r["fp"], r["dn"]) for r in rows})

    def tensor_values(self, rank: int, step: int, limit: int = MAX_TENSORS) -> dict[str, tuple[Any, Any]]:
        """What replicas must agree on, for every tensor of ``rank`` with statistics at ``step``:
        path -> (fingerprint, data_norm) (NULL fingerprints in a version-1 store)."""
        rows = self._query(
            f"SELECT p.path AS path, {self._select('param_stats', ('fingerprint', 'data_norm'), 's')} "
            "FROM param_stats s JOIN params p ON p.rank = s.rank AND p.param_id = s.param_id "
            "WHERE s.rank = ? AND s.step = ? LIMIT ?", (rank, step, limit), limit=limit)
        return {str(r["path"]): (r["fingerprint"], r["data_norm"]) for r in rows}

    def tensor_history(self, rank: int, paths: Iterable[str], since_step: int,
                       limit: int = MAX_TENSORS) -> dict[str, list[tuple[int, Any, Any]]]:
        """(step, fingerprint, data_norm) of the tensors at ``paths`` from ``since_step`` on, oldest
        first (index seeks on (rank, param_id, step))."""
        names = sorted({str(x) for x in paths})[:500]
        if not names:
            return {}
        marks = ",".join("?" * len(names))
        ids = {int(r["param_id"]): str(r["path"]) for r in self._query(
            f"SELECT param_id, path FROM params WHERE rank = ? AND path IN ({marks}) LIMIT ?",
            (rank, *names, len(names) * 4), limit=len(names) * 4)}
        if not ids:
            return {}
        id_marks = ",".join("?" * len(ids))
        out: dict[str, list[tuple[int, Any, Any]]] = {}
        for r in self._query(
                f"SELECT param_id, step, {self._select('param_stats', ('fingerprint', 'data_norm'))} FROM param_stats "
                f"WHERE rank = ? AND param_id IN ({id_marks}) AND step >= ? ORDER BY step DESC LIMIT ?",
                (rank, *ids, since_step, limit), limit=limit):
            out.setdefault(ids[int(r["param_id"])], []).append((int(r["step"]), r["fingerprint"], r["data_norm"]))
        for rows in out.values():
            rows.reverse()
        return out

    def final_loss(self, rank: int = 0) -> float | None:
        row = self._one("SELECT loss FROM steps WHERE rank = ? AND loss IS NOT NULL "
                        "ORDER BY step DESC LIMIT 1", (rank,))
        return None if row is None else _finite(float(row["loss"]))

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot_bytes(self) -> bytes:
        """A consistent single-file copy of this store (``probes.schema.snapshot``), as bytes."""
        if not self.ready():
            raise StoreNotReadyError(f"{self.where}: waiting for the first sample")
        return snapshot_bytes([self.path])
