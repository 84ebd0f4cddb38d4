"""Browser tests: token on non-loopback binds, user strings rendered as text, and a
10,000-module tree that stays usable (lazy expansion, capped search)."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

import synth_store
from browser_helpers import assert_console_clean, click, screenshot, wait_for, wait_text

pytestmark = pytest.mark.browser

EVIL_TYPE = "<script>alert(1)</script>"
EVIL_NAME = "<img src=x onerror=alert(2)>"


def http_status(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_non_loopback_bind_requires_token(page, server_factory, tmp_path):
    synth_store.demo(tmp_path / "run" / "modscope.sqlite")
    srv = server_factory(["--snapshot", str(tmp_path / "run" / "modscope.sqlite")], host="0.0.0.0")
    m = re.search(r"\?token=([A-Za-z0-9_\-]+)", srv.output())
    assert m, srv.output()
    token = m.group(1)
    assert http_status(srv.url) == 401
    assert http_status(srv.url + "_dash-layout") == 401
    assert http_status(srv.url + "_dash-layout", {"X-Modscope-Token": token}) == 200
    assert http_status(srv.url + "?token=wrong") == 401

    page.get(srv.url)                                   # no token: the browser gets the 401 too
    wait_text(page, "401 Unauthorized")
    page.get_log("browser")                             # the 401 itself is logged; it is expected
    page.get(srv.url + f"?token={token}")               # once with the token, then the cookie
    wait_text(page, "Classifier", "#ov-cards")
    click(page, ".nav-link", "Modules")                 # later requests carry the cookie
    wait_for(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".tree-row[data-kind='unregistered']")) == 3,
             "the tree behind the token")


def test_explicit_token(server_factory, tmp_path):
    synth_store.demo(tmp_path / "run" / "modscope.sqlite")
    srv = server_factory(["--run", str(tmp_path / "run"), "--token", "s3cret"], host="0.0.0.0")
    assert "?token=s3cret" in srv.output()
    assert http_status(srv.url) == 401
    assert http_status(srv.url + "?token=s3cret") == 200
    assert http_status(srv.url, {"Authorization": "Bearer s3cret"}) == 200


def evil_store(path):
    st = synth_store.SynthStore(path, run_name="<b>run</b>", model_class=EVIL_TYPE)
    root = st.add_module("", None, "", EVIL_TYPE, params=10)
    bad = st.add_module(EVIL_NAME, root, EVIL_NAME, EVIL_TYPE, kind="unregistered", params=10, in_opt=0)
    st.add_param(bad, f"{EVIL_NAME}.weight", "weight", [10], kind="tensor", in_optimizer=False)
    st.commit()
    st.add_finding("unregistered-module", EVIL_NAME, "error", bad, f"{EVIL_TYPE} is not registered <b>bold</b>",
                   "use <i>nn.ModuleList</i>", {"html": EVIL_TYPE})
    st.add_steps(5)
    st.close()


def test_user_strings_render_as_text(page, server_factory, tmp_path):
    evil_store(tmp_path / "evil" / "modscope.sqlite")
    srv = server_factory(["--snapshot", str(tmp_path / "evil" / "modscope.sqlite")])
    page.get(srv.url)
    wait_text(page, EVIL_TYPE, "#ov-cards")
    click(page, ".nav-link", "Findings")
    wait_text(page, f"{EVIL_TYPE} is not registered <b>bold</b>", "#findings-list")
    click(page, ".nav-link", "Modules")
    click(page, ".tree-row[data-kind='unregistered'] .tree-label")
    wait_text(page, EVIL_NAME, "#detail-header")
    wait_text(page, EVIL_TYPE, "#detail-header")
    with pytest.raises(NoAlertPresentException):
        page.switch_to.alert.text
    assert page.execute_script(
        "return document.querySelectorAll('img[src=\"x\"]').length"
        " + [...document.querySelectorAll('b, i')].filter(e => /bold|ModuleList/.test(e.textContent)).length") == 0
    screenshot(page, "escaping")


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "modscope.sqlite"
    synth_store.big(path, n_modules=10000, steps=3, hist=True)
    return path


def test_ten_thousand_modules_stay_usable(page, server_factory, big_store):
    srv = server_factory(["--snapshot", str(big_store)])
    page.get(srv.url + "modules")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='layers.0']"), "first level")
    rows = page.find_elements(By.CSS_SELECTOR, ".tree-row")
    assert len(rows) < 200                               # lazily expanded: not 10,000 DOM rows
    wait_text(page, "inside", "#tree")                   # collapsed nodes say what is below them

    click(page, ".tree-row[data-path='layers.3'] .tree-toggle")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-path='layers.3.layers.7']"),
             "children of layers.3")

    box = page.find_element(By.ID, "tree-search")
    box.send_keys("layers.3.layers")
    box.send_keys(Keys.ENTER)
    wait_text(page, "refine the search", "#tree-info")   # capped result list
    assert len(page.find_elements(By.CSS_SELECTOR, ".tree-row")) <= 200
    click(page, ".tree-row[data-path='layers.3.layers.7.layers.1'] .tree-label")
    wait_text(page, "layers.3.layers.7.layers.1", "#detail-header h2")
    screenshot(page, "scale-10k")
    assert_console_clean(page)
