"""Browser tests on the real demo: ``python app.py`` with no store starts
examples/demo_train.py (the plain-list encoder bug), the dashboard follows it live,
exports a snapshot that reopens with --snapshot and a report that opens offline, and
compares the demo before and after the fix."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from browser_helpers import REPO, assert_console_clean, click, demo_available, screenshot, wait_for, wait_text
from selenium.webdriver.common.by import By

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not demo_available(), reason="needs torch, probes and examples/demo_train.py")]

BLOCKS = [f"encoder.blocks[{i}]" for i in range(3)]


def unregistered_paths(driver) -> list[str]:
    return sorted(el.get_attribute("data-path") for el in
                  driver.find_elements(By.CSS_SELECTOR, ".tree-row[data-kind='unregistered']"))


def header_step(driver) -> int | None:
    text = driver.find_element(By.ID, "run-status").text  # "step 12 · running"
    parts = text.split()
    return int(parts[1]) if len(parts) > 1 and parts[0] == "step" and parts[1].isdigit() else None


def trace_len(driver, graph_id: str) -> int:
    return driver.execute_script(
        "const g = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');"
        "return g && g.data && g.data.length ? g.data[0].x.length : 0;", graph_id)


def run_demo(run_dir: Path, *extra: str) -> Path:
    subprocess.run([sys.executable, str(REPO / "examples" / "demo_train.py"), "--run-dir", str(run_dir),
                    "--steps", "40", "--every", "1", *extra], check=True, cwd=str(REPO),
                   stdout=subprocess.DEVNULL, timeout=300)
    return run_dir


def test_default_command_runs_demo_live(page, server_factory, tmp_path, download_dir):
    """`python app.py`: demo renders, the three plain-list blocks show as unregistered,
    clicking a module shows its charts, new samples appear live without losing the
    selection, the expanded nodes or the zoom; export downloads a snapshot and a report."""
    srv = server_factory(["--runs-dir", str(tmp_path / "runs")])
    assert "demo training started" in srv.output()
    page.get(srv.url)
    wait_text(page, "3 unregistered", "#ov-cards")
    wait_text(page, "unregistered-module", "#ov-top-findings")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#ov-loss .scatterlayer .trace"), "loss curve")

    # live: the header's step moves on
    first = wait_for(page, header_step, "a step in the header")
    wait_for(page, lambda d: (header_step(d) or 0) > first, "the step to advance live")
    wait_for(page, lambda d: (header_step(d) or 0) >= 25, "25 steps for the screenshot")
    wait_for(page, lambda d: trace_len(d, "ov-loss") >= 20, "the loss curve extended live")
    screenshot(page, "overview-demo")

    click(page, ".nav-link", "Modules")
    wait_for(page, lambda d: unregistered_paths(d) == BLOCKS, "the three plain-list blocks, unregistered")
    click(page, ".tree-row[data-path='encoder.blocks[1]'] .tree-label")
    wait_text(page, "encoder.blocks[1]", "#detail-header h2")
    wait_for(page, lambda d: trace_len(d, "detail-activation") > 0, "activation chart of blocks[1]")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#detail-heat .heatmaplayer *"), "heat map")
    wait_text(page, "not in state_dict", "#detail-params")
    charts_bottom, params_top, chart_h = page.execute_script(
        "return [document.getElementById('detail').getBoundingClientRect().bottom,"
        " document.getElementById('detail-params').getBoundingClientRect().top,"
        " document.getElementById('detail-activation').getBoundingClientRect().height];")
    assert charts_bottom <= params_top + 1 and 600 <= chart_h <= 800   # laid out, no overlap (3 panels)
    screenshot(page, "modules-demo")

    # zoom into the activation chart, then let new samples arrive
    page.execute_script("const g = document.querySelector('#detail-activation .js-plotly-plot');"
                        "Plotly.relayout(g, {'xaxis.range': [0, 5]});")
    n0 = trace_len(page, "detail-activation")
    wait_for(page, lambda d: trace_len(d, "detail-activation") > n0 + 2, "new samples in the open chart")
    assert page.find_elements(By.CSS_SELECTOR, ".tree-row.selected[data-path='encoder.blocks[1]']")
    assert unregistered_paths(page) == BLOCKS            # encoder is still expanded
    rng = page.execute_script("return document.querySelector('#detail-activation .js-plotly-plot')"
                              ".layout.xaxis.range;")
    assert [round(x) for x in rng] == [0, 5]
    screenshot(page, "live-modules")

    # export: snapshot and report downloads
    for f in download_dir.glob("*"):
        f.unlink()
    click(page, "#export-snapshot-btn")
    snap = wait_for(page, lambda d: list(download_dir.glob("*.sqlite")), "snapshot download")[0]
    click(page, "#export-report-btn")
    report = wait_for(page, lambda d: list(download_dir.glob("*.html")), "report download")[0]
    assert_console_clean(page)

    # the downloaded snapshot reopens in review mode (a second server)
    review = server_factory(["--snapshot", str(snap)])
    page.get(review.url + "modules")
    wait_for(page, lambda d: unregistered_paths(d) == BLOCKS, "blocks in the reopened snapshot")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".subtitle .mode-review"), "review mode")
    assert_console_clean(page)

    # the report opens offline
    page.execute_cdp_cmd("Network.enable", {})
    page.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": True, "latency": 0,
                                                              "downloadThroughput": 0, "uploadThroughput": 0})
    try:
        page.get(report.resolve().as_uri())
        wait_text(page, "encoder.blocks[0]", "#findings")
        wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#loss .js-plotly-plot .scatterlayer .trace"),
                 "the loss chart drawn offline")
        screenshot(page, "report")
    finally:
        page.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                                  "downloadThroughput": -1, "uploadThroughput": -1})
    text = report.read_text()
    assert "<script src" not in text and "<link" not in text  # nothing loaded from elsewhere

    # stopping the dashboard stops the demo training
    pid = int(re.search(r"demo training started \(pid (\d+)\)", srv.output()).group(1))
    srv.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_compare_demo_before_and_after_fix(page, server_factory, tmp_path):
    before = run_demo(tmp_path / "before")
    after = run_demo(tmp_path / "after", "--fixed")
    srv = server_factory(["--compare", str(before), str(after)])
    page.get(srv.url)
    wait_text(page, "checkpoint keys", "#cmp-summary")
    resolved = wait_text(page, "encoder.blocks[0]", "#cmp-resolved")
    assert "unregistered-module" in resolved.text
    added = wait_text(page, "encoder.blocks.0.weight", "#cmp-keys-added")
    assert "encoder.blocks.2.bias" in added.text
    rows = wait_text(page, "was encoder.blocks[0]", "#cmp-modules")
    assert "unregistered" in rows.text
    summary = page.find_element(By.ID, "cmp-summary").text
    assert "82" in summary and "898" in summary
    screenshot(page, "compare")


def nav_count(driver) -> tuple[str, str]:
    el = driver.find_element(By.ID, "nav-findings-count")
    return el.text, el.get_attribute("class")


def test_findings_count_in_every_mode(page, server_factory, tmp_path):
    """The "Findings" tab carries the number of active root causes (1 error: the plain list of 3 blocks) on
    every page, also where nothing polls a change: a finished run (live mode) and a snapshot (review)."""
    run = run_demo(tmp_path / "closed")
    store = next(run.glob("modscope-*-rank0.sqlite"))
    for args in (["--run", str(run)], ["--snapshot", str(store)]):
        srv = server_factory(args)
        for path in ("", "findings", "modules"):
            page.get(srv.url + path)
            wait_text(page, "finished", "#run-status")
            wait_for(page, lambda d: nav_count(d)[0] == "1", f"the count 1 next to Findings ({args[0]} /{path})")
            assert "sev-error" in nav_count(page)[1].split()
        page.get("about:blank")                        # no poll to a server that stops
        srv.stop()


# The findings page's state, read in one go (a redraw between two WebDriver calls cannot split it): per
# root-cause card its "seen N times, steps a-b", whether its consequences and its evidence are open.
FINDINGS_STATE = """
const cards = Array.from(document.querySelectorAll('#findings-list > .finding'));
return {seen: cards.map(c => (c.querySelector(':scope > .finding-head .steps') || {}).textContent || ''),
        consequences: cards.map(c => !!c.querySelector(':scope > details.consequences[open]')),
        evidence: cards.map(c => !!c.querySelector(':scope > details.evidence-box[open]')),
        shown: document.querySelectorAll('#findings-list details.consequences[open] > .consequences-list > .finding')
                    .length,
        scroll: window.scrollY, url: location.pathname};
"""


def test_live_findings_keep_what_was_opened(page, server_factory, tmp_path):
    """While the demo trains, every poll redraws the findings (each one's count and last step move on):
    the consequences and the evidence the user opened stay open, the page keeps its scroll position, and
    the numbers still update."""
    srv = server_factory(["--runs-dir", str(tmp_path / "runs")])
    page.get(srv.url + "findings")
    wait_for(page, lambda d: [el.text for el in d.find_elements(By.CSS_SELECTOR, "#findings-list > .finding > "
                                                                "details.consequences > summary")]
             == ["12 consequences"], "the plain list's one root cause with its 12 consequences")
    wait_for(page, lambda d: nav_count(d)[0] == "1", "the count 1 next to Findings (live)")
    click(page, "#findings-list > .finding:nth-child(2) > details.consequences > summary")
    click(page, "#findings-list > .finding:nth-child(2) > details.evidence-box > summary")
    state = wait_for(page, lambda d: (s := d.execute_script(FINDINGS_STATE))["consequences"][0]
                     and s["evidence"][0] and s, "the consequences and the evidence of the root cause")
    page.execute_script("window.scrollTo(0, 300);")
    wait_for(page, lambda d: d.execute_script("return window.scrollY;") == 300, "the page scrolled")
    seen = [state["seen"][0]]
    deadline = time.monotonic() + 60
    while len(seen) < 5:                                  # four polls that changed the first card's count
        state = page.execute_script(FINDINGS_STATE)
        assert state["consequences"][0] and state["evidence"][0], f"closed again after {seen}: {state}"
        assert state["shown"] == 12 and state["scroll"] == 300 and state["url"] == "/findings", state
        assert not any(state["consequences"][1:]) and not any(state["evidence"][1:]), state
        if state["seen"][0] != seen[-1]:
            seen.append(state["seen"][0])
        assert time.monotonic() < deadline, f"the first finding's count did not change four times: {seen}"
        time.sleep(0.05)
    screenshot(page, "findings-live-open")



# The open module's detail, read in one go: per root-cause card of its findings its "seen N times",
# whether its evidence and its consequences are open, which evidence inside the consequences is, and
# the heat map's x range and its last column's step.
DETAIL_STATE = """
const cards = Array.from(document.querySelectorAll('#detail-findings > .detail-findings > .finding'));
const folded = Array.from(document.querySelectorAll('#detail-findings .consequences-list > .finding'));
const heat = document.querySelector('#detail-heat .js-plotly-plot');
return {module: (document.querySelector('#detail-header h2') || {}).textContent || '',
        seen: cards.map(c => (c.querySelector(':scope > .finding-head .steps') || {}).textContent || ''),
        evidence: cards.map(c => !!c.querySelector(':scope > details.evidence-box[open]')),
        consequences: cards.map(c => !!c.querySelector(':scope > details.consequences[open]')),
        folded: folded.map(c => !!c.querySelector(':scope > details.evidence-box[open]')),
        heat_range: heat && heat.layout.xaxis && heat.layout.xaxis.range,
        heat_last: heat && heat.data.length ? heat.data[0].x[heat.data[0].x.length - 1] : null,
        scroll: window.scrollY, url: location.pathname};
"""


def drag_zoom(driver, graph: str) -> list[float]:
    """Zoom into the x axis of ``graph`` as a user does: a mouse drag across its plot area (real
    input events), not a Plotly call (plotly tells the two apart); the new x range."""
    area = driver.find_element(By.CSS_SELECTOR, f"#{graph} .nsewdrag")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", area)
    left, top, width, height = driver.execute_script(
        "const b = arguments[0].getBoundingClientRect(); return [b.left, b.top, b.width, b.height];", area)
    x, y = left + width * 0.3, top + height * 0.5

    def mouse(kind: str, dx: float, **kw) -> None:
        driver.execute_cdp_cmd("Input.dispatchMouseEvent", {"type": kind, "x": x + dx, "y": y, "button": "left", **kw})
    mouse("mouseMoved", 0)
    mouse("mousePressed", 0, clickCount=1)
    for k in range(1, 8):
        mouse("mouseMoved", k * width * 0.04, buttons=1)
    mouse("mouseReleased", 7 * width * 0.04, clickCount=1)
    return wait_for(driver, lambda d: d.execute_script(
        "const g = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');"
        "return g.layout.xaxis.autorange === false && g.layout.xaxis.range;", graph), f"{graph} zoomed")


def test_live_module_detail_keeps_what_the_user_did(page, server_factory, tmp_path):
    """While the demo trains, every poll draws the open module's detail again (its findings' counts move
    on, the heat map gets new columns): the evidence and the consequences the user opened there (and an
    evidence inside the folded consequences) stay open, the heat map keeps the user's zoom, the page
    keeps its scroll position and the numbers still update."""
    srv = server_factory(["--runs-dir", str(tmp_path / "runs")])
    page.get(srv.url + "modules")
    click(page, ".tree-row[data-path='encoder.blocks[1]'] .tree-label")
    wait_text(page, "encoder.blocks[1]", "#detail-header h2")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#detail-heat .heatmaplayer *"), "heat map")
    zoomed = drag_zoom(page, "detail-heat")
    opened = [False, True] + [False] * 10       # the evidence of the second of the 12 consequences
    root = "#detail-findings > .detail-findings > .finding:nth-child(2)"        # after the heading
    wait_text(page, "12 consequences", f"{root} > details.consequences > summary")
    click(page, f"{root} > details.evidence-box > summary")
    click(page, f"{root} > details.consequences > summary")
    click(page, f"{root} .consequences-list > .finding:nth-child(2) > details.evidence-box > summary")
    state = wait_for(page, lambda d: (s := d.execute_script(DETAIL_STATE))["evidence"] == [True]
                     and s["consequences"] == [True] and s["folded"] == opened and s,
                     "the evidence and consequences of the plain list's finding, one consequence's evidence")
    bottom = page.execute_script("window.scrollTo(0, document.documentElement.scrollHeight);"
                                 "return window.scrollY;")
    assert bottom > 0
    seen, columns = [state["seen"][0]], [state["heat_last"]]
    deadline = time.monotonic() + 60
    while len(seen) < 5 or len(columns) < 4:          # polls that drew the findings and the heat map again
        state = page.execute_script(DETAIL_STATE)
        assert state["evidence"] == [True] and state["consequences"] == [True], f"closed after {seen}: {state}"
        assert state["folded"] == opened, f"closed after {seen}: {state}"
        assert state["heat_range"] == zoomed, f"the heat map's zoom {zoomed} lost after {columns}: {state}"
        assert state["module"] == "encoder.blocks[1]" and state["url"] == "/modules", state
        assert state["scroll"] == bottom, f"scrolled from {bottom} after {seen}: {state}"
        if state["seen"][0] != seen[-1]:
            seen.append(state["seen"][0])
        if state["heat_last"] != columns[-1]:
            columns.append(state["heat_last"])
        assert time.monotonic() < deadline, f"the detail was not drawn again four times: {seen} {columns}"
        time.sleep(0.05)
    screenshot(page, "modules-live-open")

KITCHEN = r'''
import sys, torch, torch.nn as nn, torch.nn.functional as F
import probes

hidden = nn.Linear(8, 8)                       # only a closure holds it: a "runtime" module


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)                    # NaN for negative inputs


class Kitchen(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = [nn.Linear(8, 8), nn.Tanh()]          # plain list
        self.gate = torch.ones(8, requires_grad=True)       # unregistered tensor
        self.frozen = nn.Linear(8, 8)
        self.frozen.weight.requires_grad_(False)
        self.log = Log()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for b in self.blocks:
            h = b(h)
        h = hidden(self.frozen(h)) * self.gate
        return self.head(h + 0 * self.log(h).nan_to_num())


torch.manual_seed(0)
m = Kitchen()
opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01)
x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
with probes.watch(m, opt, run_dir=sys.argv[1], every=1) as w:
    for _ in range(20):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step(); w.step(loss)
'''


def test_real_store_with_many_bug_classes(page, server_factory, tmp_path):
    """A real probes store with unregistered, runtime, frozen and NaN-producing modules renders on
    every page with a clean console."""
    script = tmp_path / "kitchen.py"
    script.write_text(KITCHEN)
    subprocess.run([sys.executable, str(script), str(tmp_path / "run")], check=True, cwd=str(REPO),
                   env={**__import__("os").environ, "PYTHONPATH": str(REPO)}, timeout=300,
                   stdout=subprocess.DEVNULL)
    srv = server_factory(["--run", str(tmp_path / "run")])
    page.get(srv.url)
    wait_text(page, "Kitchen", "#ov-cards")
    click(page, ".nav-link", "Modules")
    runtime = wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-kind='runtime'] .tree-label"),
                       "the closure's Linear drawn as a runtime module")
    runtime[0].click()
    wait_text(page, "<unreachable Linear>", "#detail-header h2")
    assert {"blocks[0]", "blocks[1]"} <= {el.text for el in page.find_elements(
        By.CSS_SELECTOR, ".tree-row[data-kind='unregistered'] .tree-label")}
    click(page, ".nav-link", "Findings")
    wait_text(page, "unregistered-tensor", "#findings-list")
    screenshot(page, "findings-kitchen")
