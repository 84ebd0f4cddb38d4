"""The Findings page says how many findings it did not read (a store with 2,350 active findings: 2,000 are read),
in a real headless Chromium against a real server."""

from __future__ import annotations

import pytest
from browser_helpers import click, wait_text

from bench import synth_store
from dashboard.read.store import MAX_FINDINGS

pytestmark = pytest.mark.browser

MORE = 350


def test_the_findings_page_says_how_many_more_there_were(page, server_factory, tmp_path):
    store = synth_store.many_findings(tmp_path / "modscope.sqlite", MAX_FINDINGS + MORE)
    srv = server_factory(["--snapshot", str(store)])
    page.get(srv.url)
    click(page, ".nav-link", "Findings")
    wait_text(page, f"{MORE} more findings not shown: only the {MAX_FINDINGS:,} most severe of each rank are read",
              "#findings-list .findings-cap")
