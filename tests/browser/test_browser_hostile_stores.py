"""Hostile stores in a real Chromium against one real server (a subprocess) that reviews a directory of them: each
store is one run of the directory, chosen with the run selector. Every page loads and shows the value as "unknown"
or the store's refusal in one line; never "Error loading layout", a 500 or a traceback; the server's peak memory
stays under 1 GB over all of them; a request with a bad module id logs nothing."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from browser_helpers import Server, click, console_errors, wait_for, wait_text
from hostile_stores import HOSTILE
from selenium.webdriver.common.by import By

from bench import synth_store

pytestmark = pytest.mark.browser

GB = 2**30
REFUSED_LONG = "longer than 1,000,000 bytes"


class PeakMemory:
    """A process's peak resident memory: the kernel's high-water mark (VmHWM) where there is one, and what psutil
    sees, sampled every 50 ms, besides."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.sampled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.sampled = max(self.sampled, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def peak(self) -> int:
        hwm = 0
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
        except OSError:
            pass
        return max(hwm, self.sampled)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """One server on a directory holding every hostile store (and, newest, a sound one it opens on)."""
    d = tmp_path_factory.mktemp("hostile")
    for name, make in HOSTILE.items():
        make(d / f"modscope-{name}-rank0.sqlite")
    synth_store.demo(d / "modscope-sound-rank0.sqlite", steps=6)
    later = time.time() + 60
    os.utime(d / "modscope-sound-rank0.sqlite", (later, later))          # the newest: the one shown first
    srv = Server(["--snapshot", str(d)])
    memory = PeakMemory(srv.proc.pid)
    yield srv, memory, d
    memory.stop()
    srv.stop()


@pytest.fixture
def view(browser, hostile):
    browser.get("about:blank")
    browser.get_log("browser")
    yield browser
    browser.get("about:blank")


def choose_run(driver, srv, name: str) -> None:
    driver.get(srv.url)
    wait_for(driver, lambda d: d.find_element(By.ID, "run-select").is_displayed(), "the run selector")
    click(driver, "#run-select")
    click(driver, "[role='option'], .dash-dropdown-option, .Select-option", f"{name} ·")
    wait_text(driver, name, "#run-select")


def page_text(driver) -> str:
    return driver.find_element(By.TAG_NAME, "body").text


def no_failure(driver, where: str) -> None:
    text = page_text(driver)
    assert "Error loading layout" not in text and "Traceback" not in text, f"{where}: {text[:500]}"
    severe = [e["message"] for e in console_errors(driver)]
    assert not severe, f"{where}: browser console errors: {severe}"


def visit_pages(driver, name: str) -> dict[str, str]:
    """Overview, Modules (a module selected where the tree shows one) and Findings; the text of each."""
    seen = {}
    time.sleep(0.5)
    seen["overview"] = page_text(driver)
    no_failure(driver, f"{name}: overview")
    click(driver, ".nav-link", "Modules")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row, .tree .message, #tree-info")
             or "cannot" in page_text(d) or REFUSED_LONG in page_text(d), "the tree or its refusal")
    rows = driver.find_elements(By.CSS_SELECTOR, ".tree-row .tree-label")
    if len(rows) > 1:
        rows[1].click()
        wait_for(driver, lambda d: d.find_element(By.ID, "detail-header").text
                 and "Select a module" not in d.find_element(By.ID, "detail-header").text, "the module's detail")
    time.sleep(0.5)
    seen["modules"] = page_text(driver)
    no_failure(driver, f"{name}: modules")
    click(driver, ".nav-link", "Findings")
    wait_for(driver, lambda d: d.find_element(By.ID, "findings-list").text, "the findings list")
    seen["findings"] = page_text(driver)
    no_failure(driver, f"{name}: findings")
    return seen


def test_generated_column_is_refused_in_one_line(view, hostile):
    srv, _, _ = hostile
    choose_run(view, srv, "generated-path")
    wait_text(view, "modules.path is a generated column", "#banner")
    no_failure(view, "generated-path")


@pytest.mark.parametrize("name", ["long-finding-paths", "huge-strings"])
def test_values_longer_than_a_store_holds_are_refused_in_one_line(view, hostile, name):
    srv, _, _ = hostile
    choose_run(view, srv, name)
    seen = visit_pages(view, name)
    assert any(REFUSED_LONG in text for text in seen.values()), seen


def test_a_20000_character_run_name_is_cut_where_it_is_shown(view, hostile):
    srv, _, _ = hostile
    choose_run(view, srv, "long-run-name")
    card = wait_text(view, "nnnn", "#ov-cards")
    shown = max(card.text.split(), key=len)
    assert shown.startswith("nnnn") and len(shown) <= 200, len(shown)
    label = view.find_element(By.ID, "run-select").text
    assert len(label) < 400, len(label)
    visit_pages(view, "long-run-name")


def test_a_trigger_on_meta_is_ignored_named_and_not_copied(view, hostile, download_dir):
    srv, _, _ = hostile
    choose_run(view, srv, "trigger-on-meta")
    wait_text(view, "ignored trigger 'spin' on 'meta'", "#banner")
    before = set(download_dir.glob("*.sqlite"))
    click(view, "#export-snapshot-btn")
    got = wait_for(view, lambda d: [p for p in download_dir.glob("*.sqlite") if p not in before], "the snapshot")[0]
    wait_for(view, lambda d: not list(download_dir.glob("*.crdownload")), "the download to finish")
    conn = sqlite3.connect(f"file:{got}?mode=ro", uri=True)
    kinds = {(t, n) for t, n in conn.execute("SELECT type, name FROM sqlite_master")}
    conn.close()
    assert not [k for k in kinds if k[0] in ("trigger", "view")] and ("table", "notes") not in kinds, kinds
    visit_pages(view, "trigger-on-meta")


def test_wrong_types_and_out_of_range_numbers_read_as_unknown(view, hostile):
    srv, _, _ = hostile
    choose_run(view, srv, "wrong-values")
    wait_text(view, "sampling unknown", "#ov-cards")
    click(view, ".nav-link", "Modules")
    wait_for(view, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-kind='unknown']"),
             "the module whose kind is a blob, drawn as unknown")
    click(view, ".tree-row[data-kind='unknown'] .tree-label")
    wait_text(view, "unknown parameters", "#detail-header")
    no_failure(view, "wrong-values: module detail")
    visit_pages(view, "wrong-values")


def post_callback(url: str, dep: dict, values: dict) -> int:
    """Post the callback ``dep`` (from _dash-dependencies) with ``values`` for its inputs and states (by id)."""
    outputs = [dict(zip(("id", "property"), o.split(".", 1), strict=True))
               for o in dep["output"].strip(".").split("...")]
    body = {"output": dep["output"], "outputs": outputs, "changedPropIds": [f"{k}.data" for k in values],
            "inputs": [{**i, "value": values.get(i["id"])} for i in dep["inputs"]],
            "state": [{**s, "value": values.get(s["id"])} for s in dep["state"]]}
    req = urllib.request.Request(url + "_dash-update-component", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_bad_module_ids_log_nothing(hostile):
    """The detail's and the heat map's callbacks posted with module ids no page sends (text, out of range, a list):
    answered (the selection ignored), nothing logged."""
    srv, _, _ = hostile
    with urllib.request.urlopen(srv.url + "_dash-dependencies", timeout=10) as r:
        deps = json.load(r)
    detail = next(d for d in deps if d["output"].startswith("..detail-header.children"))
    heat = next(d for d in deps if d["output"].startswith("..detail-heat.figure"))
    tick = {"ready": True, "run": "sound", "rank": 0, "runs": ["sound"], "ranks": [0]}
    assert post_callback(srv.url, detail, {"tick": tick, "selected-module": {"run": "sound", "rank": 0,
                                                                            "module_id": 1}}) == 200
    for bad in ("x", 10**30, -1, None, [1], 1.5, "1e400"):
        selected = {"run": "sound", "rank": 0, "module_id": bad}
        assert post_callback(srv.url, detail, {"tick": tick, "selected-module": selected}) in (200, 204), bad
        for view in (["sound", 0], ["sound", bad], bad):
            state = {"module_id": bad, "view": view}
            assert post_callback(srv.url, heat, {"detail-state": state}) in (200, 204), (bad, view)
    out = srv.output()
    assert "Traceback" not in out and "Exception on" not in out, out[-3000:]


def test_server_memory_stays_under_1_gb_and_logs_no_traceback(hostile):
    """Last in this module: every store above was shown by this one server."""
    srv, memory, _ = hostile
    print(f"server peak RSS {memory.peak() / 2**20:.0f} MiB")
    assert memory.peak() < GB, f"peak RSS {memory.peak() / 2**20:.0f} MiB"
    out = srv.output()
    assert "Traceback" not in out and "Exception on" not in out and " 500 " not in out, out[-3000:]
