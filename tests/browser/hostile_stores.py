"""Store files as an attacker, or a careless tool, could hand them over for review: written with sqlite3 directly,
from the shape of a real store (``bench.synth_store.demo``: the demo's classifier, its plain-list bug and findings).

- :func:`generated_path`: ~90 KB; ``modules.path`` is a generated column ``hex(zeroblob(50000000))`` (100 MB built
  by one function call, each time a path is read);
- :func:`long_finding_paths`: findings whose paths are longer than a store may hold (4 MB in the wild; here just over
  ``schema.MAX_VALUE_BYTES``: the same shape, a small file);
- :func:`huge_strings`: 10 MB strings (``big``: how long) in a module's type and a finding's message;
- :func:`long_run_name`: a 20,000-character run name (a store may hold it: it is cut where it is shown);
- :func:`trigger_on_meta`: a trigger that spins forever on any write into ``meta`` (and a view, an extra table);
- :func:`wrong_values`: values of the wrong type and out-of-range numbers in every table the pages read, in a store
  whose tables were declared without NOT NULL (so that anything goes in).
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

from bench import synth_store
from probes import schema

TEN_MB = 10 * 2**20
SPIN = ("CREATE TRIGGER spin AFTER {event} ON meta BEGIN SELECT count(*) FROM (WITH RECURSIVE c(x) AS "
        "(SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c); END")


def _demo(path: Path, **kw: object) -> Path:
    path = Path(path)
    synth_store.demo(path, steps=kw.pop("steps", 6), **kw)  # type: ignore[arg-type]
    conn = sqlite3.connect(str(path))
    conn.execute("PRAGMA journal_mode=DELETE")       # one file, as a snapshot is
    conn.close()
    return path


def _recreate(conn: sqlite3.Connection, table: str, create: str) -> None:
    """Replace ``table`` by ``create`` (its columns in the same order), keeping its rows."""
    conn.execute(f"ALTER TABLE {table} RENAME TO old_{table}")
    conn.execute(create)
    cols = [r[1] for r in conn.execute(f"PRAGMA table_xinfo({table})") if not r[6]]
    names = ", ".join(cols)
    conn.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM old_{table}")
    conn.execute(f"DROP TABLE old_{table}")


def _ddl_of(table: str) -> str:
    m = re.search(rf"CREATE TABLE IF NOT EXISTS {table} \(.*?\n\)( WITHOUT ROWID)?;", schema.DDL, re.S)
    assert m, table
    return m.group(0).rstrip(";")


def generated_path(path: Path) -> Path:
    """A small store whose modules.path is computed on every read by ``hex(zeroblob(50000000))``."""
    _demo(path)
    conn = sqlite3.connect(str(path))
    create = re.sub(r"path\s+TEXT NOT NULL,", "path TEXT GENERATED ALWAYS AS (hex(zeroblob(50000000))) VIRTUAL,",
                    _ddl_of("modules"))
    conn.execute("DROP INDEX modules_by_path")
    _recreate(conn, "modules", create)
    conn.commit()
    conn.execute("VACUUM")
    conn.close()
    return path


def long_finding_paths(path: Path, size: int = schema.MAX_VALUE_BYTES + 1000, count: int = 3) -> Path:
    """``count`` findings whose paths are ``size`` characters long."""
    _demo(path)
    conn = sqlite3.connect(str(path))
    for i in range(count):
        conn.execute("INSERT INTO findings (rank, code, path, severity, module_id, message, first_step, last_step, "
                     "active) VALUES (0, 'dead-units', ?, 'warning', 1, 'long', 0, 1, 1)", (f"{i}" + "p" * size,))
    conn.commit()
    conn.close()
    return path


def huge_strings(path: Path, big: int = TEN_MB) -> Path:
    """A module type and a finding message ``big`` characters long."""
    _demo(path)
    conn = sqlite3.connect(str(path))
    conn.execute("UPDATE modules SET type = ? WHERE module_id = 1", ("T" * big,))
    conn.execute("UPDATE findings SET message = ? WHERE rowid = (SELECT MIN(rowid) FROM findings)", ("m" * big,))
    conn.commit()
    conn.close()
    return path


def long_run_name(path: Path, length: int = 20_000) -> Path:
    return _demo(path, run_name="n" * length)


def trigger_on_meta(path: Path) -> Path:
    """Triggers that never end on an insert into or an update of ``meta``, a view and a table modscope does not
    write."""
    _demo(path)
    conn = sqlite3.connect(str(path))
    conn.execute(SPIN.format(event="INSERT"))
    conn.execute(SPIN.format(event="UPDATE").replace("spin", "spin_update"))
    conn.execute("CREATE VIEW everything AS SELECT * FROM modules")
    conn.execute("CREATE TABLE notes (text TEXT)")
    conn.commit()
    conn.close()
    return path


def _loose(conn: sqlite3.Connection) -> None:
    """Every table declared again without NOT NULL (so that a NULL or anything else fits anywhere)."""
    for table in schema.TABLES:
        _recreate(conn, table, re.sub(r"\bNOT NULL\b", "", _ddl_of(table)))


DEEP = "[" * 5000 + "]" * 5000


def wrong_values(path: Path) -> Path:
    """Wrong types and out-of-range numbers in every table the pages read (and rows whose keys are wrong)."""
    _demo(path)
    conn = sqlite3.connect(str(path))
    _loose(conn)
    meta = {"run_name": 42, "created_at": 1e300, "hist_edges": {"a": 1}, "run_id": ["x"]}
    for key, value in meta.items():
        conn.execute("UPDATE meta SET value = ? WHERE key = ?", (json.dumps(value), key))
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('run_id', 'not json')")
    conn.execute("UPDATE ranks SET step = 'abc', world_size = -3, pid = 1e300, started_at = 1e300, updated_at = 'x', "
                 "status = x'00', sampling = '{\"every\": \"x\", \"overhead\": \"y\"}', samples_written = 'many', "
                 "samples_dropped = -1, probe_errors = 'x', overhead = 9e999, write_errors = 'x', last_error = 5, "
                 "model_class = x'ff', device = NULL, torch_version = 3.5")
    conn.execute("UPDATE modules SET depth = 'deep', n_children = -1, params_total = 'many', "
                 "params_trainable = 1e300, params_in_optimizer = NULL, kind = x'01', name = x'ff', type = NULL, "
                 "first_step = 'x', removed_step = -5 WHERE module_id = 1")
    conn.execute("UPDATE modules SET type_module = x'07', params_total = -1 WHERE module_id = 2")
    conn.execute("INSERT INTO modules (rank, module_id, path, parent_id, name, type, kind, depth) "
                 "VALUES (0, 'x', 'bad.id', 0, 'bad', 'T', 'registered', 1), (0, 99, x'00', 0, 'b', 'T', "
                 "'registered', 1), (0, 98, 'child.of.bad', 'x', 'c', 'T', 'registered', 1)")
    conn.execute("UPDATE params SET numel = 'x', shape = 'not json', aliases = '{\"a\": 1}', requires_grad = 7, "
                 "lr = 'fast', in_optimizer = NULL, kind = 3, dtype = x'00', name = NULL, moved = 9")
    conn.execute("UPDATE steps SET loss = 'x', step_ms = -5, wall_time = 1e300, sampled = 2 WHERE step = 1")
    conn.execute("UPDATE steps SET loss = 9e999, probe_ms = 'slow' WHERE step = 2")
    conn.execute("INSERT INTO steps (rank, step, wall_time, sampled) VALUES (0, 'x', 0, 1), (0, -1, 0, 1), "
                 "(0, 1e300, 0, 1)")
    conn.execute("UPDATE module_stats SET mean = 'x', std = -1, hist = x'0102', dead_frac = 3.0, calls = 'x', "
                 "nonfinite = -1, out_grad_norm = 9e999 WHERE step = 1")
    conn.execute("UPDATE module_stats SET hist = '[1, 2]', absmax = 'big', zero_frac = NULL WHERE step = 2")
    conn.execute("UPDATE module_stats SET hist = ? WHERE step = 3", (json.dumps(["x"] * schema.HIST_BINS),))
    conn.execute("UPDATE param_stats SET grad_norm = 'x', update_ratio = 9e999, fingerprint = 'x', lr = -1e300")
    conn.execute("INSERT INTO param_series (rank, param_id, step, grad_norm, data_norm) "
                 "VALUES (0, 0, 1, 'x', 9e999), (0, 'x', 2, 1.0, 1.0)")
    conn.execute("UPDATE findings SET severity = 42, message = NULL, evidence = ?, first_step = 'x', "
                 "last_step = 1e300, active = 'yes', count = -3, cause_code = 5, fix = x'00' "
                 "WHERE rowid = (SELECT MIN(rowid) FROM findings)", (DEEP,))
    conn.execute("UPDATE findings SET evidence = '[1, 2]', module_id = 'x', cause_path = 3 "
                 "WHERE rowid = (SELECT MAX(rowid) FROM findings)")
    conn.execute("INSERT INTO findings (rank, code, path, severity, active) VALUES (0, x'00', 'p', 'error', 1)")
    conn.execute("INSERT INTO probe_errors (rank, location, error_type, message, count, first_step, last_step) "
                 "VALUES (0, 'forward-hook', 'ValueError', x'00', 'x', 1e300, -1), (0, 5, 'E', 'm', 1, 1, 1)")
    conn.commit()
    conn.close()
    return path


HOSTILE = {"generated-path": generated_path, "long-finding-paths": long_finding_paths, "huge-strings": huge_strings,
           "long-run-name": long_run_name, "trigger-on-meta": trigger_on_meta, "wrong-values": wrong_values}
