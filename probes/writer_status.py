"""``<store>.status``: the writer's health, part of the contract (``probes.schema`` imports it for both sides).
Standard library only.

JSON padded to STATUS_BYTES and overwritten in place (no new disk blocks), so it can still say "failing" when the
disk is full and the store takes no more commits.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ._compat import StrEnum

__all__ = ["STATUS_BYTES", "STATUS_SUFFIX", "WriterState", "WriterStatus", "encode_status", "read_status",
           "status_path"]

STATUS_SUFFIX = ".status"     # <store>.status: the writer's health, overwritten in place (readable on a full disk)
STATUS_BYTES = 1024


class WriterState(StrEnum):
    OK = "ok"
    FAILING = "failing"          # commits fail now (disk full, I/O error); the writer retries


@dataclass(frozen=True)
class WriterStatus:
    state: WriterState
    updated_at: float            # unix seconds of this report
    failing_since: float | None = None
    error: str | None = None     # SQLite's message for the last failed commit, one line
    failed_commits: int = 0      # since the run started
    dropped_samples: int = 0     # since the run started (queue full or failed commits)


def status_path(store_path: str | os.PathLike[str]) -> Path:
    return Path(str(store_path) + STATUS_SUFFIX)


def encode_status(status: WriterStatus) -> bytes:
    doc = {"state": str(status.state), "updated_at": status.updated_at, "failing_since": status.failing_since,
           "error": (status.error or "")[:600] or None, "failed_commits": status.failed_commits,
           "dropped_samples": status.dropped_samples}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return raw.ljust(STATUS_BYTES, b" ")[:STATUS_BYTES]


def read_status(store_path: str | os.PathLike[str]) -> WriterStatus | None:
    """The writer's last health report for the store at ``store_path``, or None (no report, or one that
    cannot be read: a status is advice, never a reason to refuse a store)."""
    try:
        doc = json.loads(_read_regular(status_path(store_path), STATUS_BYTES).decode().strip() or "null")
        return WriterStatus(state=WriterState(doc["state"]), updated_at=float(doc["updated_at"]),
                            failing_since=doc.get("failing_since"), error=doc.get("error"),
                            failed_commits=int(doc.get("failed_commits") or 0),
                            dropped_samples=int(doc.get("dropped_samples") or 0))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file, never through a link nor blocking on a pipe (a name in a shared
    run directory may be anything): OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)
