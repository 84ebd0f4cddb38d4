"""The browser fixtures (tests/browser/browser_helpers.py) for the Chromium checks of the torchrun runs."""

from browser_helpers import browser, download_dir, page, server_factory  # noqa: F401
