"""The read boundary: a store is data from someone else (snapshots are passed around for review).

:func:`prepare` runs on every connection :class:`dashboard.read.store.Store` opens. It bounds what SQLite may build
(``schema.guard_reads``: no string or blob over ``MAX_VALUE_BYTES``, whatever function makes it), refuses the schema
objects that would run the file's own SQL when read (a generated column, a view or virtual table under a table's
name) and notes the others (triggers, views, tables modscope does not write: never read, never copied). Then it
puts a temporary view over each of the contract's tables, under the table's own name, so that every query of
``data.py`` reads checked values without a change to its SQL:

- a row whose key (a primary-key or indexed column) has the wrong type or is out of range is not there;
- any other value of the wrong type, out of its range, or (a JSON column) not JSON of the right kind reads as NULL,
  "unknown" to the pages; a NOT NULL text column reads as the text ``UNKNOWN``;
- a column an older store lacks reads as its default (``schema.ADDED_COLUMNS``), a table it lacks as empty
  (``schema.ADDED_TABLES``).

The columns, their types and which are keys come from ``schema.DDL`` itself (``schema.contract_columns``): a
column added there is checked here. ``_RANGES`` narrows the range of a few of them by name.

:func:`fetch_bounded` bounds what one query hands to Python (``MAX_QUERY_BYTES`` of strings and blobs), and
:func:`loads_json` what a JSON value may be (``MAX_JSON_DEPTH``). Times are bounded by ``Store``'s progress handler.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Mapping
from typing import Any

from probes.schema import (
    ADDED_COLUMNS,
    ADDED_TABLES,
    HIST_BINS,
    MAX_VALUE_BYTES,
    TABLES,
    UntrustedStoreError,
    contract_columns,
    guard_reads,
)

__all__ = ["MAX_JSON_DEPTH", "MAX_QUERY_BYTES", "MAX_VALUE_BYTES", "UNKNOWN", "UntrustedStoreError", "checked_meta",
           "fetch_bounded", "loads_json", "prepare", "valid_id"]

UNKNOWN = "unknown"                  # what a NOT NULL text column of the wrong type reads as
MAX_QUERY_BYTES = 32 * 2**20         # characters and bytes of strings and blobs one query may return, rows together
MAX_JSON_DEPTH = 32                  # nesting of a JSON value read from a store (modscope writes 3 levels at most)
MAX_ID = 2**53                       # ids, steps and counts: what a JSON number (the browser) holds exactly
MAX_TIME = 32503680000.0             # unix seconds: the year 3000 (datetime cannot show much later)
_FINITE = 1.7976931348623157e308     # the largest float: BETWEEN -it AND it is false for inf

# the range of a column by name where its type's is too wide (ints: 0..MAX_ID, reals: finite)
_RANGES: Mapping[str, tuple[float, float]] = {
    **dict.fromkeys(("requires_grad", "registered", "is_parameter", "in_state_dict", "in_optimizer", "sampled",
                     "active", "training", "grad_enabled", "moved"), (0, 1)),
    **dict.fromkeys(("started_at", "updated_at", "closed_at", "wall_time"), (0.0, MAX_TIME)),
    **dict.fromkeys(("zero_frac", "dead_frac", "sat_frac"), (0.0, 1.0)),
    **dict.fromkeys(("step_ms", "probe_ms", "overhead", "std", "absmax", "grad_norm", "data_norm", "update_norm",
                     "update_ratio", "local_grad_norm", "out_grad_norm", "lr"), (0.0, _FINITE)),
    "world_size": (1, 2**31),
    "rank": (0, 2**31),
}


def _range(name: str, kind: str) -> tuple[float, float]:
    return _RANGES.get(name, (0, MAX_ID) if kind == "INTEGER" else (-_FINITE, _FINITE))


def _type_test(name: str, kind: str, key: bool = False) -> str | None:
    """SQL: true when ``name`` holds a value of ``kind`` in its range (None: any value will do). On a key the range
    test is written ``+column`` so that the planner does not take it for an index range: the query's own equality
    on that column keeps choosing the index."""
    col = f'"{name}"'
    if kind in ("INTEGER", "REAL"):
        lo, hi = _range(name, kind)
        types = "'integer'" if kind == "INTEGER" else "'integer', 'real'"
        return f"typeof({col}) IN ({types}) AND {'+' if key else ''}{col} BETWEEN {lo!r} AND {hi!r}"
    if kind == "TEXT":
        return f"typeof({col}) = 'text'"
    return None


def _value_sql(name: str, kind: str, not_null: bool, json_kind: str | None) -> str:
    """SQL: the checked value of a column that is not a key (NULL, or ``UNKNOWN`` for NOT NULL text, when wrong)."""
    col = f'"{name}"'
    if name == "hist":                  # HIST_BINS uint16 counts; schema 1: a JSON list of HIST_BINS counts
        return (f"CASE WHEN typeof({col}) = 'blob' AND length({col}) = {2 * HIST_BINS} THEN {col} "
                f"WHEN typeof({col}) = 'text' AND json_valid({col}) THEN CASE WHEN json_type({col}) = 'array' "
                f"AND json_array_length({col}) = {HIST_BINS} AND NOT EXISTS (SELECT 1 FROM json_each({col}) "
                f"WHERE type != 'integer' OR value NOT BETWEEN 0 AND {MAX_ID}) THEN {col} END END")
    if json_kind is not None:
        wanted = "" if json_kind == "any" else f"WHEN json_type({col}) = '{json_kind}' "
        inner = f"CASE {wanted}THEN {col} END" if wanted else col
        return f"CASE WHEN typeof({col}) = 'text' AND json_valid({col}) THEN {inner} END"
    test = _type_test(name, kind)
    if test is None:
        return col
    checked = f"CASE WHEN {test} THEN {col} END"
    return f"COALESCE({checked}, '{UNKNOWN}')" if kind == "TEXT" and not_null else checked


def view_sql(table: str, present: tuple[str, ...] | None) -> str:
    """The temporary view that stands for ``table`` (``present``: the store's columns of it; None: it has no such
    table, an older store's: an empty view)."""
    select, where = [], []
    defaults = dict(ADDED_COLUMNS.get(table, ()))
    for c in contract_columns()[table]:
        if present is None or c.name not in present:
            select.append(f'{defaults.get(c.name, "NULL")} AS "{c.name}"')
        elif c.key:
            select.append(f'"{c.name}"')
            test = _type_test(c.name, c.type, key=True)
            if test is not None:
                where.append(f"({test})" if c.not_null else f'("{c.name}" IS NULL OR ({test}))')
        else:
            select.append(f'{_value_sql(c.name, c.type, c.not_null, c.json)} AS "{c.name}"')
    source = f' FROM main."{table}"' if present is not None else ""
    condition = " WHERE " + " AND ".join(where) if where else ""
    if present is None:
        condition = " WHERE 0"
    return f'CREATE TEMP VIEW "{table}" AS SELECT {", ".join(select)}{source}{condition}'


def prepare(conn: sqlite3.Connection, where: object) -> str | None:
    """Bound ``conn``, audit the store's schema and put the checked views in place (see the module's doc). Returns
    one line naming the foreign objects ignored, or None; raises UntrustedStoreError for one that is refused. A store
    still being created (tables missing) gets no views: it is read once it is complete."""
    audit = guard_reads(conn, where)
    missing = [t for t in TABLES if t not in audit.tables and ADDED_TABLES.get(t, 0) <= max(audit.version, 1)]
    if missing:
        return None             # not a store (yet): validate() says so; its foreign objects are no news
    for table in TABLES:
        conn.execute(view_sql(table, audit.tables.get(table)))
    return audit.note(where)


# -- what reaches Python ----------------------------------------------------------------------------------
def fetch_bounded(cur: sqlite3.Cursor, limit: int | None, where: object) -> list[Any]:
    """The rows of ``cur`` (``limit`` at most), refused with UntrustedStoreError once their strings and blobs add
    up to more than ``MAX_QUERY_BYTES``."""
    rows: list[Any] = []
    total = 0
    want = limit if limit is not None else math.inf
    while len(rows) < want:
        chunk = cur.fetchmany(int(min(1024, want - len(rows))))
        if not chunk:
            break
        for row in chunk:
            for value in row:
                if value.__class__ is str or value.__class__ is bytes:
                    total += len(value)
        if total > MAX_QUERY_BYTES:
            raise UntrustedStoreError(f"{where}: one read returned more than {MAX_QUERY_BYTES:,} characters of text; "
                                      "modscope writes far less (refused)")
        rows.extend(chunk)
    return rows


def _depth(value: Any, limit: int) -> int:
    """How deeply ``value`` nests (lists and dicts), counted iteratively up to ``limit + 1``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def loads_json(text: Any, default: Any = None) -> Any:
    """``text`` as JSON, or ``default`` when it is not JSON, or nests deeper than ``MAX_JSON_DEPTH``."""
    if text is None:
        return default
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return default
    return default if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH else value


def _timestamp(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_TIME
    return float(value) if ok else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _edges(value: Any) -> list[float] | None:
    ok = isinstance(value, list) and len(value) == HIST_BINS - 1 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    return [float(v) for v in value] if ok else None


# the meta keys the pages read, and what each must be (anything else: None, "unknown")
_META = {"run_name": _text, "run_id": _text, "created_at": _timestamp, "snapshot_at": _timestamp,
         "hist_edges": _edges}


def checked_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``meta`` (key -> decoded JSON) with the values the pages read checked (None when wrong)."""
    return {k: (_META[k](v) if k in _META else v) for k, v in meta.items()}


def valid_id(value: Any) -> int | None:
    """A module (or tensor) id from a request: an int (or its text) in 0..MAX_ID, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 16:
        value = int(value)
    return value if isinstance(value, int) and 0 <= value <= MAX_ID else None
