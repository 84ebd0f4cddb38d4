"""What modscope reports: the Finding type, the rules that make findings (structural, windowed, events), their
causes, and the tracker that turns changes into store operations.

Importing this package needs no torch: ``Finding`` and ``CODES`` are plain data."""

from .finding import CODES, SEVERITIES, Finding, sort_findings

__all__ = ["CODES", "SEVERITIES", "Finding", "sort_findings"]
