"""Browser tests: the pages render in a real headless Chromium against a real server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

import synth_store
from browser_helpers import click, screenshot, wait_for, wait_text

pytestmark = pytest.mark.browser


@pytest.fixture
def demo_store(tmp_path) -> Path:
    run = tmp_path / "run-before"
    synth_store.demo(run / "modscope.sqlite", steps=40)
    return run


def unregistered_rows(driver):
    return [el.get_attribute("data-path") for el in
            driver.find_elements(By.CSS_SELECTOR, ".tree-row[data-kind='unregistered']")]


def test_overview_tree_detail_findings(page, server_factory, demo_store):
    srv = server_factory(["--snapshot", str(demo_store / "modscope.sqlite")])
    page.get(srv.url)
    wait_text(page, "Classifier", "#ov-cards")
    wait_text(page, "6 errors", "#ov-cards")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#ov-loss .scatterlayer .trace"), "loss curve")
    screenshot(page, "overview")

    click(page, ".nav-link", "Modules")
    wait_for(page, lambda d: len(unregistered_rows(d)) == 3, "three unregistered blocks in the tree")
    assert sorted(unregistered_rows(page)) == [f"encoder.blocks[{i}]" for i in range(3)]
    click(page, ".tree-row[data-path='encoder.blocks[0]'] .tree-label")
    wait_text(page, "encoder.blocks[0]", "#detail-header h2")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#detail-activation .scatterlayer .trace"),
             "activation chart")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#detail-heat .heatmaplayer .hm, #detail-heat image"),
             "heat map")
    wait_text(page, "not in state_dict", "#detail-params")
    screenshot(page, "modules")

    click(page, ".nav-link", "Findings")
    wait_text(page, "unregistered-module", "#findings-list")
    screenshot(page, "findings")
    click(page, ".finding", "encoder.blocks[2].weight")
    wait_text(page, "encoder.blocks[2]", "#detail-header h2")
    assert page.current_url.endswith("/modules")


def test_opening_evidence_does_not_navigate(page, server_factory, demo_store):
    srv = server_factory(["--snapshot", str(demo_store / "modscope.sqlite")])
    page.get(srv.url + "findings")
    wait_text(page, "unregistered-module", "#findings-list")
    click(page, ".finding details summary")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".finding details[open] pre"), "evidence open")
    assert page.current_url.endswith("/findings")
