"""Findings folded under their root causes (a finding names its cause), and root causes counted."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from probes.schema import (
    Severity,
)

from .connection import Row


def fold_causes(items: Sequence[Mapping[str, Any]]) -> list[Row]:
    """Root causes with their consequences folded under them: a finding whose ``cause_code`` /
    ``cause_path`` names another finding of ``items`` goes into the ``consequences`` of the root
    cause at the end of that chain; the others (root causes, and consequences whose cause is not
    among ``items``) come back in their order, each with its ``consequences`` list."""
    keyed: dict[tuple[str, str], Mapping[str, Any]] = {}
    for f in items:
        keyed.setdefault((str(f["code"]), str(f["path"])), f)

    def root_of(f: Mapping[str, Any]) -> tuple[str, str] | None:
        """The root cause ``f`` folds under (None: ``f`` is shown on its own). Causes that name each
        other in a circle (a writer's mistake) fold under the smallest of them, which stays visible."""
        own = (str(f["code"]), str(f["path"]))
        chain = [own]
        cur = f
        while cur.get("cause_code"):
            nxt = (str(cur["cause_code"]), str(cur.get("cause_path") or ""))
            if nxt not in keyed:
                break
            if nxt in chain:
                rep = min(chain[chain.index(nxt):])
                return None if rep == own else rep
            chain.append(nxt)
            cur = keyed[nxt]
        return None if len(chain) == 1 else chain[-1]

    roots: list[Row] = []
    index: dict[tuple[str, str], Row] = {}
    folded: dict[tuple[str, str], list[Row]] = {}
    for f in items:
        r = root_of(f)
        if r is None:
            row = {**f, "consequences": []}
            roots.append(row)
            index.setdefault((str(f["code"]), str(f["path"])), row)
        else:
            folded.setdefault(r, []).append({**f, "consequences": []})
    for key, consequences in folded.items():
        if key in index:
            index[key]["consequences"] = consequences
    return roots


def root_counts(roots: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Root causes by severity (a severity this version does not know counts as info)."""
    out = {str(s): 0 for s in Severity}
    for f in roots:
        sev = str(f["severity"]) if str(f["severity"]) in out else Severity.INFO.value
        out[sev] += 1
    return out


