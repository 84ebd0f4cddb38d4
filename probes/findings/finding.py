"""The Finding type: what modscope reports. Pure data, no torch.

The rules that build findings are in :mod:`probes.findings.rules`, one per code. Codes, severities, badge labels
and fixes are part of the store's contract and live in :mod:`probes.schema`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from ..schema import CODES as CODE_INFO
from ..schema import SEVERITY_ORDER, Severity, display_path, printable

__all__ = ["CODES", "SEVERITIES", "Finding", "Seen", "make", "sort_findings"]

SEVERITIES = tuple(str(s) for s in Severity)
# code -> (default severity, fix), the public view of the codes (``probes.CODES``)
CODES: dict[str, tuple[str, str]] = {str(code): (str(info.severity), info.fix) for code, info in CODE_INFO.items()}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem found in a model, at one path.

    ``step`` is the last step it was seen in and ``first_step`` the first; ``count`` how often it was seen
    (sampled steps for a finding about a state, occurrences for one about an event). ``cause`` is the
    ``(code, path)`` of the finding that explains this one (three layers kept in a plain list are
    *unregistered*; that they do not update is a consequence), or None for a root cause.
    """

    code: str
    severity: str
    path: str
    message: str
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    fix: str = ""
    step: int | None = None
    cause: tuple[str, str] | None = None
    first_step: int | None = None
    count: int = 1
    # what the rules' causes read (never stored): the variant of a code that has several, the path this finding
    # comes from (the first dead layer of a chain, the replacement of a stale tensor) and the modules (or tensors) it
    # names
    kind: str = dataclasses.field(default="", compare=False)
    related: str | None = dataclasses.field(default=None, compare=False)
    members: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.code not in CODE_INFO:
            raise ValueError(f"unknown finding code {self.code!r}; expected one of {sorted(CODE_INFO)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; expected one of {SEVERITIES}")

    @property
    def key(self) -> tuple[str, str]:
        return (self.code, self.path)

    @property
    def is_event(self) -> bool:
        """About something that happened (stays until evidence of the fix), not a state re-checked each step."""
        return CODE_INFO[self.code].event

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "path": self.path, "message": self.message,
                "evidence": dict(self.evidence), "fix": self.fix, "step": self.step, "first_step": self.first_step,
                "count": self.count, "cause": list(self.cause) if self.cause else None}

    def __str__(self) -> str:
        return printable(f"[{self.severity}] {self.code} at {display_path(self.path)}: {self.message}")


@dataclasses.dataclass(frozen=True)
class Links:
    """What a finding's causes are told by (:class:`Finding`'s ``kind``, ``related`` and ``members``)."""

    kind: str = ""
    related: str | None = None
    members: tuple[str, ...] = ()


NO_LINKS = Links()


@dataclasses.dataclass(frozen=True)
class Seen:
    """When a finding was seen: the step it was last seen at (None: from the structure, before any step), the first
    step, and how many times."""

    step: int | None = None
    first_step: int | None = None
    count: int = 1


NOT_SEEN = Seen()


def make(code: str, path: str, message: str, evidence: dict[str, Any] | None = None,
         severity: str | None = None, *, seen: Seen = NOT_SEEN, fix: str | None = None,
         links: Links = NO_LINKS) -> Finding:
    """``fix``: this finding's own, when the code's (schema.CODES) does not fit the case."""
    info = CODE_INFO[code]
    return Finding(code=str(code), severity=str(severity or info.severity), path=path, message=message,
                   evidence=evidence or {}, fix=fix or info.fix, step=seen.step, first_step=seen.first_step,
                   count=seen.count, kind=links.kind, related=links.related, members=links.members)


@dataclasses.dataclass(frozen=True)
class ModuleGroup:
    """Modules one finding names together (a grouped finding sits at the root or at its first module), and when
    they were seen: the first step of any, the last step of any, the most times any was seen."""

    paths: Sequence[str]
    types: Sequence[str]
    first_step: int
    step: int
    count: int

    @property
    def one(self) -> bool:
        return len(self.paths) == 1

    def shown(self) -> str:
        """The first five paths as users read them, and how many more."""
        paths = self.paths
        return ", ".join(display_path(p) for p in paths[:5]) + (f" and {len(paths) - 5:,} more" if len(paths) > 5
                                                                 else "")

    def evidence(self, **more: Any) -> dict[str, Any]:
        return {"modules": list(self.paths[:50]), "n_modules": len(self.paths), **more}


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (SEVERITY_ORDER[Severity(f.severity)], f.code, f.path))


def fmt_number(n: int) -> str:
    return f"{n:,}"


def fmt_size(n: int) -> str:
    """23,512,128 as 23.5M."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


def fmt_times(count: int) -> str:
    return "once" if count == 1 else f"{count:,} times"


