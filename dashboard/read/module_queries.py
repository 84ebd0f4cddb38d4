"""The queries about modules: the tree, search, a module's series, histogram and parameters."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

from probes.schema import (
    decode_hist,
    module_path_candidates,
)

from .checkpoint_compare import StoredTensor
from .connection import (
    MAX_CHILDREN,
    MAX_COMPARE_MODULES,
    MAX_DEPTH,
    MAX_HEAT_COLUMNS,
    MAX_KEYS,
    MAX_PARAMS,
    MAX_POINTS,
    MAX_SEARCH,
    Row,
    StoreBase,
    _finite,
    _loads,
)
from .store_guard import checked_meta


class ModuleQueries(StoreBase):
    _MODULE_COLS = ("module_id", "parent_id", "path", "name", "type", "type_module", "kind", "depth", "n_children",
                    "params_total", "params_trainable", "params_in_optimizer", "first_step", "removed_step")
    _SERIES_COLS = ("mean", "std", "absmax", "zero_frac", "dead_frac", "sat_frac", "nonfinite",
                    "out_grad_norm", "calls")
    _PARAM_COLS = ("param_id", "path", "name", "shape", "numel", "dtype", "device", "kind", "requires_grad",
                   "registered", "is_parameter", "in_state_dict", "in_optimizer", "opt_index", "opt_group", "lr",
                   "aliases", "moved")
    _PARAM_STAT_COLS = ("grad_norm", "data_norm", "update_norm", "update_ratio", "local_grad_norm", "fingerprint")

    def _current(self, table: str, alias: str = "") -> str:
        """SQL: a row of ``table`` (modules, params) that is part of the model now."""
        return f"{self._column(table, 'removed_step', alias)} IS NULL"

    def _current_first(self, alias: str = "") -> str:
        """ORDER BY of modules that share a path: the module there now, then the latest removed from it."""
        removed = self._column("modules", "removed_step", alias)
        return f"({removed} IS NULL) DESC, {removed} DESC, {alias + '.' if alias else ''}module_id DESC"

    def _modules_where(self, where: str, params: Sequence[Any], order: str = "module_id", limit: int = 1
                       ) -> list[Row]:
        return [dict(r) for r in self._query(
            f"SELECT {self._select('modules', self._MODULE_COLS)} FROM modules WHERE {where} ORDER BY {order} "
            "LIMIT ?", (*params, limit), limit=limit)]

    def root(self, rank: int = 0) -> Row | None:
        rows = self._modules_where(f"rank = ? AND parent_id IS NULL AND {self._current('modules')}", (rank,))
        return rows[0] if rows else None

    def module(self, rank: int, module_id: int) -> Row | None:
        """One module, also one no longer part of the model (``removed_step`` says since when)."""
        rows = self._modules_where("rank = ? AND module_id = ?", (rank, module_id))
        return rows[0] if rows else None

    def module_by_path(self, rank: int, path: str) -> Row | None:
        """The module at ``path``: the one there now, else the one removed from it last."""
        rows = self._modules_where("rank = ? AND path = ?", (rank, path), order=self._current_first())
        return rows[0] if rows else None

    def module_like(self, rank: int, path: str, removed_step: int | None) -> Row | None:
        """Another rank's module at ``path`` in the same state: removed at ``removed_step`` too (ranks rebuild their
        index at the same sampled steps), else :meth:`module_by_path`'s."""
        if removed_step is not None:
            rows = self._modules_where(f"rank = ? AND path = ? AND {self._column('modules', 'removed_step')} = ?",
                                       (rank, path, removed_step), order="module_id DESC")
            if rows:
                return rows[0]
        return self.module_by_path(rank, path)

    def module_for_path(self, rank: int, path: str) -> Row | None:
        """The module a finding path belongs to: the path itself or its longest module prefix."""
        for candidate in module_path_candidates(path):
            m = self.module_by_path(rank, candidate)
            if m is not None:
                return m
        return None

    def children(self, rank: int, parent_id: int, limit: int = MAX_CHILDREN, *,
                 also: int | Iterable[int] | None = None) -> Row:
        """Children of one node that are part of the model now (registered first, in id order), and ``also``
        (a module id, or several: the one selected and its ancestors) when it is a child no longer part of it (the
        one selected, drawn where it was, under its parent removed with it); ``more`` counts the rest."""
        extra = [] if also is None else [also] if isinstance(also, int) else sorted({int(i) for i in also})[:MAX_DEPTH]
        marks = ", ".join(["?"] * len(extra)) or "-1"
        where = f"rank = ? AND parent_id = ? AND ({self._current('modules')} OR module_id IN ({marks}))"
        args = (rank, parent_id, *extra)
        rows = self._modules_where(where, args, order=f"{self._current('modules')} DESC, module_id", limit=limit + 1)
        more = 0
        if len(rows) > limit:
            n = self._one(f"SELECT COUNT(*) AS n FROM modules WHERE {where}", args)
            more = (n["n"] if n else len(rows)) - limit
        return {"items": rows[:limit], "more": more}

    def ancestors(self, rank: int, module_id: int) -> list[int]:
        """Ids from the root down to the parent of ``module_id``."""
        rows = self._query(
            "WITH RECURSIVE up(id, parent, lvl) AS ("
            " SELECT module_id, parent_id, 0 FROM modules WHERE rank = ? AND module_id = ?"
            " UNION ALL SELECT m.module_id, m.parent_id, up.lvl + 1 FROM modules m"
            " JOIN up ON m.rank = ? AND m.module_id = up.parent WHERE up.lvl < ?)"
            " SELECT id, lvl FROM up WHERE lvl > 0 ORDER BY lvl DESC LIMIT ?",
            (rank, module_id, rank, MAX_DEPTH, MAX_DEPTH), limit=MAX_DEPTH)
        return [int(r["id"]) for r in rows]

    def search_modules(self, rank: int = 0, text: str = "", code: str | None = None,
                       limit: int = MAX_SEARCH) -> Row:
        """Modules whose path or type contains ``text`` (case-insensitive) and, when ``code``
        is given, that carry an active finding with that code."""
        where = ["m.rank = ?"]
        params: list[Any] = [rank]
        text = (text or "").strip()
        if text:
            esc = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append("(m.path LIKE ? ESCAPE '\\' OR m.type LIKE ? ESCAPE '\\')")
            params += [f"%{esc}%", f"%{esc}%"]
        if code:
            # not correlated: the findings of the code are read once (by the key's (rank, code) prefix) and each
            # module is looked up in that list; EXISTS per module scanned them all for every module
            where.append("m.module_id IN (SELECT f.module_id FROM findings f WHERE f.rank = ? AND f.code = ? "
                         "AND f.active = 1 AND f.module_id IS NOT NULL)")
            params += [rank, code]
        # modules no longer part of the model are found too (marked by their removed_step), after those that are
        rows = self._query(f"SELECT {self._select('modules', self._MODULE_COLS, 'm')} "
                           f"FROM modules m WHERE {' AND '.join(where)} "
                           f"ORDER BY {self._current('modules', 'm')} DESC, m.depth, m.module_id LIMIT ?",
                           (*params, limit + 1),
                           limit=limit + 1)
        return {"items": [dict(r) for r in rows[:limit]], "truncated": len(rows) > limit}

    def module_series(self, rank: int, module_id: int, since_step: int | None = None,
                      max_points: int = MAX_POINTS) -> Row:
        """Per-step statistics of one module. ``since_step``: only newer rows (raw);
        otherwise the whole run downsampled to ``max_points`` buckets (bucket means)."""
        cols = self._SERIES_COLS
        rows: list[sqlite3.Row]
        if since_step is not None:
            rows = self._query(f"SELECT step, {', '.join(cols)} FROM module_stats WHERE rank = ? "
                               "AND module_id = ? AND step > ? ORDER BY step LIMIT ?",
                               (rank, module_id, since_step, max_points), limit=max_points)
        else:
            rng = self._one("SELECT COUNT(*) AS n, MIN(step) AS lo, MAX(step) AS hi "
                            "FROM module_stats WHERE rank = ? AND module_id = ?", (rank, module_id))
            if not rng or not rng["n"]:
                rows = []
            elif rng["n"] <= max_points:
                rows = self._query(f"SELECT step, {', '.join(cols)} FROM module_stats "
                                   "WHERE rank = ? AND module_id = ? ORDER BY step LIMIT ?",
                                   (rank, module_id, max_points), limit=max_points)
            else:
                bucket = max(1, math.ceil((rng["hi"] - rng["lo"] + 1) / max_points))
                agg = ", ".join(f"MAX({c}) AS {c}" if c in ("absmax", "nonfinite", "calls")
                                else f"AVG({c}) AS {c}" for c in cols)
                rows = self._query(f"SELECT MAX(step) AS step, {agg} FROM module_stats "
                                   "WHERE rank = ? AND module_id = ? GROUP BY step / ? "
                                   "ORDER BY step LIMIT ?",
                                   (rank, module_id, bucket, max_points + 1), limit=max_points + 1)
        out: Row = {"step": [r["step"] for r in rows]}
        for c in cols:
            out[c] = [_finite(r[c]) for r in rows]
        out["last"] = rows[-1]["step"] if rows else since_step
        return out

    def module_hist(self, rank: int, module_id: int, max_cols: int = MAX_HEAT_COLUMNS) -> Row:
        """Activation histograms over time: ``steps`` x ``HIST_BINS`` counts (columns thinned
        to ``max_cols``), with the bin edges from meta 'hist_edges'."""
        rng = self._one("SELECT COUNT(*) AS n, MIN(step) AS lo, MAX(step) AS hi FROM module_stats "
                        "WHERE rank = ? AND module_id = ? AND hist IS NOT NULL", (rank, module_id))
        edges_row = self._one("SELECT value FROM meta WHERE key = 'hist_edges'")
        edges = checked_meta({"hist_edges": _loads(edges_row["value"])})["hist_edges"] or [] if edges_row else []
        if not rng or not rng["n"]:
            return {"step": [], "counts": [], "edges": edges}
        bucket = max(1, math.ceil((rng["hi"] - rng["lo"] + 1) / max_cols))
        rows = self._query("SELECT MAX(step) AS step, hist FROM module_stats WHERE rank = ? "
                           "AND module_id = ? AND hist IS NOT NULL GROUP BY step / ? ORDER BY step "
                           "LIMIT ?", (rank, module_id, bucket, max_cols + 1), limit=max_cols + 1)
        steps, counts = [], []
        for r in rows:
            h = decode_hist(r["hist"])          # schema 2 on: a uint16 blob; schema 1: a JSON list
            if h is not None:
                steps.append(r["step"])
                counts.append([float(x) for x in h])
        return {"step": steps, "counts": counts, "edges": edges}

    def module_params(self, rank: int, module_id: int, limit: int = MAX_PARAMS) -> list[Row]:
        """The parameters/buffers/tensors owned by a module, with their latest statistics: those stored
        under it (``p.module_id``) and those it owns by another name (a tied weight, stored once under
        its first path with the others in ``aliases``). Each row has ``shared_with``: the tensor's other
        paths (its primary ``path`` first for one owned by an alias, whose ``name`` is then the alias's)
        and ``primary``: whether this module is the one the tensor is stored (and counted) under."""
        m = self.module(rank, module_id)
        prefix = f"{m['path']}." if m is not None and m["path"] else ""
        # a candidate for an alias owned here: its JSON list holds a string starting with the module's path
        encoded = json.dumps(prefix)[1:-1]         # as the writer encodes it (probes.store.records: json.dumps)
        like = '%"' + encoded.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._query(
            f"SELECT {', '.join('p.' + c for c in self._PARAM_COLS)}, p.module_id AS owner_id, "
            "s.step AS stat_step, "
            f"{self._select('param_stats', self._PARAM_STAT_COLS, 's')}, "
            f"{self._column('param_stats', 'lr', 's')} AS step_lr "
            "FROM params p LEFT JOIN param_stats s ON s.rank = p.rank AND s.param_id = p.param_id "
            "AND s.step = (SELECT MAX(step) FROM param_stats WHERE rank = p.rank "
            "AND param_id = p.param_id) "
            "WHERE p.rank = ? AND (p.module_id = ? OR (p.aliases LIKE ? ESCAPE '\\' AND ? = 1)) "
            # a module of the model now: its tensors now; one removed: those it had (removed with it)
            f"AND ({self._current('params', 'p')} OR ? = 1) "
            "ORDER BY p.param_id LIMIT ?",
            # (a prefix longer than a LIKE pattern may be (SQLite: 50,000 bytes) looks for no alias)
            (rank, module_id, like if len(like) < 49_000 else "", int(m is not None and len(like) < 49_000),
             int(m is not None and m["removed_step"] is not None), limit),
            limit=limit)
        out = []
        for r in rows:
            d = dict(r)
            d["aliases"] = _loads(d["aliases"], []) or []
            owner = d.pop("owner_id")
            if owner == module_id:
                d["primary"] = True
                d["shared_with"] = [str(a) for a in d["aliases"]]
            else:
                # owned here by an alias naming a direct attribute of this module
                mine = [str(a) for a in d["aliases"]
                        if str(a).startswith(prefix) and "." not in str(a)[len(prefix):]]
                if not mine:
                    continue
                d["primary"] = False
                d["shared_with"] = [d["path"], *(str(a) for a in d["aliases"] if str(a) != mine[0])]
                d["path"], d["name"] = mine[0], mine[0][len(prefix):]
            d["shape"] = _loads(d["shape"])
            # the lr of the latest sampled step (a scheduler changes it); params.lr is the one at the index's
            # build, all an older store has
            step_lr = _finite(d.pop("step_lr"))
            d["lr"] = step_lr if step_lr is not None else _finite(d["lr"])
            for k in self._PARAM_STAT_COLS:
                d[k] = _finite(d[k])
            out.append(d)
        return out

    def modules_for_paths(self, rank: int, paths: Iterable[str]) -> dict[str, Row]:
        """The module each finding path belongs to (the path itself or its longest module prefix), for
        many paths at once: one query per 500 candidate paths."""
        wanted = {p: module_path_candidates(p) for p in {str(x) for x in paths}}
        candidates = sorted({c for cs in wanted.values() for c in cs})
        found: dict[str, Row] = {}
        for start in range(0, len(candidates), 500):
            chunk = candidates[start:start + 500]
            marks = ",".join("?" * len(chunk))
            # the module at a path now first, else the one removed from it last
            for m in self._modules_where(f"rank = ? AND path IN ({marks})", (rank, *chunk),
                                         order=self._current_first(), limit=len(chunk) * 4):
                found.setdefault(m["path"], m)
        out = {}
        for p, cs in wanted.items():
            hit: Row | None = next((found[c] for c in cs if c in found), None)
            if hit is not None:
                out[p] = hit
        return out

    def all_modules(self, rank: int = 0, limit: int = MAX_COMPARE_MODULES, *, removed: bool = False) -> list[Row]:
        """The modules of the model as it is now (``removed``: those no longer part of it instead), by id."""
        current = self._current("modules")
        return self._modules_where(f"rank = ? AND {f'NOT ({current})' if removed else current}", (rank,), limit=limit)

    def latest_module_stats(self, rank: int = 0, limit: int = MAX_COMPARE_MODULES) -> dict[int, Row]:
        """Each module's most recent statistics row (one index seek per module)."""
        rows = self._query(
            "SELECT s.module_id, s.step, s.mean, s.std, s.dead_frac, s.sat_frac, s.nonfinite, "
            "s.out_grad_norm FROM modules m JOIN module_stats s ON s.rank = m.rank "
            "AND s.module_id = m.module_id AND s.step = (SELECT MAX(step) FROM module_stats "
            "WHERE rank = m.rank AND module_id = m.module_id) WHERE m.rank = ? LIMIT ?",
            (rank, limit), limit=limit)
        return {int(r["module_id"]): {k: _finite(r[k]) for k in r.keys()} for r in rows}  # noqa: SIM118

    # -- whole-store views (compare, report) -------------------------------------------------
    def state_dict_keys(self, rank: int = 0, limit: int = MAX_KEYS) -> list[str]:
        """The keys a checkpoint (``model.state_dict()``) of this model (as it is now) would hold."""
        keys: set[str] = set()
        for r in self._query("SELECT path, aliases FROM params WHERE rank = ? AND in_state_dict = 1 "
                             f"AND {self._current('params')} ORDER BY param_id LIMIT ?", (rank, limit), limit=limit):
            keys.add(r["path"])
            for a in _loads(r["aliases"], []) or []:
                if isinstance(a, str):
                    keys.add(a)
        return sorted(keys)

    def checkpoint_tensors(self, rank: int = 0, limit: int = MAX_KEYS) -> list[StoredTensor]:
        """The model's tensors as a checkpoint sees them (``modscope checkpoint``): every current ``params`` row
        (registered ones with ``in_state_dict`` and ``aliases``, and the unregistered ones no state_dict holds),
        with the path and kind of the module that holds it."""
        rows = self._query(
            "SELECT p.path, p.aliases, p.shape, p.numel, p.dtype, p.kind, p.requires_grad, p.registered, "
            "p.is_parameter, p.in_state_dict, m.path AS module_path, m.kind AS module_kind, m.type AS module_type "
            "FROM params p LEFT JOIN modules m ON m.rank = p.rank AND m.module_id = p.module_id "
            f"WHERE p.rank = ? AND {self._current('params', 'p')} ORDER BY p.param_id LIMIT ?", (rank, limit),
            limit=limit)
        return [_stored_tensor(r) for r in rows]


def _stored_tensor(r: sqlite3.Row) -> StoredTensor:
    shape = _loads(r["shape"])
    aliases = _loads(r["aliases"], []) or []
    return StoredTensor(
        path=str(r["path"]), aliases=tuple(a for a in aliases if isinstance(a, str)) if isinstance(aliases, list)
        else (), shape=tuple(int(d) for d in shape) if isinstance(shape, list) else None,
        numel=int(r["numel"] or 0), dtype=_text(r["dtype"]), kind=str(r["kind"]),
        requires_grad=bool(r["requires_grad"]), registered=bool(r["registered"]), is_parameter=bool(r["is_parameter"]),
        in_state_dict=bool(r["in_state_dict"]), module_path=_text(r["module_path"]),
        module_kind=_text(r["module_kind"]), module_type=_text(r["module_type"]))


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
