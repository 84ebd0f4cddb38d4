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
        "one rank's steps take at least 1.5× the others' in most recent windows (computed by the reader; under DDP's "
        "per-step all-reduce the others wait for it, so it rarely shows there: "
        "[docs](docs/dashboard.md#runs-and-ranks))")
    example = "time.sleep(0.05 * (dist.get_rank() == 1))   # one rank is slower before backward"
