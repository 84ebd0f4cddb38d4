"""Strings from a store as the pages show them: cut, so that a 20,000-character run name or a 1 MB module path
neither hangs a dropdown nor fills the page, with the whole value where the user asks for it (a tooltip, or a
"show all" toggle in the one item looked at: ``components.name_span`` and ``components.long_text``).

A store holds no string longer than ``schema.MAX_VALUE_BYTES`` (readers refuse longer ones); these bound what
one element of a page carries."""

from __future__ import annotations

import re

LABEL_MAX = 160          # a name in a list, a dropdown, a card, a table cell, a tree row
TEXT_MAX = 2_000         # a message or a fix in a finding's card
TITLE_MAX = 2_000        # a tooltip
FULL_MAX = 100_000       # the "show all" of one item (a longer value: its first FULL_MAX characters, said so)
FILENAME_MAX = 80        # the run name's part of a download's file name


def clip(text: object, limit: int = LABEL_MAX) -> str:
    """``text`` as a string of at most ``limit`` characters (a longer one ends with "…")."""
    s = "" if text is None else str(text)
    return s if len(s) <= limit else s[:max(0, limit - 1)] + "…"


def title(text: object, limit: int = LABEL_MAX) -> str | None:
    """The tooltip of a value cut to ``limit``: the value itself (up to ``TITLE_MAX``), or None when it was not cut."""
    s = "" if text is None else str(text)
    if len(s) <= limit:
        return None
    return clip(s, TITLE_MAX) + (f" ({len(s):,} characters)" if len(s) > TITLE_MAX else "")


def file_part(name: object, default: str = "run") -> str:
    """A value as part of a download's file name: letters, digits, '.', '_' and '-', at most ``FILENAME_MAX``."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", "" if name is None else str(name)[:4 * FILENAME_MAX]).strip("_")
    return s[:FILENAME_MAX].rstrip("_.") or default
