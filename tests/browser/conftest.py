"""Fixtures for the browser tests (the helpers live in browser_helpers.py, importable by name)."""

from browser_helpers import browser, download_dir, page, server_factory  # noqa: F401
