"""What a capped read left out, said where it is shown. The findings of a rank are read ``MAX_FINDINGS`` at most
(the most severe first: ``FindingQueries.findings``), so that a store with a million of them cannot fill the
server's memory or the page; when a rank holds more, the Findings page, the report and ``modscope findings`` say how
many more there were."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .connection import MAX_FINDINGS
from .run import Run


@dataclasses.dataclass(frozen=True)
class FindingsCap:
    """The ranks whose findings were cut at ``limit``, with how many each holds."""

    limit: int
    totals: Mapping[int, int]

    @property
    def more(self) -> int:
        """Findings not read (of the rank that has the most beyond the limit: ranks mostly share theirs)."""
        return max((n - self.limit for n in self.totals.values()), default=0)

    def text(self) -> str:
        where = (f" on rank {next(iter(self.totals))}" if len(self.totals) == 1
                 else f" on ranks {', '.join(str(r) for r in sorted(self.totals))}")
        ranks = "" if len(self.totals) == 1 and 0 in self.totals else where
        per_rank = "" if len(self.totals) == 1 else " (at most)"
        return (f"{self.more:,} more findings{per_rank}{ranks} not shown: only the {self.limit:,} most severe "
                "of each rank are read")


def findings_cap(run: Run, active: bool | None = True, limit: int = MAX_FINDINGS) -> FindingsCap | None:
    """The cap that ``run.findings_merged(active)`` met, or None when every finding was read."""
    totals = {}
    for rank, store in run.stores().items():
        n = store.count_findings(rank, active=active)
        if n > limit:
            totals[rank] = n
    return FindingsCap(limit, totals) if totals else None
