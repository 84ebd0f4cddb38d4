"""Browser tests: the pages render in a real headless Chromium against a real server."""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from pathlib import Path

import pytest
from browser_helpers import click, screenshot, wait_for, wait_text
from selenium.webdriver.common.by import By

from bench import synth_store
from probes import schema

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


def test_run_started_before_the_training_waits_then_goes_live(page, server_factory, tmp_path):
    """`--run DIR` on a run that does not exist yet says so, then shows the run once its store
    (the writer's per-rank file name) appears, and new samples appear without a reload (a
    synthetic writer, no torch needed)."""
    run = tmp_path / "later"
    srv = server_factory(["--run", str(run)])
    page.get(srv.url)
    wait_text(page, "Waiting for the first sample", "#banner")
    wait_text(page, "waiting for the first sample", "#run-status")
    writer = synth_store.demo(run / schema.store_filename("r1", 0), steps=5, live=True)
    try:
        wait_text(page, "Classifier", "#ov-cards")
        wait_text(page, "step 4", "#run-status")
        assert not page.find_element(By.ID, "banner").text
        writer.add_steps(3)
        wait_text(page, "step 7", "#run-status")
        wait_for(page, lambda d: d.execute_script(
            "return document.querySelector('#ov-loss .js-plotly-plot').data[0].x.length") == 8, "8 loss points")
    finally:
        writer.close()


def test_filter_tree_by_finding(page, server_factory, demo_store):
    srv = server_factory(["--snapshot", str(demo_store / "modscope.sqlite")])
    page.get(srv.url + "modules")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='head']"), "the tree")
    click(page, "#tree-filter")
    click(page, "[role='option'], .dash-dropdown-option, .Select-option", "not updating")
    wait_text(page, "3 matches", "#tree-info")
    paths = [el.get_attribute("data-path") for el in page.find_elements(By.CSS_SELECTOR, ".tree-row")]
    assert paths == [f"encoder.blocks[{i}]" for i in range(3)]


def test_rank_selector(page, server_factory, tmp_path):
    path = synth_store.two_ranks(tmp_path / "modscope.sqlite")
    srv = server_factory(["--snapshot", str(path)])
    page.get(srv.url + "modules")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='encoder']"), "rank 0 tree")
    click(page, "#rank-select")
    click(page, "[role='option'], .dash-dropdown-option, .Select-option", "rank 1")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='only_on_rank1']"), "rank 1 tree")
    click(page, ".nav-link", "Overview")
    wait_text(page, "rank 1 of 2", "#ov-cards")


def test_tree_works_from_the_keyboard(page, server_factory, demo_store):
    from selenium.webdriver.common.keys import Keys
    srv = server_factory(["--snapshot", str(demo_store / "modscope.sqlite")])
    page.get(srv.url + "modules")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='head']"), "the tree")
    page.find_element(By.CSS_SELECTOR, ".tree-row[data-path='head'] .tree-label").send_keys(Keys.ENTER)
    wait_text(page, "head", "#detail-header h2")
    page.find_element(By.CSS_SELECTOR, ".tree-row[data-path='encoder'] .tree-toggle").send_keys(Keys.ENTER)
    wait_for(page, lambda d: not d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='encoder.blocks[0]']"),
             "encoder collapsed")


def test_a_bad_store_that_appears_later_shows_its_error(page, server_factory, tmp_path):
    """A store written by a newer modscope appearing after the dashboard started: the one-line error
    it would have printed at start-up, not "waiting" forever."""
    run = tmp_path / "later"
    srv = server_factory(["--run", str(run)])
    page.get(srv.url)
    wait_text(page, "Waiting for the first sample", "#banner")
    p = run / schema.store_filename("r1", 0)
    synth_store.demo(p, steps=2)
    conn = sqlite3.connect(str(p))
    conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    banner = wait_text(page, f"written by schema version {schema.SCHEMA_VERSION + 1}", "#banner")
    assert banner.text == (f"{p}: written by schema version {schema.SCHEMA_VERSION + 1}, this dashboard reads up "
                           f"to {schema.SCHEMA_VERSION}")
    wait_text(page, "cannot read the store", "#run-status")


def test_header_shows_step_and_status_while_nothing_changes(page, server_factory, tmp_path):
    """Live mode on a store that does not change: the header still says the step and the status;
    a heartbeat older than 2 minutes from a process that lives reads "stalled"."""
    writer = synth_store.demo(tmp_path / "modscope.sqlite", steps=5, live=True)
    try:
        writer.set_rank(hostname=socket.gethostname(), pid=os.getpid(), updated_at=time.time())
        srv = server_factory(["--run", str(tmp_path)])
        page.get(srv.url)
        wait_text(page, "step 4 · running", "#run-status")
        writer.set_rank(updated_at=time.time() - 3 * 60 - 5)
        wait_text(page, "step 4 · stalled: no update for 3 min", "#run-status")
        screenshot(page, "stalled")
    finally:
        writer.close()
    wait_text(page, "step 4 · finished", "#run-status")            # closed: said plainly, no live badge
    assert page.find_element(By.ID, "mode-badge").text.lower() == "finished"


def test_banner_while_store_writes_fail_and_after(page, server_factory, tmp_path):
    p = tmp_path / schema.store_filename("r1", 0)
    writer = synth_store.demo(p, steps=5, live=True)
    try:
        srv = server_factory(["--run", str(tmp_path)])
        page.get(srv.url)
        wait_text(page, "Classifier", "#ov-cards")
        assert not page.find_element(By.ID, "banner").text
        since = time.time() - 30
        schema.status_path(p).write_bytes(schema.encode_status(schema.WriterStatus(
            state=schema.WriterState.FAILING, updated_at=time.time(), failing_since=since,
            error="database or disk is full", failed_commits=3, dropped_samples=120)))
        failing = wait_text(page, "Store writes are failing since", "#banner")
        clock = time.strftime("%H:%M:%S", time.localtime(since))
        assert failing.text == (f"Store writes are failing since {clock}: database or disk is full — 3 commits "
                                "failed, 120 samples dropped; training continues and modscope retries")
        screenshot(page, "store-writes-failing")
        schema.status_path(p).write_bytes(schema.encode_status(schema.WriterStatus(
            state=schema.WriterState.OK, updated_at=time.time(), error="database or disk is full",
            failed_commits=3, dropped_samples=120)))
        writer.set_rank(write_errors=3, last_error="database or disk is full")
        wait_text(page, "The store missed writes: 3 commits failed, 120 samples dropped (last error: database or "
                        "disk is full) (recovered)", "#banner")
    finally:
        writer.close()


def test_review_mode_header_shows_step_and_status(page, server_factory, demo_store):
    srv = server_factory(["--snapshot", str(demo_store / "modscope.sqlite")])
    page.get(srv.url)
    wait_text(page, "step 39 · finished", "#run-status")


# -- runs and ranks ---------------------------------------------------------------------------------------------
def choose(page, select_id: str, text: str) -> None:
    click(page, f"#{select_id}")
    click(page, "[role='option'], .dash-dropdown-option, .Select-option", text)


def test_run_selector_lists_the_runs_and_follows_the_newest(page, server_factory, tmp_path):
    """A directory of several runs: the newest is shown, the selector (only there when there are
    several runs) switches every page to the chosen one, and while "newest" is chosen a training
    restarted into the directory is shown on its own."""
    run_dir = tmp_path / "runs"
    synth_store.rank_run(run_dir, "aaa", 2, 5, run_name="first")
    srv = server_factory(["--run", str(run_dir)])
    page.get(srv.url)
    wait_text(page, "first", "#ov-cards")
    assert not page.find_element(By.ID, "run-select").is_displayed()       # one run: no selector
    writer = synth_store.rank_run(run_dir, "bbb", 2, 8, run_name="second", close=False)
    try:
        wait_text(page, "second", "#ov-cards")                                # followed without a reload
        wait_text(page, "step 7", "#run-status")
        wait_for(page, lambda d: d.find_element(By.ID, "run-select").is_displayed(), "the run selector")
        wait_text(page, "newest: bbb · second", "#run-select")
        choose(page, "run-select", "aaa · first")
        wait_text(page, "first", "#ov-cards")
        wait_text(page, "step 4", "#run-status")
        click(page, ".nav-link", "Modules")
        wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='encoder']"), "run aaa's tree")
        # the chosen run stays chosen while the newest goes on
        for w in writer:
            w.add_steps(2)
        click(page, ".nav-link", "Overview")
        wait_text(page, "first", "#ov-cards")
        assert "step 4" in page.find_element(By.ID, "run-status").text
        choose(page, "run-select", "newest")
        wait_text(page, "second", "#ov-cards")
        wait_text(page, "step 9", "#run-status")
        screenshot(page, "run-selector")
    finally:
        for w in writer:
            w.close()


def test_a_run_of_several_ranks(page, server_factory, tmp_path):
    """Four ranks of one run: one line per rank on the Overview (a rank whose process is gone shows as
    ended), findings listed once with their ranks, the divergence only a comparison of ranks shows, the
    local gradient norms of every rank side by side, and the rank selector."""
    import subprocess
    import sys
    run_dir = tmp_path / "ddp"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stores = synth_store.rank_run(run_dir, "job", 4, 40, close=False,
                                  diverge={1: {"encoder.blocks.1.weight": (25, 0.5)}},
                                  pids={0: os.getpid(), 1: os.getpid(), 2: os.getpid(), 3: gone.pid})
    try:
        for st in stores:
            st.add_finding("dead-units", "head", "warning", 9, "dead units in the head", count=3)
        srv = server_factory(["--run", str(run_dir)])
        page.get(srv.url)
        row = wait_text(page, "rank 3", "#ov-ranks tbody tr:nth-child(4)")
        assert len(page.find_elements(By.CSS_SELECTOR, "#ov-ranks tbody tr")) == 4
        assert "ended without close (process gone)" in row.text
        wait_text(page, "rank 3 ended without close", "#run-status")
        screenshot(page, "ranks-overview")
        click(page, ".nav-link", "Findings")
        wait_text(page, "rank-divergence", "#findings-list")
        cards = page.find_elements(By.CSS_SELECTOR, "#findings-list > .finding")
        assert len(cards) == 2
        divergence = next(c for c in cards if "rank-divergence" in c.text)
        assert "encoder.blocks.1.weight" in divergence.text and "rank 1" in divergence.text
        dead = next(c for c in cards if "dead-units" in c.text)
        assert "ranks 0–3" in dead.text and "seen 12 times" in dead.text
        screenshot(page, "findings-ranks")
        divergence.click()                                      # opens the weight's module
        wait_text(page, "encoder.blocks.1", "#detail-header h2")
        grads = wait_text(page, "rank 3", "#detail-ranks .ranks-grad-table thead")
        assert [th.text for th in grads.find_elements(By.CSS_SELECTOR, "th")] == \
            ["tensor", "rank 0", "rank 1", "rank 2", "rank 3"]
        assert [r.text.split()[0] for r in page.find_elements(By.CSS_SELECTOR, "#detail-ranks tbody tr")] == \
            ["weight", "bias"]
        choose(page, "rank-select", "rank 2")
        wait_text(page, "Select a module in the tree.", "#detail-header")     # another rank: another tree
        click(page, ".nav-link", "Overview")
        wait_text(page, "rank 2 of 4", "#ov-cards")
    finally:
        for st in stores:
            st.close()


def test_root_causes_fold_their_consequences(page, server_factory, tmp_path):
    """Three layers in a plain list: 15 findings shown as 3 root causes, each with "4 consequences"
    that open on demand (without leaving the page); a consequence opens its own module."""
    path = tmp_path / "three" / "modscope.sqlite"
    synth_store.three_layers(path)
    srv = server_factory(["--snapshot", str(path)])
    page.get(srv.url)
    wait_text(page, "3 errors", "#ov-cards")
    wait_text(page, "3 root causes (3 errors) and 12 consequences", "#ov-cards")
    click(page, ".nav-link", "Findings")
    wait_text(page, "unregistered-module", "#findings-list")
    cards = page.find_elements(By.CSS_SELECTOR, "#findings-list > .finding")
    assert len(cards) == 3 and all("seen 12 times, steps 3–40" in c.text for c in cards)
    assert not [el for el in page.find_elements(By.CSS_SELECTOR, ".consequences-list .finding") if el.is_displayed()]
    toggle = cards[1].find_element(By.CSS_SELECTOR, "summary.consequences-toggle")
    assert toggle.text == "4 consequences"
    toggle.click()
    shown = wait_for(page, lambda d: [el for el in d.find_elements(By.CSS_SELECTOR, ".consequences-list .finding")
                                      if el.is_displayed()], "the consequences opened")
    assert len(shown) == 4 and all("encoder.blocks[1]." in el.text for el in shown)
    assert {"not-updating", "grad-accumulating"} == {el.text.split()[1] for el in shown}
    assert page.current_url.endswith("/findings")
    screenshot(page, "findings-folded")
    shown[0].find_element(By.CSS_SELECTOR, ".finding-message").click()
    wait_text(page, "encoder.blocks[1]", "#detail-header h2")
    assert page.current_url.endswith("/modules")
