"""The log of errors caught inside modscope (a hook that raised, a failed write): counted and kept by where they
happened and their type, and written to the store's ``probe_errors`` table."""

from __future__ import annotations

import dataclasses

MESSAGE_LIMIT = 500


@dataclasses.dataclass
class ErrorEntry:
    message: str
    count: int
    first_step: int
    last_step: int


class ErrorLog:
    """Errors caught inside modscope, by (location, exception type)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], ErrorEntry] = {}
        self.total = 0
        self.dirty = False          # changed since the store last got a copy

    def record(self, location: str, exc: BaseException, step: int) -> None:
        self.record_message(location, type(exc).__name__, str(exc), step)

    def record_message(self, location: str, error_type: str, message: str, step: int, count: int = 1) -> None:
        key = (location, error_type)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = ErrorEntry("", 0, step, step)
        entry.count += count
        entry.last_step = step
        entry.message = " ".join(message.split())[:MESSAGE_LIMIT]
        self.total += count
        self.dirty = True
