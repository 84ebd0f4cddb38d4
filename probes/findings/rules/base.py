"""What every finding rule declares: its code, what it reads, when it fires, an example, and which other findings it
explains (the causes, as data). Its default severity, badge label and fix are the store's contract
(:data:`probes.schema.CODES`): the dashboard reads them without this package.

One class per finding code, as torch profiler's pattern matcher has one class per pattern; the list of them is
:data:`probes.findings.rules.RULES`. A rule's builders (static methods) make its findings; the code that observes
what it reads (the structure walk, the sampled steps' window, the events of a step) calls them.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...schema import CODES, CodeInfo, FindingCode, StrEnum
from ..finding import Finding


class Reads(StrEnum):
    """What a rule's evidence comes from."""

    STRUCTURE = "the model's structure (no forward needed: `probes.audit` shows it too)"
    RUN_TIME = "the modules the model's forward calls (sampled steps)"
    SAMPLES = "the statistics of the sampled steps' window"
    EVENTS = "what happened in a step (a forward, a backward, an optimizer step)"
    CHECKPOINT = "a state dict loaded into the model"
    RANKS = "every rank's store (computed by the reader)"


def under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or inside it (``encoder.blocks[0]`` is under ``encoder``)."""
    return path == prefix or path.startswith((prefix + ".", prefix + "["))


class Relation(StrEnum):
    """How a root cause's finding relates to the consequence it explains."""

    AT_OR_BELOW = "at its path or below it"
    SAME_PATH = "at its path"
    POINTS_AT = "that names it as where it comes from"
    MEMBERS_UNDER = "whose modules all lie under its path"
    NAMED_BY = "at a path it names"

    def holds(self, root: Finding, consequence: Finding) -> bool:
        if self is Relation.AT_OR_BELOW:
            return bool(root.path) and under(consequence.path, root.path)
        if self is Relation.SAME_PATH:
            return root.path == consequence.path
        if self is Relation.POINTS_AT:
            return consequence.related == root.path and root.path != consequence.path
        if self is Relation.NAMED_BY:
            return consequence.path in root.members
        members = consequence.members
        return bool(members) and all(under(m, root.path) for m in members)


@dataclasses.dataclass(frozen=True)
class Explains:
    """A finding of the rule's code explains a finding of ``code`` that stands in ``relation`` to it; with
    ``root_kinds``, only a root finding of one of those kinds does."""

    code: FindingCode
    relation: Relation
    root_kinds: frozenset[str] = frozenset()

    def by(self, root: Finding, consequence: Finding) -> bool:
        return (consequence.code == self.code and (not self.root_kinds or root.kind in self.root_kinds)
                and self.relation.holds(root, consequence))


class Rule:
    """One finding code. Subclasses set the class attributes and hold the builders of their findings."""

    code: ClassVar[FindingCode]
    reads: ClassVar[Reads]
    severities: ClassVar[str]          # when it is which severity, as users read it
    meaning: ClassVar[str]             # what it means, as users read it (markdown)
    example: ClassVar[str]             # a few lines of PyTorch that show it
    explains: ClassVar[tuple[Explains, ...]] = ()

    @classmethod
    def info(cls) -> CodeInfo:
        return CODES[cls.code]
