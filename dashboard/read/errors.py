"""What goes wrong reading a store, as one line each."""

from __future__ import annotations


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


class StoreError(Exception):
    """A store cannot be read; ``str()`` is one line naming the path and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class StoreNotReadyError(StoreError):
    """A live store that does not exist yet (or is still being created)."""


class QueryTimeoutError(StoreError):
    """A query ran past the store's time limit and was aborted."""
