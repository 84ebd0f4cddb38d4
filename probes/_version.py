"""The version of the modscope distribution (probes and dashboard ship together)."""

__version__ = "0.2.0"
