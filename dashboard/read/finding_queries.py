"""The queries about findings: by module, by subtree, by code, and their signature."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from probes.schema import (
    Severity,
)

from .connection import MAX_DEPTH, MAX_FINDINGS, Row, _int, _loads, _severity_order_sql, severity_rank
from .module_queries import ModuleQueries


class FindingQueries(ModuleQueries):
    _FINDING_COLS = ("code", "path", "severity", "module_id", "message", "fix", "evidence", "first_step",
                     "last_step", "active", "count", "cause_code", "cause_path")

    def findings_for_modules(self, rank: int, module_ids: Iterable[int]) -> dict[int, list[Row]]:
        """Active findings drawn on each of ``module_ids`` (code, severity, path), worst first."""
        ids = sorted({int(i) for i in module_ids})
        out: dict[int, list[Row]] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            for r in self._query(f"SELECT module_id, code, severity, path FROM findings "
                                 f"WHERE rank = ? AND active = 1 AND module_id IN ({marks}) "
                                 "LIMIT 20000", (rank, *chunk), limit=20000):
                out.setdefault(int(r["module_id"]), []).append(
                    {"code": r["code"], "severity": r["severity"], "path": r["path"]})
        for v in out.values():
            v.sort(key=lambda f: (severity_rank(f["severity"]), f["code"]))
        return out

    def subtree_finding_counts(self, rank: int = 0) -> dict[int, dict[str, int]]:
        """For every module on the way up from a finding: active findings below it (itself
        included) by severity. Lets a collapsed node say "2 errors inside" (not those drawn on a module no
        longer part of the model: the tree does not show it)."""
        rows = self._query(
            "WITH RECURSIVE up(id, sev, lvl) AS ("
            " SELECT f.module_id, f.severity, 0 FROM findings f JOIN modules m0"
            "  ON m0.rank = f.rank AND m0.module_id = f.module_id"
            f"  WHERE f.rank = ? AND f.active = 1 AND {self._current('modules', 'm0')}"
            " UNION ALL SELECT m.parent_id, up.sev, up.lvl + 1 FROM up JOIN modules m"
            "  ON m.rank = ? AND m.module_id = up.id WHERE m.parent_id IS NOT NULL AND up.lvl < ?)"
            " SELECT id, sev, COUNT(*) AS n FROM up GROUP BY id, sev LIMIT 100000",
            (rank, rank, MAX_DEPTH), limit=100000)
        out: dict[int, dict[str, int]] = {}
        for r in rows:
            out.setdefault(int(r["id"]), {})[str(r["sev"])] = int(r["n"])
        return out

    def default_expanded(self, rank: int = 0, findings: int = 3) -> list[int]:
        """Nodes to open on first view: the root and the ancestors of the first few
        error (then warning) findings, so the worst problems are visible at once."""
        root = self.root(rank)
        if root is None:
            return []
        ids = [int(root["module_id"])]
        rows = self._query("SELECT module_id FROM findings WHERE rank = ? AND active = 1 "
                           "AND severity IN (?, ?) AND module_id IS NOT NULL "
                           f"GROUP BY module_id ORDER BY MIN({_severity_order_sql('severity')}), "
                           "module_id LIMIT ?", (rank, Severity.ERROR, Severity.WARNING, findings), limit=findings)
        for r in rows:
            for a in self.ancestors(rank, r["module_id"]):
                if a not in ids:
                    ids.append(a)
        return ids

    def findings(self, rank: int = 0, *, active: bool | None = True, module_id: int | None = None,
                 limit: int = MAX_FINDINGS) -> list[Row]:
        """Findings sorted by severity (error, warning, info), then path. Each has the columns of
        ``findings`` (``count``, ``cause_code``, ``cause_path`` read as 1, NULL, NULL in a version-1
        store), ``evidence`` decoded, the path of the module it is drawn on and, when that module is no longer part
        of the model, the step it left at (``module_removed_step``, else None)."""
        sql = (f"SELECT {self._select('findings', self._FINDING_COLS, 'f')}, m.path AS module_path, "
               f"{self._column('modules', 'removed_step', 'm')} AS module_removed_step "
               "FROM findings f LEFT JOIN modules m ON m.rank = f.rank AND m.module_id = f.module_id "
               "WHERE f.rank = ?")
        params: list[Any] = [rank]
        if active is not None:
            sql += " AND f.active = ?"
            params.append(1 if active else 0)
        if module_id is not None:
            sql += " AND f.module_id = ?"
            params.append(module_id)
        sql += f" ORDER BY {_severity_order_sql('f.severity')}, f.active DESC, f.path, f.code LIMIT ?"
        params.append(limit)
        out = []
        for r in self._query(sql, params, limit=limit):
            d = dict(r)
            d["evidence"] = _loads(d["evidence"], d["evidence"])
            out.append(d)
        return out

    def count_findings(self, rank: int = 0, *, active: bool | None = True) -> int:
        """How many findings ``rank`` holds (``findings`` reads ``MAX_FINDINGS`` at most: caps.py says the rest)."""
        row = self._one("SELECT COUNT(*) AS n FROM findings WHERE rank = ?" + ("" if active is None else
                        " AND active = ?"), (rank,) if active is None else (rank, 1 if active else 0))
        return int(row["n"]) if row is not None else 0

    def finding_codes(self, rank: int = 0) -> list[str]:
        return [str(r["code"]) for r in self._query(
            "SELECT DISTINCT code FROM findings WHERE rank = ? AND active = 1 ORDER BY code LIMIT 100",
            (rank,), limit=100)]

    def findings_signature(self, rank: int) -> tuple[int, ...]:
        """Changes whenever a finding of ``rank`` is added, resolved, seen again or changes severity
        or cause (one index-free pass over that rank's findings, a few thousand rows at most)."""
        row = self._one(f"SELECT COUNT(*) AS n, SUM(active) AS a, SUM({self._column('findings', 'count')}) "
                        "AS c, SUM(COALESCE(last_step, 0)) AS l, SUM(LENGTH(severity) * active) AS s, "
                        f"SUM(LENGTH(COALESCE({self._column('findings', 'cause_code')}, ''))) AS k "
                        "FROM findings WHERE rank = ?", (rank,))
        return tuple(_int(v) for v in (tuple(row) if row else (0,) * 6))
