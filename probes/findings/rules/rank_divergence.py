"""`rank-divergence`: replicas that data parallelism keeps identical differ between ranks. The dashboard computes it
from every rank's store (dashboard/read/crossrank.py): this rule describes it."""

from __future__ import annotations

from ...schema import FindingCode
from .base import Reads, Rule


class RankDivergence(Rule):
    code = FindingCode.RANK_DIVERGENCE
    reads = Reads.RANKS
    severities = "error"
    meaning = (
        "a parameter or buffer that data parallelism keeps identical differs between ranks (computed by the reader "
        "from every rank's fingerprints, taken at sampled steps and at close: found by the end of the run whenever it "
        "diverged)")
    example = "model.head.weight.data += 1e-3 * (dist.get_rank() == 1)   # one replica drifts"
