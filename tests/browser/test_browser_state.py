"""Browser tests: what the user did on a page stays as the user left it, and the findings are controls a
keyboard and a screen reader can use (a real headless Chromium against a real server).

1. A finding card holds toggles (evidence, consequences): it is no button itself; its path is the
   button that opens its module, and the toggles stay tab stops of their own (no control holds anything
   interactive: axe's "nested-interactive", checked by hand), the focus staying on them over a redraw.
2. An evidence block scrolled sideways stays scrolled when a poll draws it again.
3. What the user opened on the Findings page, or in a module's detail, is still open after going to another page
   and back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from browser_helpers import aria_problems, click, wait_for, wait_text
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from bench import synth_store
from probes import schema

pytestmark = pytest.mark.browser


def open_key(part: str, code: str, path: str) -> str:
    """The data-open-key of a finding's <details> (dashboard.web.components.details_key)."""
    return json.dumps([part, code, path], separators=(",", ":"))


def details_css(part: str, code: str, path: str, box: str = "#findings-list") -> str:
    return f"{box} details[data-open-key='{open_key(part, code, path)}']"


def is_open(driver, css: str) -> bool:
    return bool(driver.execute_script("const d = document.querySelector(arguments[0]); return !!(d && d.open)", css))


def drawn_open(driver, css: str) -> bool:
    """Open as the server drew it (the user's toggle has come back in a redraw)."""
    return is_open(driver, f"{css}[data-open='true']")


def active_matches(driver, css: str) -> bool:
    return bool(driver.execute_script("return document.activeElement.matches(arguments[0])", css))


@pytest.fixture
def three_layers(tmp_path) -> Path:
    """3 root causes (unregistered-module at encoder.blocks[i], with evidence), 4 consequences each."""
    p = tmp_path / "three" / "modscope.sqlite"
    synth_store.three_layers(p, steps=5)
    return p


# -- 1. findings: a button per finding, the toggles beside it -------------------------------------------------
CARDS_JS = """
return Array.from(document.querySelectorAll('#findings-list .finding')).map(c => ({
  role: c.getAttribute('role'), tabindex: c.getAttribute('tabindex'), label: c.getAttribute('aria-label'),
  code: c.querySelector(':scope > .finding-head > .pill').textContent.replace(/^\\S+\\s+/, ''),
  path: c.querySelector(':scope > .finding-head > .path').textContent,
  buttons: Array.from(c.querySelectorAll(':scope > .finding-head > button')).map(b => [
    b.getAttribute('data-action'), b.getAttribute('data-mid') === c.getAttribute('data-mid'),
    b.getAttribute('aria-label'), b.textContent])}));
"""


def test_finding_cards_are_no_buttons_their_paths_are(page, server_factory, three_layers):
    srv = server_factory(["--snapshot", str(three_layers)])
    page.get(srv.url + "findings")
    consequences = details_css("consequences", "unregistered-module", "encoder.blocks[1]")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, f"{consequences} > summary"), "the findings")
    click(page, f"{consequences} > summary")          # the consequences (cards inside a card) shown
    wait_for(page, lambda d: drawn_open(d, consequences), "the consequences open, drawn again")
    cards = page.execute_script(CARDS_JS)
    assert len(cards) == 15
    for c in cards:    # the card is no control; its one button, on its path, opens its module
        assert (c["role"], c["tabindex"], c["label"]) == (None, None, None), c
        assert c["buttons"] == [["open", True, f"{c['code']} at {c['path']}: show this module", c["path"]]], c
    assert aria_problems(page, "#findings-list") == []

    # Tab: the root cause's button, its evidence, its consequences, then the first consequence's button
    page.execute_script("document.querySelector(arguments[0]).closest('.finding')"
                        ".querySelector('button.path').focus()", consequences)
    root = "#findings-list > .finding:nth-child(3)"    # after the summary and the first root cause
    assert active_matches(page, f"{root} > .finding-head > button.path")
    for css in (f"{root} > details.evidence-box > summary", f"{consequences} > summary",
                f"{consequences} .consequences-list > .finding:first-child button.path"):
        ActionChains(page).send_keys(Keys.TAB).perform()
        assert active_matches(page, css), css
    # Enter on the evidence opens it in place; the list drawn again, the focus is on the same toggle
    evidence = details_css("evidence", "unregistered-module", "encoder.blocks[1]")
    page.execute_script("const s = document.querySelector(arguments[0]); s.focus(); s._before = true;",
                        f"{evidence} > summary")
    ActionChains(page).send_keys(Keys.ENTER).perform()
    wait_for(page, lambda d: d.execute_script("const s = document.querySelector(arguments[0]);"
                                              "return s && !s._before && s.parentElement.open",
                                              f"{evidence} > summary"), "the evidence open, drawn again")
    assert active_matches(page, f"{evidence} > summary") and page.current_url.endswith("/findings")
    assert aria_problems(page, "#findings-list") == []

    # a module's detail (its findings' cards open nothing) and the Overview's top findings: no nested controls
    ActionChains(page).key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT).perform()
    assert active_matches(page, f"{root} > .finding-head > button.path")
    ActionChains(page).send_keys(Keys.ENTER).perform()
    wait_text(page, "encoder.blocks[1]", "#detail-header h2")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#detail-findings details.evidence-box"), "detail")
    assert aria_problems(page, "#detail-findings") == []
    click(page, ".nav-link", "Overview")
    wait_for(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#ov-top-findings button.top-finding")) == 3,
             "three top findings")
    assert aria_problems(page, "#ov-top-findings") == []


# -- 2. evidence scrolled sideways, drawn again by each poll --------------------------------------------------------
WIDE = {"values": [1.5] * 4, "note": "a line wider than any screen " + "x" * 500}


# the <pre> of the <details> ``css`` (a key): whether it is the one marked before (the same element), its scroll
PRE_JS = """
const d = document.querySelector(arguments[0]);
const p = d && d.querySelector(':scope > pre');
if (arguments[1] && p) { p._before = true; }
return p ? {same: !!p._before, left: p.scrollLeft, wide: p.scrollWidth > p.clientWidth + 100, open: d.open}
         : null;
"""


def scroll_sideways(driver, css: str) -> int:
    """Scroll the evidence <pre> of ``css`` sideways as a user does (a wheel event over it); its scrollLeft."""
    # (a poll may draw the <pre> again at any time: the wheel goes to a point of the viewport, not an element)
    x, y = driver.execute_script("const p = document.querySelector(arguments[0]);"
                                 "p.scrollIntoView({block: 'center'}); const r = p.getBoundingClientRect();"
                                 "return [r.left + r.width / 2, r.top + r.height / 2];", f"{css} > pre")
    ActionChains(driver).scroll_from_origin(ScrollOrigin.from_viewport(int(x), int(y)), 240, 0).perform()
    seen: list[int] = []

    def settled(d):    # moved, and no longer moving (a wheel scroll may be animated)
        seen.append(d.execute_script(PRE_JS, css, False)["left"])
        return len(seen) > 1 and seen[-1] > 0 and seen[-1] == seen[-2] and seen[-1]
    return wait_for(driver, settled, "the evidence scrolled sideways")


def redrawn(driver, writer, css: str) -> dict:
    """Mark the <pre> of ``css``, let the run take a step, and wait for the poll's redraw: the new <pre>."""
    driver.execute_script(PRE_JS, css, True)
    writer.add_steps(1)
    return wait_for(driver, lambda d: (s := d.execute_script(PRE_JS, css, False)) and not s["same"] and s,
                    "the evidence drawn again")


def test_evidence_keeps_its_sideways_scroll_while_the_run_trains(page, server_factory, tmp_path):
    run = tmp_path / "run"
    writer = synth_store.demo(run / schema.store_filename("r1", 0), steps=3, live=True)
    try:
        head = next(m["module_id"] for m in writer.modules if m["path"] == "head")
        writer.add_finding("dead-units", "head", "warning", head, "half of head's units are dead", evidence=WIDE)
        srv = server_factory(["--run", str(run), "--poll-ms", "300"])
        for url, box in (("findings", "#findings-list"), ("modules", "#detail-findings")):
            page.get(srv.url + url)
            if url == "modules":      # the module's detail: its findings drawn again on every poll too
                click(page, ".tree-row[data-path='head'] .tree-label")
                wait_text(page, "head", "#detail-header h2")
            css = details_css("evidence", "dead-units", "head", box)
            click(page, f"{css} > summary")
            wait_for(page, lambda d, css=css: drawn_open(d, css) and d.execute_script(PRE_JS, css, False)["wide"],
                     "the wide evidence open")
            left = scroll_sideways(page, css)
            for _ in range(2):
                state = redrawn(page, writer, css)
                assert state["open"] and state["left"] == left, (url, state, left)
            if url == "findings":     # the focus on a finding's button stays there too
                button = "#findings-list > .findings-summary + .finding button.path"
                page.execute_script("document.querySelector(arguments[0]).focus()", button)
                redrawn(page, writer, css)
                assert active_matches(page, button)
    finally:
        writer.close()


# -- 3. opened, then another page, then back ------------------------------------------------------------------------
def test_opened_findings_stay_open_after_another_page(page, server_factory, three_layers):
    srv = server_factory(["--snapshot", str(three_layers)])
    page.get(srv.url + "findings")
    consequences = details_css("consequences", "unregistered-module", "encoder.blocks[1]")
    evidence = details_css("evidence", "unregistered-module", "encoder.blocks[2]")
    closed = details_css("evidence", "unregistered-module", "encoder.blocks[1]")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, f"{evidence} > summary"), "the findings")
    click(page, f"{consequences} > summary")
    click(page, f"{evidence} > summary")
    wait_for(page, lambda d: drawn_open(d, consequences) and drawn_open(d, evidence), "both open")

    def back_on_findings(how: str) -> None:
        wait_for(page, lambda d: d.current_url.endswith("/findings") and is_open(d, consequences)
                 and is_open(d, evidence), f"both open again ({how})")
        assert not is_open(page, closed)

    # to the Modules page by a finding's button, back by the navigation
    wait_for(page, lambda d: d.execute_script("return document.querySelector(arguments[0]).closest('.finding')"
                                              ".querySelector(':scope > .finding-head > button.path')",
                                              evidence).click() or True, "a click on blocks[2]'s button")
    wait_text(page, "encoder.blocks[2]", "#detail-header h2")
    assert not page.find_elements(By.ID, "findings-list")
    click(page, ".nav-link", "Findings")
    back_on_findings("the navigation")
    # to the Overview, back by the browser's Back button; a reload keeps them too (the tab's session)
    click(page, ".nav-link", "Overview")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#ov-top-findings .top-finding"), "the Overview")
    page.back()
    back_on_findings("Back")
    page.refresh()
    back_on_findings("a reload")
    # closing one is kept as well
    click(page, f"{consequences} > summary")
    wait_for(page, lambda d: d.execute_script("const x = document.querySelector(arguments[0]); return !!x && !x.open",
                                              f"{consequences}[data-open='false']"), "drawn closed")
    click(page, ".nav-link", "Modules")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row"), "the Modules page")
    click(page, ".nav-link", "Findings")
    wait_for(page, lambda d: is_open(d, evidence), "the evidence open again")
    assert not is_open(page, consequences)


def test_opened_detail_findings_stay_open_after_another_page(page, server_factory, three_layers):
    srv = server_factory(["--snapshot", str(three_layers)])
    page.get(srv.url + "findings")
    button = details_css("evidence", "unregistered-module", "encoder.blocks[2]")
    wait_for(page, lambda d: d.execute_script("const x = document.querySelector(arguments[0]); return !!x && "
                                              "x.closest('.finding').querySelector(':scope > .finding-head > "
                                              "button.path').click() === undefined", button), "blocks[2]'s button")
    wait_text(page, "encoder.blocks[2]", "#detail-header h2")
    evidence = details_css("evidence", "unregistered-module", "encoder.blocks[2]", box="#detail-findings")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, f"{evidence} > summary"), "the detail's findings")
    click(page, f"{evidence} > summary")
    wait_for(page, lambda d: drawn_open(d, evidence), "the detail's evidence open")
    click(page, ".nav-link", "Findings")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#findings-list .finding"), "the Findings page")
    click(page, ".nav-link", "Modules")
    wait_text(page, "encoder.blocks[2]", "#detail-header h2")
    wait_for(page, lambda d: is_open(d, evidence), "the detail's evidence open again")
