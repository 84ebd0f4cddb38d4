"""A store file read as one object: :class:`Store` is the connection (:mod:`.connection`) with every query of the
read side (:mod:`.module_queries`, :mod:`.finding_queries`, :mod:`.run_queries`, :mod:`.series_queries`). Every SQL
statement of the dashboard lives in the read side (and the checked views every connection reads through, in
:mod:`dashboard.read.store_guard`: a store is untrusted input).

A :class:`Store` reads one store file (one rank's, a version-1 run's, or a snapshot); :class:`dashboard.read.run.Run`
reads the rank files of one run as one, on top of it. A store that a writer may still be writing (a followed run; a
file next to a ``-wal``, a ``-journal`` or the writer's ``.lock``) is opened ``file:...?mode=ro``, whatever its
journal mode; a snapshot that nothing writes ``?immutable=1``. Every query is parameterised, row-limited
(``LIMIT``) and time-limited (a progress handler aborts it after ``timeout_s``).

What the store looks like comes from :mod:`probes.schema`, the only thing the dashboard imports from ``probes``.
Stores of every version from ``MIN_READ_VERSION`` to ``SCHEMA_VERSION`` are read: a column added after a store's
version (``schema.ADDED_COLUMNS``) reads as its default.

This module is also the read side's front door: the names its users need are imported here.
"""

from __future__ import annotations

from .causes import fold_causes, root_counts
from .connection import (
    MAX_CHILDREN,
    MAX_COMPARE_MODULES,
    MAX_FINDINGS,
    MAX_HEAT_COLUMNS,
    MAX_KEYS,
    MAX_PARAMS,
    MAX_POINTS,
    MAX_SEARCH,
    MAX_STEP_LIST,
    MAX_TENSORS,
    RECENT_STEPS,
    REMOVED,
    Row,
    severity_rank,
)
from .errors import QueryTimeoutError, StoreError, StoreNotReadyError, one_line
from .files import (
    SQLITE_HEADER,
    check_header,
    in_wal_mode,
    last_modified,
    resolve_store_path,
    snapshot_bytes,
    snapshot_to,
    snapshot_with_step,
    writer_present,
)
from .liveness import (
    ChangeSignature,
    CloseValues,
    Heartbeat,
    Liveness,
    RunState,
    StoreInfo,
    WriteTrouble,
    duration_text,
    liveness,
    process_alive,
    snapshot_liveness,
    status_text,
)
from .series_queries import SeriesQueries

__all__ = ["MAX_CHILDREN", "MAX_COMPARE_MODULES", "MAX_FINDINGS", "MAX_HEAT_COLUMNS", "MAX_KEYS", "MAX_PARAMS",
           "MAX_POINTS", "MAX_SEARCH", "MAX_STEP_LIST", "MAX_TENSORS", "RECENT_STEPS", "REMOVED", "SQLITE_HEADER",
           "ChangeSignature", "CloseValues", "Heartbeat", "Liveness", "QueryTimeoutError", "Row", "RunState", "Store",
           "StoreError", "StoreInfo", "StoreNotReadyError", "WriteTrouble", "check_header", "duration_text",
           "fold_causes", "in_wal_mode", "last_modified", "liveness", "one_line", "process_alive",
           "resolve_store_path", "root_counts", "severity_rank", "snapshot_bytes", "snapshot_liveness",
           "snapshot_to", "snapshot_with_step", "status_text", "writer_present"]


class Store(SeriesQueries):
    """Read access to one store file (a live run's rank, or a snapshot).

    ``live=True``: the file may not exist yet and is being written (WAL): opened read-only. With ``run_dir`` the file
    is looked for in that directory (again on every check) until one exists. ``live=False``: a snapshot, opened
    immutable; it must exist and be valid at once.
    """
