"""The browser test of framing reuses the browser tests' server fixture (tests/browser/browser_helpers.py)."""

from browser_helpers import server_factory  # noqa: F401
