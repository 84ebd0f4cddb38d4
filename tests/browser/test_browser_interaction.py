"""The dashboard used as a user would (a real headless Chromium against a real server): a tree row selects its
module by a click anywhere on it, and the header's "● LIVE" badge stays one badge in a narrow window."""

from __future__ import annotations

import pytest
from browser_helpers import click, screenshot, wait_for, wait_text
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from bench import synth_store
from probes import schema

pytestmark = pytest.mark.browser


def selected_path(driver) -> str | None:
    return driver.execute_script("const r = document.querySelector('#tree .tree-row.selected');"
                                 "return r ? r.getAttribute('data-path') : null;")


def test_a_click_anywhere_on_a_tree_row_selects_it(page, server_factory, tmp_path):
    """The row is highlighted under the pointer: a click on its parameter count, its type or the space between
    them selects the module, as a click on its name does (such a click used to do nothing)."""
    path = tmp_path / "demo.sqlite"
    synth_store.demo(path, steps=3)
    srv = server_factory(["--snapshot", str(path)])
    page.get(srv.url + "modules")
    row = "#tree .tree-row[data-path='head']"
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, row), "the tree")
    assert selected_path(page) is None
    for part, path_ in ((".tree-params", "head"), (".tree-type", "stem")):
        el = page.find_element(By.CSS_SELECTOR, f"#tree .tree-row[data-path='{path_}'] {part}")
        el.click()
        wait_for(page, lambda d, p=path_: selected_path(d) == p, f"{path_} selected by its {part}")
        wait_text(page, path_, "#detail-header h2")
    # the empty middle of a row: the pointer at its centre, which is no element inside it (the row is wide)
    target = page.find_element(By.CSS_SELECTOR, row)
    hit = page.execute_script("const r = arguments[0].getBoundingClientRect();"
                              "const e = document.elementFromPoint(r.left + r.width * 0.6, r.top + r.height / 2);"
                              "return e === arguments[0];", target)
    assert hit, "the row's middle is the row itself"
    ActionChains(page).move_to_element_with_offset(target, int(target.size["width"] * 0.1), 0).click().perform()
    wait_for(page, lambda d: selected_path(d) == "head", "head selected by a click on its row's empty middle")
    wait_text(page, "head", "#detail-header h2")
    # the toggle still only expands and collapses
    enc = "#tree .tree-row[data-path='encoder']"
    was = page.find_element(By.CSS_SELECTOR, enc).get_attribute("aria-expanded")
    page.find_element(By.CSS_SELECTOR, f"{enc} .tree-toggle").click()
    wait_for(page, lambda d: d.find_element(By.CSS_SELECTOR, enc).get_attribute("aria-expanded") != was,
             "encoder expanded or collapsed")
    assert selected_path(page) == "head"
    screenshot(page, "review-row-click")


def test_the_live_badge_stays_one_badge_in_a_narrow_window(page, server_factory, tmp_path):
    """At 900 px the header crowds: "● LIVE" broke into "●" over "LIVE" (a badge two lines high)."""
    run = tmp_path / "run"
    writer = synth_store.demo(run / schema.store_filename("r1", 0), steps=3, live=True)
    size = page.get_window_size()
    try:
        srv = server_factory(["--run", str(run)])
        page.set_window_size(900, 800)
        page.get(srv.url + "findings")
        badge = wait_for(page, lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, ".header .mode-live")
                                          if e.is_displayed()], "the live badge")[0]
        wait_text(page, "step", ".header")
        lines = page.execute_script(
            "const el = arguments[0]; const lh = parseFloat(getComputedStyle(el).lineHeight)"
            " || parseFloat(getComputedStyle(el).fontSize) * 1.5;"
            "return el.getBoundingClientRect().height / lh;", badge)
        screenshot(page, "review-header-900")
        assert lines < 1.9, f"the live badge is {lines:.1f} lines high"
    finally:
        page.set_window_size(size["width"], size["height"])
        writer.close()


SHARE_JS = """
return Array.from(document.querySelectorAll('.modebar-btn')).map(b => b.getAttribute('data-title'));
"""


def test_no_chart_offers_to_upload_it_to_plotly_cloud(page, server_factory, tmp_path):
    """plotly.js 4's mode bar has "Share chart...", which uploads the chart (a module's statistics of the user's
    training) to Plotly Cloud: no chart of the dashboard (the Overview's loss, a module's charts) nor of the HTML
    report offers it; the other buttons (zoom, PNG) stay."""
    path = tmp_path / "demo.sqlite"
    synth_store.demo(path, steps=5)
    srv = server_factory(["--snapshot", str(path)])
    page.get(srv.url)
    loss = wait_for(page, lambda d: [t for t in d.execute_script(SHARE_JS) if t], "the loss chart's mode bar")
    page.get(srv.url + "modules")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#tree .tree-row[data-path='head'] .tree-label"),
             "the tree")
    page.find_element(By.CSS_SELECTOR, "#tree .tree-row[data-path='head'] .tree-label").click()
    wait_text(page, "head", "#detail-header h2")
    detail = wait_for(page, lambda d: (t := [x for x in d.execute_script(SHARE_JS) if x]) and len(t) > len(loss) and t,
                      "the detail charts' mode bars")
    report = tmp_path / "report.html"
    from dashboard.cli import main as cli_main
    assert cli_main(["export", "--snapshot", str(path), "-o", str(report)]) in (0, None)
    page.get(report.as_uri())
    offline = wait_for(page, lambda d: [t for t in d.execute_script(SHARE_JS) if t], "the report's mode bars")
    for where, titles in (("overview", loss), ("detail", detail), ("report", offline)):
        assert "Share chart..." not in titles, where
        assert "Download plot as a PNG" in titles, where


def checked(driver, box: str) -> list[str]:
    return driver.execute_script("return Array.from(document.querySelectorAll(arguments[0] + ' input:checked'))"
                                 ".map(i => i.value)", box)


def test_findings_filters_stay_as_set_after_another_page(page, server_factory, tmp_path):
    """What is opened on the Findings page is kept over another page and back; the filters were not: "show
    resolved" went off again, hiding the resolved finding whose evidence the user had opened. Both are kept now
    (the tab's session), also over a reload."""
    path = tmp_path / "demo.sqlite"
    st = synth_store.demo(path, steps=3, live=True)
    head = next(m["module_id"] for m in st.modules if m["path"] == "head")
    st.add_finding("dead-units", "head", "warning", head, "half of head's units were dead", active=0)
    st.close()
    srv = server_factory(["--snapshot", str(path)])
    page.get(srv.url + "findings")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#findings-list .finding"), "the findings")
    assert "half of head's units" not in page.find_element(By.ID, "findings-list").text
    page.find_element(By.XPATH, "//*[@id='findings-show-resolved']//label[contains(., 'show resolved')]").click()
    page.find_element(By.XPATH, "//*[@id='findings-severity']//label[contains(., 'error')]").click()
    wait_text(page, "half of head's units", "#findings-list")
    wait_for(page, lambda d: "unregistered-module" not in d.find_element(By.ID, "findings-list").text,
             "the errors filtered out")
    for how in ("another page", "a reload"):
        if how == "another page":
            click(page, ".nav-link", "Modules")
            wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row"), "the Modules page")
            click(page, ".nav-link", "Findings")
        else:
            page.refresh()
        wait_text(page, "half of head's units", "#findings-list")
        assert checked(page, "#findings-show-resolved") == ["yes"], how
        assert checked(page, "#findings-severity") == ["warning", "info"], how
        assert "unregistered-module" not in page.find_element(By.ID, "findings-list").text, how


FOCUSED_ROW_JS = """
const a = document.activeElement;
return a && a.matches('#tree .tree-row') ? [a.getAttribute('data-path'), a.getAttribute('aria-selected')] : null;
"""


def test_a_finding_opened_from_the_keyboard_puts_the_focus_on_its_module(page, server_factory, tmp_path):
    """Enter on a finding's button (the Findings page) or Space on a top finding (the Overview) opened its module
    and left the focus on <body>: the next Tab started the page over. The focus goes to the module's row in the
    tree, selected, where the arrows and Tab go on."""
    path = tmp_path / "three" / "modscope.sqlite"
    synth_store.three_layers(path, steps=5)
    srv = server_factory(["--snapshot", str(path)])
    for url, button, key in (("findings", "#findings-list .finding button.finding-open", Keys.ENTER),
                             ("", "#ov-top-findings button.top-finding", Keys.SPACE)):
        page.get(srv.url + url)
        b = wait_for(page, lambda d, b=button: d.find_elements(By.CSS_SELECTOR, b), f"a finding on /{url}")[0]
        page.execute_script("arguments[0].focus()", b)
        ActionChains(page).send_keys(key).perform()
        wait_text(page, "encoder.blocks[0]", "#detail-header h2")
        row = wait_for(page, lambda d: d.execute_script(FOCUSED_ROW_JS), "the focus on the module's row")
        assert row == ["encoder.blocks[0]", "true"], (url, row)
        ActionChains(page).send_keys(Keys.ARROW_UP).perform()        # the tree's keys work from there
        wait_for(page, lambda d: (r := d.execute_script(FOCUSED_ROW_JS)) and r[0] == "encoder", "ArrowUp to encoder")
        screenshot(page, f"review-keyboard-open-{url or 'overview'}")


OVERLAP_JS = """
const s = document.getElementById('run-status').getBoundingClientRect();
const a = document.querySelector('.header .header-actions').getBoundingClientRect();
const vertical = s.bottom > a.top && s.top < a.bottom;
return {overlap: vertical && s.right > a.left + 1 && s.left < a.right, right: s.right, actions: a.left,
        text: document.getElementById('run-status').textContent};
"""


def test_a_long_status_does_not_run_under_the_export_buttons(page, server_factory, tmp_path):
    """At 900 px "step 7 · ended without close (process gone)" ran on under "⤓ Snapshot" and "⤓ HTML report"
    (text over the buttons): it wraps in the space it has."""
    import subprocess
    import sys
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run = tmp_path / "a-run-with-a-long-name"
    writer = synth_store.demo(run / schema.store_filename("r1", 0), steps=8, live=True)
    writer.set_rank(pid=gone.pid)
    size = page.get_window_size()
    try:
        srv = server_factory(["--run", str(run)])
        page.set_window_size(900, 800)
        page.get(srv.url)
        wait_text(page, "ended without close", "#run-status")
        state = page.execute_script(OVERLAP_JS)
        screenshot(page, "review-header-900-long-status")
        assert not state["overlap"], state
    finally:
        page.set_window_size(size["width"], size["height"])
        writer.conn.close()
