"""What differs between the Python versions modscope supports (3.10 and later). Standard library only."""

from __future__ import annotations

import enum
import sys

__all__ = ["StrEnum"]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10
    class StrEnum(str, enum.Enum):
        """``enum.StrEnum`` for Python 3.10: members are strs and format as their value."""

        def __str__(self) -> str:
            return str(self.value)
