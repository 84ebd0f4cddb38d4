"""One bug, one card: a finding that is a consequence of another names it as its cause.

Three Linear layers kept in a plain list are one bug (``unregistered-module``); that their weights do not update and
that their gradients are never zeroed are its consequences. Which code explains which, and how the two findings must
relate (at or below its path, at its path, named by the consequence, its modules all under it), is data on each rule
(:attr:`probes.findings.rules.Rule.explains`); ``docs/findings.md`` lists it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

from .finding import Finding
from .rules import RULES


def assign_causes(found: Iterable[Finding]) -> list[Finding]:
    """``found`` with ``cause`` set on every finding another one explains: the first rule in ``RULES`` order that
    explains it, and of that rule's findings the deepest (longest path) that stands in the relation."""
    items = list(found)
    roots: dict[str, list[Finding]] = defaultdict(list)
    for f in items:
        roots[f.code].append(f)
    for candidates in roots.values():
        candidates.sort(key=lambda f: len(f.path), reverse=True)
    explaining = {(str(link.code), str(rule.code)): link for rule in RULES for link in rule.explains}
    out = []
    for f in items:
        cause = None
        for rule in RULES:
            link = explaining.get((f.code, str(rule.code)))
            if link is None:
                continue
            root = next((r for r in roots.get(rule.code, ()) if r is not f and link.by(r, f)), None)
            if root is not None:
                cause = root.key
                break
        out.append(dataclasses.replace(f, cause=(str(cause[0]), cause[1])) if cause is not None else f)
    return out

