"""The path grammar of the store: how modules and tensors are named, part of the contract (``probes.schema``
imports it for both sides). Standard library only.

Registered things go by PyTorch's names (``""`` is the root); unregistered ones by their Python path from the root
(``.name``, ``[0]``, ``['key']``, ``{0}``); modules reachable from nowhere as ``<unreachable Type>``.
"""

from __future__ import annotations

import re

__all__ = ["ROOT_DISPLAY", "attr_path", "display_path", "item_path", "key_path", "member_path",
           "module_path_candidates", "normalize_path", "printable", "runtime_label"]

ROOT_DISPLAY = "<root>"


def display_path(path: str) -> str:
    """A path as shown to people: the root (``""``) is ``<root>``."""
    return path or ROOT_DISPLAY


def printable(text: str) -> str:
    """``text`` for a terminal: what is not printable (control characters such as ESC, which could move the cursor,
    recolour or retitle the terminal; bidirectional overrides; line separators) escaped as ``\\xNN`` / ``\\uNNNN``.
    Module names, paths and messages come from the user's model and from store files of others."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else
                   f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                   else f"\\U{ord(c):08x}" for c in text)


def attr_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def item_path(prefix: str, index: int) -> str:
    return f"{prefix}[{index}]"


def key_path(prefix: str, key: object, position: int) -> str:
    """A mapping item: ``['key']`` / ``[3]`` for str and int keys, the position for any other key."""
    label = repr(key) if isinstance(key, (str, int)) else str(position)
    return f"{prefix}[{label}]"


def member_path(prefix: str, position: int) -> str:
    return f"{prefix}{{{position}}}"


def runtime_label(type_name: str, occurrence: int) -> str:
    """The label of the ``occurrence``-th run-time module of one type under one caller."""
    return f"<unreachable {type_name}>" if occurrence == 0 else f"<unreachable {type_name}#{occurrence}>"


def normalize_path(path: str) -> str:
    """The registered spelling of a Python path, so that a run before a fix (``encoder.blocks[0]``)
    lines up with the run after it (``encoder.blocks.0``)."""
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return re.sub(r"\[['\"]([^'\"]*)['\"]\]", r".\1", path)


def module_path_candidates(path: str, limit: int = 64) -> list[str]:
    """``path`` and its prefixes, longest first, ending with the root: where a finding about a tensor or
    an optimizer entry is drawn (its longest module prefix)."""
    out = [path]
    p = path
    while p and len(out) < limit:
        cut = max(p.rfind("."), p.rfind("["))
        p = p[:cut] if cut > 0 else ""
        out.append(p)
    return out


