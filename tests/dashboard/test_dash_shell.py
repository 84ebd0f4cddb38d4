"""The shell without a browser: the configuration, the one list of pages, the poll's Tick and the
texts made from it (header, banner), the guard every store-reading callback goes through, the one
badge rule, clicks, and the plotly.js bundle the pages load."""

from __future__ import annotations

import os
import socket
import sqlite3
import time

import pytest
from dash import no_update
from dash.exceptions import PreventUpdate

from bench import synth_store
from dashboard.read.store import Store, StoreError, StoreNotReadyError
from dashboard.web import server
from dashboard.web.components import badge_specs, finding_badges
from dashboard.web.config import AppConfig, Mode
from dashboard.web.pages import modules as modules_page
from dashboard.web.pages import page_at, pages_for
from dashboard.web.poll import (
    FINISHED_POLL_MS,
    Tick,
    banner,
    duration_text,
    header_text,
    mode_badge,
    poll_timing,
    read_tick,
    reads_store,
)
from dashboard.web.report import build_report
from probes import schema


@pytest.fixture
def demo(tmp_path) -> Store:
    synth_store.demo(tmp_path / "run" / "modscope.sqlite", steps=20)
    return Store.open_snapshot(tmp_path / "run" / "modscope.sqlite")


def texts(components) -> list[str]:
    return [c.children for c in components]


# -- configuration and pages ----------------------------------------------------------------------------
def test_app_config_names_the_bad_value(demo):
    with pytest.raises(ValueError, match=r"^mode 'watch' is not one of live, review, compare$"):
        AppConfig(mode="watch", store=demo)
    with pytest.raises(TypeError, match=r"^store must be a dashboard\.read\.store\.Store or a "
                                         r"dashboard\.read\.run\.RunDir, got None$"):
        AppConfig(mode="review", store=None)
    with pytest.raises(TypeError, match=r"^mode 'compare' needs a second store"):
        AppConfig(mode="compare", store=demo)
    with pytest.raises(ValueError, match=r"^poll_ms must be a positive int .*got 0$"):
        AppConfig(mode="live", store=demo, poll_ms=0)
    config = AppConfig(mode="review", store=demo)
    assert config.mode is Mode.REVIEW and not config.live


def test_the_page_list_drives_navigation_and_routing(demo):
    live = pages_for(Mode.LIVE)
    assert [(p.href, p.label) for p in live] == [("/", "Overview"), ("/modules", "Modules"), ("/layers", "Layers"),
                                                 ("/findings", "Findings")]
    assert [p.counts_findings for p in live] == [False, False, False, True]
    assert page_at(live, "/modules").label == "Modules" and page_at(live, "/modules/x").label == "Modules"
    assert page_at(live, "/findings").label == "Findings"
    assert page_at(live, "/nothing").label == page_at(live, None).label == "Overview"
    assert [p.label for p in pages_for(Mode.COMPARE)] == ["Compare"]
    app = server.create_app(AppConfig(mode="review", store=demo))
    nav = server.nav(pages_for(Mode.REVIEW))
    assert [link.href for link in nav.children] == ["/", "/modules", "/layers", "/findings"]
    assert app.layout() is not None


# -- the tick, the header and the banner ---------------------------------------------------------------
def live_config(run) -> AppConfig:
    return AppConfig(mode="live", store=Store.open_run(run))


def test_tick_of_a_run_not_written_yet_waits(tmp_path):
    config = live_config(tmp_path / "later")
    tick = read_tick(config)
    assert not tick.ready and tick.error is None
    assert header_text(tick) == "waiting for the first sample"
    assert texts(banner(tick, config.store)) == [f"Waiting for the first sample in {tmp_path / 'later'} …"]
    st = synth_store.demo(tmp_path / "later" / schema.store_filename("r1", 0), steps=3, live=True)
    tick = read_tick(config)
    assert tick.ready and tick.last_step == 2 and tick.status == "running"
    assert header_text(tick) == "step 2 · running" and banner(tick, config.store) == []
    st.close()
    assert header_text(read_tick(config)) == "step 2 · finished"


def test_a_finished_run_says_so_and_stops_polling(tmp_path):
    """While the run trains: "live", polled, and when the next full sample is due; once closed: "finished"
    (no live badge), no poll of a run the user chose, a look for a new run every 10 s while following the newest."""
    st = synth_store.demo(tmp_path / "run" / schema.store_filename("r1", 0), steps=3, live=True)
    st.set_rank(next_sample=512, sampling='{"every": null, "overhead": 0.01, "window": 16}')
    config = AppConfig(mode="live", store=Store.open_run(tmp_path / "run"), poll_ms=700)
    tick = read_tick(config)
    assert not tick.finished and tick.next_sample == "next full sample at step 512, 1 % budget"
    assert header_text(tick) == "step 2 · running · next full sample at step 512, 1 % budget"
    assert mode_badge(True, tick) == ("live", "mode mode-live")
    assert poll_timing(True, tick, True, 700) == (False, 700)
    st.set_rank(sampling='{"every": 10, "overhead": null, "window": 16}')
    assert read_tick(config).next_sample == "next full sample at step 512, every 10 steps"
    st.close()
    tick = read_tick(config)
    assert tick.finished and tick.next_sample == "" and header_text(tick) == "step 2 · finished"
    assert mode_badge(True, tick) == ("finished", "mode mode-finished")
    assert poll_timing(True, tick, False, 700) == (True, 700)                   # a run the user chose
    assert poll_timing(True, tick, True, 700) == (False, FINISHED_POLL_MS)      # following the newest
    layout = server.shell_layout(config, pages_for(Mode.LIVE))
    interval = next(c for c in layout.children if getattr(c, "id", None) == "poll-interval")
    assert interval.interval == FINISHED_POLL_MS
    header = next(c for c in layout.children if getattr(c, "id", None) == "header")
    subtitle = next(c for c in header.children if getattr(c, "className", None) == "subtitle")
    badge = next(c for c in subtitle.children if getattr(c, "id", None) == "mode-badge")
    assert (badge.children, badge.className) == ("finished", "mode mode-finished")


def test_tick_of_a_bad_store_carries_its_error(tmp_path):
    config = live_config(tmp_path / "run")
    p = tmp_path / "run" / schema.store_filename("r1", 0)
    synth_store.demo(p, steps=1)
    conn = sqlite3.connect(str(p))
    conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    tick = read_tick(config)
    assert not tick.ready and tick.error.startswith(f"{p}: written by schema version")
    assert header_text(tick) == "cannot read the store"
    [div] = banner(tick, config.store)
    assert div.children == tick.error and div.className == "banner-error"


def test_header_says_stalled_or_ended(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=3, live=True)
    config = live_config(tmp_path)
    st.set_rank(hostname=socket.gethostname(), pid=os.getpid(), updated_at=time.time() - 605)
    assert header_text(read_tick(config)) == "step 2 · stalled: no update for 10 min"
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    st.set_rank(pid=proc.pid)
    assert header_text(read_tick(config)) == "step 2 · ended without close (process gone)"
    st.close()


def test_review_mode_header_shows_step_and_recorded_status(demo):
    tick = read_tick(AppConfig(mode="review", store=demo))
    assert header_text(tick) == "step 19 · finished"


def test_banner_while_store_writes_fail_and_after(tmp_path):
    p = tmp_path / schema.store_filename("r1", 0)
    st = synth_store.demo(p, steps=3, live=True)
    config = live_config(tmp_path)
    since = time.mktime((2026, 11, 30, 14, 2, 11, 0, 0, -1))
    schema.status_path(p).write_bytes(schema.encode_status(schema.WriterStatus(
        state=schema.WriterState.FAILING, updated_at=time.time(), failing_since=since,
        error="database or disk is full", failed_commits=3, dropped_samples=120)))
    tick = read_tick(config)
    [div] = banner(tick, config.store)
    assert div.className == "banner-error" and div.children == (
        "Store writes are failing since 14:02:11: database or disk is full — 3 commits failed, 120 samples "
        "dropped; training continues and modscope retries")
    schema.status_path(p).write_bytes(schema.encode_status(schema.WriterStatus(
        state=schema.WriterState.OK, updated_at=time.time(), error="database or disk is full", failed_commits=3,
        dropped_samples=120)))
    st.set_rank(write_errors=3, last_error="database or disk is full")
    tick2 = read_tick(config)
    assert not tick2.same_content(tick)                         # the poll passes the change on
    [div] = banner(tick2, config.store)
    assert div.className == "banner-warn" and div.children == (
        "The store missed writes: 3 commits failed, 120 samples dropped (last error: database or disk is full) "
        "(recovered)")
    st.close()


def test_tick_round_trips_through_plain_data():
    tick = Tick(ready=True, last_step=4, structure=(7, 6, 6, 1, 2, 3), status="running", n=3)
    data = tick.to_data()
    assert data["structure"] == [7, 6, 6, 1, 2, 3] and data["n"] == 3
    again = Tick.from_data(data)
    assert again == tick and again.same_content(Tick.from_data({**data, "n": 9}))
    assert Tick.from_data(None) == Tick() and Tick.from_data({"ready": True, "bogus": 1}).ready
    assert not tick.same_content(Tick(ready=True, last_step=5, structure=tick.structure, status="running"))


def test_duration_text():
    assert [duration_text(s) for s in (40, 120, 605, 3600, 3660, 86400 + 7200, 86400)] == \
        ["40 s", "2 min", "10 min", "1 h", "1 h 1 min", "1 d 2 h", "1 d"]


# -- the guard of every store-reading callback ----------------------------------------------------------
def test_reads_store_answers_for_the_callback(tmp_path, demo):
    waiting_store = Store.open_run(tmp_path / "later")
    ready = Tick(ready=True).to_data()

    @reads_store(waiting_store, waiting=lambda text: ("waiting", text), failed=lambda text: ("failed", text))
    def shows(tick, value):
        assert isinstance(tick, Tick)
        if value == "not ready":
            raise StoreNotReadyError("x: waiting")
        if value == "broken":
            raise StoreError("x: corrupt SQLite file (a\nb)")
        return "shown", value

    assert shows(Tick().to_data(), 1) == ("waiting", f"Waiting for the first sample in {tmp_path / 'later'} …")
    assert shows(Tick(error="x: bad").to_data(), 1) == ("failed", "x: bad")
    assert shows(ready, 1) == ("shown", 1)
    assert shows(ready, "broken") == ("failed", "x: corrupt SQLite file (a b)")
    with pytest.raises(PreventUpdate):
        shows(ready, "not ready")

    @reads_store(demo, tick_first=False)
    def quiet(value):
        raise StoreError("x: gone")
    with pytest.raises(PreventUpdate):
        quiet(1)

    @reads_store(demo)
    def needs_tick(tick):
        return "ran"
    with pytest.raises(PreventUpdate):
        needs_tick(None)
    assert needs_tick(ready) == "ran"


# -- one badge rule: tree, module detail, report ----------------------------------------------------------
def test_one_badge_rule_everywhere(demo):
    findings = [{"code": "unregistered-module", "severity": "error"}, {"code": "not-updating", "severity": "error"},
                {"code": "not-updating", "severity": "error"}, {"code": "from-a-newer-writer", "severity": "fatal"}]
    assert [(b.label, b.severity.value) for b in badge_specs(findings, "registered")] == \
        [("unregistered", "error"), ("not updating", "error"), ("from-a-newer-writer", "info")]
    assert [b.label for b in badge_specs(findings, "unregistered")] == ["not updating", "from-a-newer-writer"]

    blk = demo.module_by_path(0, "encoder.blocks[0]")
    own = demo.findings_for_modules(0, [blk["module_id"]])[blk["module_id"]]
    row = modules_page.tree_row(blk, expanded=False, selected=False, findings=own, inside=None)
    assert [b["label"] for b in row["badges"]] == ["not updating"]
    header = modules_page.detail_header(blk, own)
    title = header[0].children
    assert [c.children for c in title if getattr(c, "className", "").startswith("badge sev-")] == ["not updating"]
    assert [b.children for b in finding_badges(own, blk["kind"])] == ["not updating"]
    report = build_report(demo)
    assert report.count('title="not-updating">not updating</span>') == 3
    assert 'title="unregistered-module">unregistered</span>' not in report


# -- clicks ----------------------------------------------------------------------------------------------
def test_clicks_toggle_expand_and_open(demo):
    root, enc = demo.root(), demo.module_by_path(0, "encoder")
    blk = demo.module_by_path(0, "encoder.blocks[1]")
    view = ["r1", 0]

    def tagged(ids_):
        return {"view": view, "ids": ids_}
    exp, path = modules_page.handle_click(demo, {"action": "toggle", "id": str(enc["module_id"])}, tagged([0]), 0,
                                          view)
    assert exp == tagged([0, enc["module_id"]]) and path is no_update
    exp, _ = modules_page.handle_click(demo, {"action": "toggle", "id": enc["module_id"]}, exp, 0, view)
    assert exp == tagged([0])
    exp, path = modules_page.handle_click(demo, {"action": "open", "id": blk["module_id"]},
                                          tagged([root["module_id"]]), 0, view)
    assert exp == tagged([root["module_id"], enc["module_id"]]) and path == "/modules"
    exp, path = modules_page.handle_click(demo, {"action": "select", "id": blk["module_id"]}, exp, 0, view)
    assert exp is no_update and path is no_update              # its ancestors are open already
    # nodes expanded in another run or rank (other module ids) are not reused: this view's default instead
    exp, _ = modules_page.handle_click(demo, {"action": "toggle", "id": enc["module_id"]},
                                       {"view": ["another-run", 0], "ids": [0, 1, 2, 3]}, 0, view)
    assert exp == tagged([m for m in demo.default_expanded(0) if m != enc["module_id"]])
    for bad in (None, {"action": "explode", "id": 1}, {"action": "open", "id": "x"}, {"action": "open", "id": -1}):
        with pytest.raises(PreventUpdate):
            modules_page.handle_click(demo, bad, tagged([0]), 0, view)


# -- plotly.js: the cartesian bundle replaces Dash's only when it is the same version ------------------------
def test_bundled_plotly_is_the_version_dash_ships(demo):
    asset = server.cartesian_plotly_asset()
    assert asset is not None, "assets/plotly-cartesian-<version>.min.js is missing"
    assert server.bundled_plotly_version(asset) == server.dash_plotly_version(), (
        f"{asset.name} is not the plotly.js Dash serves ({server.dash_plotly_version()}): replace it with that "
        "version's dist/plotly-cartesian.min.js")
    assert asset.name == f"plotly-cartesian-{server.dash_plotly_version()}.min.js"
    client = server.create_app(AppConfig(mode="review", store=demo)).server.test_client()
    page = client.get("/").get_data(as_text=True)
    assert f"/assets/{asset.name}" in page                       # the page loads the cartesian bundle ...
    assert client.get(f"/assets/{asset.name}").status_code == 200
    # ... and Dash no longer serves (so never loads) its full bundle
    assert client.get("/_dash-component-suites/plotly/package_data/plotly.min.js").status_code == 404
