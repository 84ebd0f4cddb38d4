"""Browser tests: findings and tree nodes usable from the keyboard, and layouts that neither overlap
nor hide text at laptop widths (a real headless Chromium against a real server)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
from browser_helpers import aria_problems, screenshot, wait_for, wait_text
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from bench import synth_store

pytestmark = pytest.mark.browser

# two findings whose paths differ only at the end (they used to read the same: "optimizer.param_…")
LONG_PATHS = ("optimizer.param_groups[0]['params'][4]", "optimizer.param_groups[0]['params'][5]")


@pytest.fixture
def demo_store(tmp_path) -> Path:
    p = tmp_path / "run" / "modscope.sqlite"
    synth_store.demo(p, steps=40)
    return p


@pytest.fixture
def busy_store(tmp_path) -> Path:
    """The fixed demo copied while it trained (status still "running"), with several findings on ``head``
    (four badges on its tree row) and two on long optimizer paths."""
    p = tmp_path / "busy" / "modscope.sqlite"
    st = synth_store.demo(p, fixed=True, steps=40, live=True)
    head = next(m["module_id"] for m in st.modules if m["path"] == "head")
    for code, path, sev in (("not-in-optimizer", "head.bias", "error"), ("not-updating", "head.weight", "error"),
                            ("dead-units", "head", "warning"), ("saturated", "head", "warning")):
        st.add_finding(code, path, sev, head, f"{path}: {code}")
    for path in LONG_PATHS:
        st.add_finding("stale-optimizer-param", path, "error", 0, f"{path} is not in the model", count=500)
    st.conn.commit()
    st.conn.close()     # not st.close(): the store stays "running", as in a copy taken while training
    return p


@contextmanager
def window(driver, width: int, height: int = 900):
    old = driver.get_window_size()
    driver.set_window_size(width, height)
    try:
        yield
    finally:
        driver.set_window_size(old["width"], old["height"])


def active(driver):
    return driver.switch_to.active_element


def tab_until(driver, css: str, max_tabs: int = 80):
    """Press Tab (a real key press) until the focused element matches ``css``; it, or fail."""
    for _ in range(max_tabs):
        ActionChains(driver).send_keys(Keys.TAB).perform()
        if driver.execute_script("return document.activeElement.matches(arguments[0])", css):
            return active(driver)
    raise AssertionError(f"Tab never reached {css}")


def press(driver, key: str) -> None:
    ActionChains(driver).send_keys(key).perform()


# -- 1. findings open from the keyboard ------------------------------------------------------------------------
def test_finding_cards_open_from_the_keyboard(page, server_factory, demo_store):
    """A finding's path is a native button (the card around it is no control: it holds the evidence
    toggle); Tab reaches the button, then the card's evidence; Enter on the evidence opens it in
    place, Enter on the button opens the module."""
    srv = server_factory(["--snapshot", str(demo_store)])
    page.get(srv.url + "findings")
    wait_text(page, "unregistered-module", "#findings-list")
    # Tab on from the last filter, the element before the cards: the first card's button, not the card
    page.execute_script("const i = document.querySelectorAll('.findings-tools input'); i[i.length - 1].focus()")
    press(page, Keys.TAB)
    button = active(page)
    assert button.tag_name == "button" and button.get_attribute("data-action") == "open"
    assert page.execute_script("return arguments[0].matches('#findings-list > .findings-summary + .finding "
                               "> .finding-head > button.path')", button)
    assert button.get_attribute("aria-label") == f"unregistered-module at {button.text}: show this module"
    card = page.find_element(By.CSS_SELECTOR, "#findings-list > .finding")
    assert card.get_attribute("role") is None and card.get_attribute("tabindex") is None
    assert card.get_attribute("aria-label") is None
    assert aria_problems(page, "#findings-list") == []       # no control holds another (nor a toggle)
    # the card's evidence is the next tab stop, and opens from the keyboard without leaving the page
    press(page, Keys.TAB)
    assert page.execute_script("return document.activeElement.matches("
                               "'#findings-list > .findings-summary + .finding > details.evidence-box > summary')")
    press(page, Keys.ENTER)
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".finding details[open][data-open='true'] pre"),
             "evidence open (drawn again so)")
    assert page.current_url.endswith("/findings")
    assert page.execute_script("return document.activeElement.matches('.finding details[open] > summary')")
    press(page, Keys.ENTER)        # and closes again: the focus stayed on its toggle over the redraw
    wait_for(page, lambda d: not d.find_elements(By.CSS_SELECTOR, ".finding details[open]"), "evidence closed")
    assert page.current_url.endswith("/findings")
    # Enter on a card's button opens its module, as a click does
    path = page.execute_script("const b = document.querySelector('#findings-list > .finding button.path');"
                               "b.focus(); return b.textContent")
    press(page, Keys.ENTER)
    wait_for(page, lambda d: d.current_url.endswith("/modules"), "the Modules page")
    wait_text(page, path.rsplit(".", 1)[0] if path.endswith((".weight", ".bias")) else path, "#detail-header h2")


def test_top_findings_open_from_the_keyboard(page, server_factory, demo_store):
    srv = server_factory(["--snapshot", str(demo_store)])
    page.get(srv.url)
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#ov-top-findings .top-finding"), "top findings")
    row = tab_until(page, "#ov-top-findings .top-finding")
    assert row.tag_name == "button"           # a native button: nothing interactive inside it
    path = row.find_element(By.CSS_SELECTOR, ".path").text
    assert path in row.get_attribute("aria-label")
    assert aria_problems(page, "#ov-top-findings") == []
    press(page, " ")
    wait_for(page, lambda d: d.current_url.endswith("/modules"), "the Modules page")
    wait_text(page, "encoder.blocks[", "#detail-header h2")


# -- 2. the tree keeps the focus over its redraw ------------------------------------------------------------------
def test_tree_toggle_keeps_focus_after_the_redraw(page, server_factory, demo_store):
    srv = server_factory(["--snapshot", str(demo_store)])
    page.get(srv.url + "modules")
    toggle_css = ".tree-row[data-path='encoder'] .tree-toggle"
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='encoder.blocks[0]']"),
             "the tree, encoder open")
    page.execute_script("document.querySelector(arguments[0]).focus()", toggle_css)
    press(page, Keys.ENTER)
    wait_for(page, lambda d: not d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='encoder.blocks[0]']"),
             "encoder collapsed")
    wait_for(page, lambda d: d.execute_script("return document.activeElement.matches(arguments[0])", toggle_css),
             "focus back on encoder's toggle")
    assert active(page).get_attribute("aria-expanded") == "false"
    press(page, Keys.ENTER)        # the same key again, without Tab: it expands again
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='encoder.blocks[0]']"),
             "encoder expanded again")
    wait_for(page, lambda d: d.execute_script("return document.activeElement.matches(arguments[0])", toggle_css),
             "focus still on encoder's toggle")


def focused_row(driver) -> str | None:
    """data-path of the focused element when it is a tree row itself (not its toggle or name)."""
    return driver.execute_script("const a = document.activeElement;"
                                 "return a && a.matches('#tree .tree-row') ? a.getAttribute('data-path') : null")


def wait_focus_on(driver, path: str, **attrs: str) -> None:
    """Wait until the row ``path`` has the focus (also after a redraw) and the ``attrs`` (aria-*)."""
    def ok(d):
        if focused_row(d) != path:
            return False
        el = active(d)
        return all(el.get_attribute(k.replace("_", "-")) == v for k, v in attrs.items())
    wait_for(driver, ok, f"focus on the row {path!r} with {attrs}")


def test_tree_is_an_aria_tree_driven_by_the_arrow_keys(page, server_factory, demo_store):
    srv = server_factory(["--snapshot", str(demo_store)])
    page.get(srv.url + "modules")
    blocks0 = ".tree-row[data-path='encoder.blocks[0]']"
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, blocks0), "the tree, encoder open")
    tree = page.find_element(By.ID, "tree")
    assert tree.get_attribute("role") == "tree" and tree.get_attribute("aria-label")
    rows = {el.get_attribute("data-path"): el for el in page.find_elements(By.CSS_SELECTOR, "#tree .tree-row")}
    assert list(rows) == ["", "stem", "encoder", "encoder.blocks[0]", "encoder.blocks[1]", "encoder.blocks[2]",
                          "head"]
    assert {el.get_attribute("role") for el in rows.values()} == {"treeitem"}
    assert [rows[p].get_attribute("aria-level") for p in ("", "stem", "encoder", "encoder.blocks[0]")] == \
        ["1", "2", "2", "3"]
    assert [rows[p].get_attribute("aria-expanded") for p in ("", "encoder")] == ["true", "true"]
    assert rows["stem"].get_attribute("aria-expanded") is None          # a leaf
    assert {el.get_attribute("aria-selected") for el in rows.values()} == {"false"}
    # roving tabindex: one row in the Tab order (nothing selected: the first), its toggle and name not
    assert [p for p, el in rows.items() if el.get_attribute("tabindex") == "0"] == [""]
    assert not page.find_elements(By.CSS_SELECTOR, "#tree .tree-row [tabindex='0']")
    tab_until(page, "#tree .tree-row")
    assert focused_row(page) == ""

    # ArrowDown / ArrowUp: the next / previous visible row
    press(page, Keys.ARROW_DOWN)
    wait_focus_on(page, "stem")
    press(page, Keys.ARROW_DOWN)
    wait_focus_on(page, "encoder", aria_expanded="true", tabindex="0")
    # the Tab stop follows the focus: Shift+Tab leaves the tree (not to an earlier row), Tab comes back here
    ActionChains(page).key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT).perform()
    assert not page.execute_script("return document.getElementById('tree').contains(document.activeElement)")
    press(page, Keys.TAB)
    wait_focus_on(page, "encoder")
    # ArrowLeft on an expanded node collapses it (the server redraws the tree): the focus stays on the row
    press(page, Keys.ARROW_LEFT)
    wait_for(page, lambda d: not d.find_elements(By.CSS_SELECTOR, blocks0), "encoder collapsed")
    wait_focus_on(page, "encoder", aria_expanded="false", tabindex="0")
    press(page, Keys.ARROW_DOWN)         # collapsed: the next row is head
    wait_focus_on(page, "head")
    press(page, Keys.ARROW_UP)
    wait_focus_on(page, "encoder")
    # ArrowRight on a collapsed node expands it, on an expanded one goes to its first child
    press(page, Keys.ARROW_RIGHT)
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, blocks0), "encoder expanded again")
    wait_focus_on(page, "encoder", aria_expanded="true")
    press(page, Keys.ARROW_RIGHT)
    wait_focus_on(page, "encoder.blocks[0]", aria_level="3")
    press(page, Keys.ARROW_RIGHT)        # a leaf: nothing
    wait_focus_on(page, "encoder.blocks[0]")
    # ArrowLeft on a child (not expanded) goes to its parent
    press(page, Keys.ARROW_DOWN)
    wait_focus_on(page, "encoder.blocks[1]")
    press(page, Keys.ARROW_LEFT)
    wait_focus_on(page, "encoder", aria_expanded="true")
    # Home / End: the first / last row
    press(page, Keys.END)
    wait_focus_on(page, "head")
    press(page, Keys.HOME)
    wait_focus_on(page, "")
    press(page, Keys.ARROW_UP)           # nothing above the first
    wait_focus_on(page, "")
    assert page.find_elements(By.CSS_SELECTOR, blocks0)     # no key above changed the expansion by itself

    # Enter selects the focused row, as a click does; Space too
    press(page, Keys.END)
    wait_focus_on(page, "head")
    press(page, Keys.ENTER)
    wait_text(page, "head", "#detail-header h2")
    wait_focus_on(page, "head", aria_selected="true", tabindex="0")
    assert page.find_elements(By.CSS_SELECTOR, ".tree-row.selected[data-path='head']")
    press(page, Keys.ARROW_UP)
    wait_focus_on(page, "encoder.blocks[2]")
    press(page, " ")
    wait_text(page, "encoder.blocks[2]", "#detail-header h2")
    wait_focus_on(page, "encoder.blocks[2]", aria_selected="true", tabindex="0")
    sel = [el.get_attribute("data-path") for el in page.find_elements(By.CSS_SELECTOR, "#tree [aria-selected='true']")]
    assert sel == ["encoder.blocks[2]"]
    assert len(page.find_elements(By.CSS_SELECTOR, "#tree [tabindex='0']")) == 1


# -- 3. the detail chart's titles and legends --------------------------------------------------------------------
OVERLAPS_JS = """
const box = document.getElementById('detail-activation');
const rects = sel => [...box.querySelectorAll(sel)].map(e => e.getBoundingClientRect()).filter(r => r.width);
const legends = [...box.querySelectorAll('g.infolayer > g[class^="legend"]')];
const titles = [...box.querySelectorAll('.legendtitletext, .annotation-text')].map(e => e.textContent);
const entries = legends.map(l => [...l.querySelectorAll('g.traces')].map(e => e.getBoundingClientRect()));
const heads = rects('.legendtitletext, .annotation-text');
const plots = rects('.draglayer .nsewdrag');
const hit = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
const out = [];
legends.forEach((l, i) => {
  for (const e of entries[i]) {
    for (const p of plots) if (hit(e, p)) out.push(['entry over a plot', i]);
    for (const h of heads) if (hit(e, h)) out.push(['entry over a title', i]);
  }
});
return {titles: titles, legends: legends.length, plots: plots.length, overlaps: out};
"""


@pytest.mark.parametrize("width", [1280, 1400])
def test_detail_chart_legends_never_cover_the_titles(page, server_factory, busy_store, width):
    srv = server_factory(["--snapshot", str(busy_store)])
    with window(page, width):
        page.get(srv.url + "modules")
        wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='head']"), "the tree")
        page.find_element(By.CSS_SELECTOR, ".tree-row[data-path='head'] .tree-label").click()
        wait_text(page, "head", "#detail-header h2")
        wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#detail-activation .scatterlayer .trace"),
                 "the detail chart")
        res = wait_for(page, lambda d: (r := d.execute_script(OVERLAPS_JS))["legends"] >= 3 and r, "three legends")
        screenshot(page, f"detail-legends-{width}")
        assert {"Activation mean / std", "Fractions of units", "Output grad norm"} <= set(res["titles"])
        assert res["plots"] == 3
        assert res["overlaps"] == []


# -- 4. tree rows fit the panel -------------------------------------------------------------------------------
def test_tree_rows_fit_the_panel_and_show_their_counts(page, server_factory, busy_store):
    srv = server_factory(["--snapshot", str(busy_store)])
    with window(page, 1280):
        page.get(srv.url + "modules")
        wait_for(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='head'] .badge")) >= 4,
                 "head's four badges")
        screenshot(page, "tree-1280")
        tree = page.find_element(By.ID, "tree")
        assert int(tree.get_attribute("scrollWidth")) <= int(tree.get_attribute("clientWidth"))
        right = page.execute_script("return document.getElementById('tree').getBoundingClientRect().right")
        for el in page.find_elements(By.CSS_SELECTOR, "#tree .tree-params"):
            assert page.execute_script("return arguments[0].getBoundingClientRect().right", el) <= right + 0.5
        counts = page.find_element(By.CSS_SELECTOR, ".tree-row[data-path='head'] .tree-params")
        assert "params" in counts.text and counts.is_displayed()


# -- 5. top findings show their whole path ------------------------------------------------------------------
def test_top_findings_show_the_whole_path(page, server_factory, busy_store):
    srv = server_factory(["--snapshot", str(busy_store)])
    with window(page, 1280):
        page.get(srv.url)
        wait_for(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#ov-top-findings .top-finding")) >= 6,
                 "top findings")
        screenshot(page, "top-findings-1280")
        paths = page.find_elements(By.CSS_SELECTOR, "#ov-top-findings .top-finding .path")
        shown = [p.text for p in paths]
        for p in paths:   # nothing cut off
            assert int(p.get_attribute("scrollWidth")) <= int(p.get_attribute("clientWidth")), p.text
        for p in paths:   # and the whole path in the tooltip
            assert p.get_attribute("title") == p.get_attribute("textContent")
        assert set(LONG_PATHS) <= {s.replace("\n", "") for s in shown}
        for row in page.find_elements(By.CSS_SELECTOR, "#ov-top-findings .top-finding"):
            assert row.find_element(By.CSS_SELECTOR, ".path").get_attribute("textContent") in row.get_attribute("title")


# -- 6. a snapshot taken while training -------------------------------------------------------------------------
def test_snapshot_of_a_running_run_says_running_when_copied(page, server_factory, busy_store):
    srv = server_factory(["--snapshot", str(busy_store)])
    page.get(srv.url)
    wait_text(page, "running when copied", "#run-status")
    wait_text(page, "Classifier · running when copied", "#ov-cards")
