"""modscope dashboard: a Dash app that reads the run store written by ``probes``.

This package never imports torch or ``probes``: a reviewer opens a snapshot on a
machine without either. The store's contract is the schema (docs/schema.md); the
data-access module :mod:`dashboard.read.store` checks the version it reads.
"""
