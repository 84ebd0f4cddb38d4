"""`rank-straggler`: one rank computes much slower than the others. The dashboard computes it from every rank's
store (dashboard/read/crossrank.py): this rule describes it."""

from __future__ import annotations

from ...schema import FindingCode
from .base import Reads, Rule


class RankStraggler(Rule):
    code = FindingCode.RANK_STRAGGLER
    reads = Reads.RANKS
    severities = "warning"
    meaning = (
        "one rank's own time per step (its wall time less its waits for the other ranks in backward and the "
        "optimizer step) is at least 1.5× the others' in most recent windows (computed by the reader, so a slow rank "
        "is named under DDP's synchronous all-reduce too: [docs](dashboard.md#runs-and-ranks))")
    example = "time.sleep(0.05 * (dist.get_rank() == 1))   # one rank is slower before backward"
