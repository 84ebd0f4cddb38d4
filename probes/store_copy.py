"""A store as untrusted input: what the contract's tables look like, what a reader may let SQLite build, which schema
objects it refuses, and the snapshot, a copy that carries nothing but the contract.

A snapshot is passed around for review: its file is data from someone else. So every side that opens a store
(the dashboard's reader, ``modscope snapshot``, ``w.snapshot()``) bounds what SQLite may build from it
(:func:`limit_reads`: no string or blob longer than ``MAX_VALUE_BYTES``, whatever function makes it), refuses the
schema objects that would run the file's own SQL when read (a generated column, a virtual table, a view where a table
is expected: :func:`audit`) and ignores, never reads nor copies, the others (triggers, views, tables and indexes
modscope does not write). The snapshot (:func:`copy_stores`) creates a fresh file from ``schema.DDL`` and copies the
known columns of the known tables row by row (memory independent of the store's size), in one read transaction per
source, under a time limit. Standard library only: ``probes.schema`` (which the dashboard imports) calls it lazily.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from .schema import (
    ADDED_COLUMNS,
    ADDED_TABLES,
    DDL,
    LOCK_SUFFIX,
    MAX_VALUE_BYTES,
    SCHEMA_VERSION,
    TABLES,
    UntrustedStoreError,
)

MAX_SCHEMA_OBJECTS = 10_000         # rows of sqlite_master a store may have
SNAPSHOT_TIMEOUT_S = 600.0          # a snapshot that takes longer is stopped (and leaves no file)
SHOWN_NAME = 60                     # characters of a foreign object's name quoted in a message
MAX_LIKE_PATTERN = 50_000           # SQLite's own ceiling for a LIKE pattern (a search, a path prefix)

# What a reader lets SQLite do: ``sqlite3.Connection.setlimit`` (Python 3.11+). The length limit is the one that
# bounds a single function call (``hex(zeroblob(50000000))`` fails at once instead of allocating 100 MB).
_READ_LIMITS = (("SQLITE_LIMIT_LENGTH", MAX_VALUE_BYTES), ("SQLITE_LIMIT_SQL_LENGTH", 1_000_000),
                ("SQLITE_LIMIT_COLUMN", 500), ("SQLITE_LIMIT_EXPR_DEPTH", 200),
                ("SQLITE_LIMIT_COMPOUND_SELECT", 50), ("SQLITE_LIMIT_VDBE_OP", 200_000),
                ("SQLITE_LIMIT_FUNCTION_ARG", 32), ("SQLITE_LIMIT_ATTACHED", 0),
                ("SQLITE_LIMIT_LIKE_PATTERN_LENGTH", MAX_LIKE_PATTERN), ("SQLITE_LIMIT_VARIABLE_NUMBER", 10_000),
                ("SQLITE_LIMIT_TRIGGER_DEPTH", 1), ("SQLITE_LIMIT_WORKER_THREADS", 0))


def limit_reads(conn: sqlite3.Connection) -> bool:
    """Bound what SQLite may build on ``conn`` (``_READ_LIMITS``); False where Python has no ``setlimit`` (3.10)."""
    setlimit = getattr(conn, "setlimit", None)
    if setlimit is None:
        return False
    for name, value in _READ_LIMITS:
        category = getattr(sqlite3, name, None)
        if category is not None:
            setlimit(category, value)
    return True


def bound_time(conn: sqlite3.Connection, deadline: float) -> None:
    """Abort whatever ``conn`` runs once ``time.monotonic()`` passes ``deadline`` (sqlite3.OperationalError
    "interrupted")."""
    conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 2000)


# ---------------------------------------------------------------------------------- the contract's tables
@dataclass(frozen=True)
class Column:
    """One column of the contract, as ``schema.DDL`` declares it."""

    table: str
    name: str
    type: str                  # INTEGER, REAL, TEXT or BLOB
    not_null: bool
    key: bool                  # in the primary key or in an index: rows are selected by it
    json: str | None           # "array", "object" or "any" for a JSON column (its DDL comment says so), else None


@dataclass(frozen=True)
class Contract:
    """The tables of ``schema.DDL``: their columns in order, their ``CREATE TABLE`` and ``CREATE INDEX``
    statements apart (a copy fills the tables first and indexes them after)."""

    columns: MappingProxyType[str, tuple[Column, ...]]
    create_tables: tuple[str, ...]
    create_indexes: tuple[str, ...]
    index_names: frozenset[str]

    def names(self, table: str) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns[table])


def _comments() -> dict[tuple[str, str], str]:
    """(table, column) -> the DDL's comment on that column's line."""
    out: dict[tuple[str, str], str] = {}
    for m in re.finditer(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\n\)", DDL, re.S):
        for line in m.group(2).splitlines():
            col = re.match(r"\s*(\w+)\s+(?:INTEGER|REAL|TEXT|BLOB)\b[^-]*(?:--\s*(.*))?$", line)
            if col:
                out[(m.group(1), col.group(1))] = col.group(2) or ""
    return out


def _json_kind(comment: str) -> str | None:
    if "JSON list" in comment:
        return "array"
    if "JSON object" in comment or "JSON: {" in comment:
        return "object"
    return "any" if "JSON" in comment else None


def _statements(script: str) -> Iterator[str]:
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            yield buf.strip()
            buf = ""


@functools.lru_cache(maxsize=1)
def contract() -> Contract:
    """The contract as ``schema.DDL`` states it (read from the DDL itself: a column added there is known here)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(DDL)
        comments = _comments()
        columns: dict[str, tuple[Column, ...]] = {}
        for table in TABLES:
            indexed = {str(r[2]) for idx in db.execute(f"PRAGMA index_list({table})").fetchall()
                       for r in db.execute(f"PRAGMA index_info({idx[1]!s})")}
            columns[table] = tuple(
                Column(table, name, str(decl).upper() or "ANY", bool(not_null), bool(pk) or name in indexed,
                       _json_kind(comments.get((table, name), "")))
                for _, name, decl, not_null, _, pk in db.execute(f"PRAGMA table_info({table})"))
        index_names = frozenset(str(r[0]) for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"))
    finally:
        db.close()
    statements = list(_statements(DDL))
    return Contract(MappingProxyType(columns),
                    tuple(s for s in statements if s.upper().startswith("CREATE TABLE")),
                    tuple(s for s in statements if s.upper().startswith("CREATE INDEX")), index_names)


# ---------------------------------------------------------------------------------- the schema audit
def shown_name(name: object) -> str:
    """A name from a store, fit for one line of a message: control characters escaped, cut to ``SHOWN_NAME``."""
    text = str(name).encode("unicode_escape", "backslashreplace").decode("ascii")
    return repr(text if len(text) <= SHOWN_NAME else text[:SHOWN_NAME] + "…")


@dataclass(frozen=True)
class SchemaAudit:
    """What a store's schema holds: its version, the contract's tables it has (each with its columns) and the
    foreign objects ignored (never read, never copied), each described in a few words."""

    version: int
    tables: MappingProxyType[str, tuple[str, ...]]
    ignored: tuple[str, ...]

    def note(self, where: object) -> str | None:
        """One line naming the ignored objects, or None when there are none."""
        if not self.ignored:
            return None
        more = len(self.ignored) - 5
        names = ", ".join(self.ignored[:5]) + (f" and {more} more" if more > 0 else "")
        return f"{where}: ignored {names}: modscope writes no such object (never read, never copied)"


def audit(conn: sqlite3.Connection, where: object) -> SchemaAudit:
    """Check the schema of the store open on ``conn``; raise UntrustedStoreError (one line naming ``where`` and the
    object) for what would run the file's own SQL when the contract's tables are read: a view or a virtual table
    under a table's name, a generated column. Missing tables are left to the caller (a live store may not have
    them yet)."""
    version = int(conn.execute("PRAGMA main.user_version").fetchone()[0])
    rows = conn.execute("SELECT type, name, tbl_name, substr(sql, 1, 30) FROM main.sqlite_master LIMIT ?",
                        (MAX_SCHEMA_OBJECTS + 1,)).fetchall()
    if len(rows) > MAX_SCHEMA_OBJECTS:
        raise UntrustedStoreError(f"{where}: more than {MAX_SCHEMA_OBJECTS:,} schema objects; modscope writes a "
                                  "few dozen")
    known = contract()
    ignored: list[str] = []
    present: dict[str, tuple[str, ...]] = {}
    for kind, name, on, sql_head in rows:
        if name in TABLES:
            if kind != "table" or str(sql_head or "").upper().startswith("CREATE VIRTUAL"):
                what = "virtual table" if kind == "table" else kind
                raise UntrustedStoreError(f"{where}: {name} is a {what}; expected the table modscope writes")
            present[name] = _columns_of(conn, name, where)
        elif kind == "index" and (name in known.index_names or str(name).startswith("sqlite_autoindex_")) \
                and on in TABLES:
            continue
        elif str(name).startswith("sqlite_") and kind == "table":
            if name != "sqlite_sequence":
                ignored.append(f"table {shown_name(name)}")
        else:
            ignored.append(f"{kind} {shown_name(name)}" + (f" on {shown_name(on)}" if on != name else ""))
    return SchemaAudit(version, MappingProxyType(present), tuple(ignored))


def _columns_of(conn: sqlite3.Connection, table: str, where: object) -> tuple[str, ...]:
    names = []
    for _, name, _, _, _, _, hidden in conn.execute(f"PRAGMA main.table_xinfo({table})"):
        if hidden:
            raise UntrustedStoreError(f"{where}: {table}.{shown_name(name)[1:-1]} is a generated column; modscope "
                                      "writes none (reading it would run the file's own SQL)")
        names.append(str(name))
    missing = [c for c in contract().names(table) if c not in names and c not in dict(ADDED_COLUMNS.get(table, ()))]
    if missing:
        raise UntrustedStoreError(f"{where}: table {table} has no column {', '.join(missing)}; not a modscope store")
    return tuple(names)


# ---------------------------------------------------------------------------------- the snapshot
def read_only_uri(path: Path, *, immutable: bool = False) -> str:
    return f"file:{urllib.parse.quote(str(path.resolve()))}?{'immutable=1' if immutable else 'mode=ro'}"


def _writer_may_be_at(path: Path) -> bool:
    return any(os.path.exists(f"{path}{suffix}") for suffix in (LOCK_SUFFIX, "-wal", "-journal"))


def _open_source(path: Path, deadline: float) -> sqlite3.Connection:
    """``path`` read-only and bounded; a finished WAL-mode store in a folder this process cannot write is read as
    immutable (SQLite cannot create its -shm file there, and nothing writes it any more)."""
    if not path.is_file():
        raise UntrustedStoreError(f"{path}: no such store file")
    conn = sqlite3.connect(read_only_uri(path), uri=True, timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA main.user_version").fetchone()
    except sqlite3.OperationalError as exc:
        conn.close()
        if _writer_may_be_at(path) or not ("unable to open" in str(exc) or "readonly" in str(exc)):
            raise
        conn = sqlite3.connect(read_only_uri(path, immutable=True), uri=True, isolation_level=None)
    limit_reads(conn)
    bound_time(conn, deadline)
    return conn


def _copy_one(dst: sqlite3.Connection, path: Path, first: bool, deadline: float) -> int:
    """Copy the contract's columns of the contract's tables of the store at ``path`` into ``dst``, in one read
    transaction (the store as of one instant); returns its schema version."""
    src = _open_source(path, deadline)
    try:
        checked = audit(src, path)
        if checked.version > SCHEMA_VERSION:
            raise UntrustedStoreError(f"{path}: written by schema version {checked.version}; this modscope copies "
                                      f"up to {SCHEMA_VERSION}")
        missing = [t for t in TABLES if t not in checked.tables and ADDED_TABLES.get(t, 0) <= max(checked.version, 1)]
        if missing or checked.version < 1:
            raise UntrustedStoreError(f"{path}: not a modscope store (missing tables: {', '.join(missing) or 'none'}"
                                      f", schema version {checked.version})")
        src.execute("BEGIN")
        try:
            for table, have in checked.tables.items():
                cols = [c for c in contract().names(table) if c in have]
                names = ", ".join(f'"{c}"' for c in cols)
                # the first store's meta is the snapshot's; another rank's adds only the keys it lacks
                verb = "INSERT OR IGNORE" if table == "meta" and not first else "INSERT OR REPLACE"
                rows = src.execute(f'SELECT {names} FROM main."{table}"')
                dst.executemany(f'{verb} INTO main."{table}" ({names}) VALUES ({", ".join("?" * len(cols))})', rows)
        finally:
            src.execute("ROLLBACK")
        return checked.version
    finally:
        src.close()


def copy_stores(sources: Sequence[str | os.PathLike[str]], dest: str | os.PathLike[str], *,
                timeout_s: float = SNAPSHOT_TIMEOUT_S) -> Path:
    """The stores ``sources`` (the ranks of one run) as one new file at ``dest``: created from ``schema.DDL``, the
    contract's columns copied row by row (never the files' own triggers, views or other objects; none of their SQL
    runs), each source in one read transaction, the whole bounded by ``timeout_s``. Its meta says of which files
    (their names, not where they were) and when. Written beside ``dest`` and renamed into place complete, or not at
    all. Raises UntrustedStoreError (one line naming the file) for a store it will not copy, or one that took too
    long."""
    paths = [Path(p) for p in sources]
    if not paths:
        raise UntrustedStoreError("snapshot needs at least one store")
    dest = Path(dest)
    if dest.is_dir():
        raise UntrustedStoreError(f"snapshot path {str(dest)!r} is a directory; expected a file path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _create_partial(dest)
    deadline = time.monotonic() + timeout_s
    current = paths[0]
    try:
        dst = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            _check_opened(dst, tmp, fd)
            bound_time(dst, deadline)
            dst.execute("PRAGMA journal_mode=OFF")       # a new file, renamed into place only when complete
            dst.execute("PRAGMA synchronous=OFF")
            dst.execute("BEGIN")
            for statement in contract().create_tables:
                dst.execute(statement)
            versions = []
            for i, current in enumerate(paths):
                versions.append(_copy_one(dst, current, i == 0, deadline))
            current = dest
            for statement in contract().create_indexes:
                dst.execute(statement)
            names = [p.name for p in paths]
            dst.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('snapshot_of', ?), ('snapshot_at', ?)",
                        (json.dumps(names if len(names) > 1 else names[0]), json.dumps(time.time())))
            dst.execute(f"PRAGMA user_version = {int(versions[0])}")
            dst.execute("COMMIT")
            dst.execute("PRAGMA journal_mode=DELETE")
        finally:
            dst.close()
        os.replace(tmp, dest)
    except sqlite3.Error as exc:
        _remove_partial(tmp, fd)
        text = " ".join(str(exc).split())
        if "interrupted" in text:
            raise UntrustedStoreError(f"{current}: the snapshot took longer than {timeout_s:g} s; stopped") from None
        if "too big" in text:
            text = f"holds a string or blob longer than {MAX_VALUE_BYTES:,} bytes (modscope writes none)"
        raise UntrustedStoreError(f"{current}: cannot copy ({text})") from None
    except BaseException:
        _remove_partial(tmp, fd)
        raise
    finally:
        os.close(fd)
    return dest


# The snapshot is written beside ``dest``, in a folder others may be able to write to (a shared run directory):
# its temporary file is created here, never through a link planted at its name. (probes/store/run_files.py does
# the same for the writer's files; this module is loaded by the dashboard, which imports nothing else of probes.)
_NEW_FILE = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _left_by_a_snapshot(st: os.stat_result) -> bool:
    """A regular file of this user with one link: what a stopped snapshot of this user leaves."""
    return (stat.S_ISREG(st.st_mode) and st.st_nlink == 1
            and (not hasattr(os, "geteuid") or st.st_uid == os.geteuid()))


def _create_partial(dest: Path) -> tuple[Path, int]:
    """``<dest>.partial``, created by this call (``O_CREAT | O_EXCL | O_NOFOLLOW``), and its descriptor. One that a
    stopped snapshot left is replaced; anything else there (a link, a pipe, another user's file) is left as it is
    and the snapshot refused with one line."""
    tmp = dest.with_name(dest.name + ".partial")
    for _ in range(3):
        try:
            return tmp, os.open(tmp, _NEW_FILE, 0o644)
        except FileExistsError:
            pass
        try:
            st = os.lstat(tmp)
        except FileNotFoundError:
            continue
        if not _left_by_a_snapshot(st):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a file this snapshot may replace"
            raise UntrustedStoreError(f"{tmp}: {what}; a snapshot is written to a file it creates itself and never "
                                      "through a link (another user may have put it there): remove it, or write "
                                      "the snapshot elsewhere")
        os.unlink(tmp)
    raise UntrustedStoreError(f"{tmp}: keeps appearing; write the snapshot elsewhere")


def _check_opened(dst: sqlite3.Connection, tmp: Path, fd: int) -> None:
    """The file SQLite opened is the one created at ``tmp`` (not a link swapped in since: SQLite resolves a link
    in a database's name, and ``PRAGMA database_list`` names the file it opened)."""
    row = dst.execute("PRAGMA database_list").fetchone()
    opened = row[2] if row is not None else ""
    try:
        here, made = os.lstat(tmp), os.fstat(fd)
        same = (opened == os.path.realpath(tmp) and not stat.S_ISLNK(here.st_mode)
                and (here.st_dev, here.st_ino) == (made.st_dev, made.st_ino))
    except OSError:
        same = False
    if not same:
        raise UntrustedStoreError(f"{tmp}: was replaced while the snapshot opened it (SQLite opened "
                                  f"{opened or 'another file'}); write the snapshot elsewhere")


def _remove_partial(tmp: Path, fd: int) -> None:
    """Remove ``tmp`` if it is still the file this snapshot created (never what took its name since)."""
    try:
        here, made = os.lstat(tmp), os.fstat(fd)
        if (here.st_dev, here.st_ino) == (made.st_dev, made.st_ino) and not stat.S_ISLNK(here.st_mode):
            os.unlink(tmp)
    except OSError:
        pass
