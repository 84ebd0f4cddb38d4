"""Browser tests: token on non-loopback binds (and its cookie), DNS rebinding refused in real
Chromium, user strings rendered as text, and a 10,000-module tree that stays usable (lazy
expansion, capped search)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from browser_helpers import (
    WAIT,
    assert_console_clean,
    click,
    console_errors,
    free_port,
    screenshot,
    start_chrome,
    wait_for,
    wait_text,
)
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from bench import synth_store

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
    token = "s3cret-s3cret-s3cret"
    srv = server_factory(["--run", str(tmp_path / "run"), "--token", token], host="0.0.0.0")
    assert f"?token={token}" in srv.output()
    assert http_status(srv.url) == 401
    assert http_status(srv.url + f"?token={token}") == 200         # the page that sets the cookie
    assert http_status(srv.url, {"Authorization": f"Bearer {token}"}) == 200


def test_token_leaves_the_address_bar_and_scripts_cannot_read_it(page, server_factory, tmp_path):
    synth_store.demo(tmp_path / "run" / "modscope.sqlite")
    srv = server_factory(["--snapshot", str(tmp_path / "run" / "modscope.sqlite")], host="0.0.0.0")
    token = re.search(r"\?token=([A-Za-z0-9_\-]+)", srv.output()).group(1)
    assert len(token) >= 32
    page.get(srv.url + f"modules?token={token}")
    wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".tree-row[data-kind='unregistered']"),
             "the tree, behind the token")
    assert page.current_url == srv.url + "modules"                 # no token in the address bar
    assert page.execute_script("return document.cookie") == ""      # HttpOnly: not for scripts
    cookies = {c["name"]: c for c in page.execute_cdp_cmd("Network.getCookies", {"urls": [srv.url]})["cookies"]}
    cookie = cookies[f"modscope_token_{srv.port}"]
    assert cookie["value"] == token and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    click(page, ".nav-link", "Findings")                            # later requests carry the cookie
    wait_text(page, "unregistered-module", "#findings-list")
    page.back()
    page.back()                                                     # the token URL is not in the back list
    wait_for(page, lambda d: d.current_url == "about:blank", "the page before the dashboard")


# -- DNS rebinding, in Chromium ---------------------------------------------------------------------
# The attack of issue 8: a page the user opened on evil.example.com, whose DNS name the attacker
# then points at 127.0.0.1, reads the loopback dashboard as its own origin. Chromium maps the name
# to 127.0.0.1 throughout (--host-resolver-rules); the rebinding itself is the attacker's server
# leaving the port and the dashboard answering on it: the page stays in the origin
# http://evil.example.com:PORT, and its same-origin requests now reach the dashboard.
ATTACK_JS = """
window.attack = async function (callbackBody) {
  const out = {};
  try {
    out.page = (await fetch('/')).status;
    const r = await fetch('/_dash-update-component', {
      method: 'POST', headers: {'Content-Type': 'application/json'}, body: JSON.stringify(callbackBody)});
    out.callback = r.status;
    const text = await r.text();
    out.store = text.includes('"filename"') && text.includes('.sqlite');
    out.text = text.slice(0, 100);
  } catch (e) {
    out.error = String(e);
  }
  let result = document.getElementById('attack-result');
  if (!result) {
    result = document.createElement('pre');
    result.id = 'attack-result';
    document.body.appendChild(result);
  }
  result.textContent = JSON.stringify(out);
};
"""
ATTACK_PAGE = ("<!DOCTYPE html><html><head><title>attacker</title><link rel='icon' href='data:,'></head>"
               f"<body><h1>cute cats</h1><script>{ATTACK_JS}</script></body></html>")


@pytest.fixture(scope="module")
def rebinding_browser():
    """A second Chromium in which evil.example.com resolves to 127.0.0.1."""
    driver, profile = start_chrome("--host-resolver-rules=MAP evil.example.com 127.0.0.1")
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def snapshot_callback_body(url: str) -> dict:
    """What the page posts when "Snapshot" is clicked: public knowledge (the app is open source)."""
    with urllib.request.urlopen(url + "_dash-dependencies", timeout=10) as r:
        deps = json.load(r)
    dep = next(d for d in deps if any(i["id"] == "export-snapshot-btn" for i in d["inputs"]))
    outputs = [dict(zip(("id", "property"), o.split(".", 1), strict=True))
               for o in dep["output"].strip(".").split("...")]
    return {"output": dep["output"], "outputs": outputs,
            "inputs": [{"id": "export-snapshot-btn", "property": "n_clicks", "value": 1}],
            "changedPropIds": ["export-snapshot-btn.n_clicks"], "state": [{**s, "value": None} for s in dep["state"]]}


def run_attack(driver, body: dict) -> dict:
    driver.execute_script("document.getElementById('attack-result')?.remove(); window.attack(arguments[0]);", body)
    text = wait_for(driver, lambda d: d.execute_script(
        "const e = document.getElementById('attack-result'); return e && e.textContent;"), "the attack's result")
    return json.loads(text)


def serve_attacker_page(port: int, directory) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/attack.html", timeout=2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the attacker's page server did not start on port {port}")


def test_dns_rebinding_is_refused_in_chromium(rebinding_browser, server_factory, tmp_path):
    driver = rebinding_browser
    synth_store.demo(tmp_path / "run" / "modscope.sqlite")
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "attack.html").write_text(ATTACK_PAGE)
    port = free_port()

    attacker = serve_attacker_page(port, tmp_path / "www")         # evil.example.com -> the attacker
    try:
        driver.get(f"http://evil.example.com:{port}/attack.html")
        wait_text(driver, "cute cats")
    finally:
        attacker.terminate()
        attacker.wait(10)
    srv = server_factory(["--snapshot", str(tmp_path / "run" / "modscope.sqlite")], port=port)  # -> 127.0.0.1
    body = snapshot_callback_body(srv.url)

    stolen = run_attack(driver, body)                               # same origin for Chromium: readable
    assert stolen.get("page") == 403 and stolen.get("callback") == 403, stolen
    assert not stolen["store"] and stolen["text"].startswith("403 Forbidden"), stolen

    driver.get(f"http://evil.example.com:{port}/")                  # a visit by name: refused too
    wait_text(driver, "403 Forbidden")
    refused = [line for line in srv.output().splitlines() if line.startswith("modscope.security: refused")]
    assert len(refused) >= 3 and all(f"Host 'evil.example.com:{port}'" in line for line in refused), srv.output()

    driver.get(srv.url)                                             # control: the dashboard's own origin
    wait_text(driver, "Classifier", "#ov-cards")
    driver.execute_script(ATTACK_JS)
    legit = run_attack(driver, body)
    assert legit.get("page") == 200 and legit.get("callback") == 200 and legit["store"], legit

    expected = [e for e in console_errors(driver) if "403" in e["message"]]
    assert expected                                                 # the refusals, seen by the browser
    assert not [e for e in console_errors(driver) if "403" not in e["message"]]
    assert_console_clean(driver)
    driver.get("about:blank")


def test_cross_site_page_cannot_post_to_the_dashboard_in_chromium(rebinding_browser, server_factory, tmp_path):
    """Without rebinding: a page on another origin submits a form to the loopback dashboard's
    callback URL (a cross-site POST). Its Host is right; its Origin is not: 403."""
    driver = rebinding_browser
    srv = server_factory(["--run", str(tmp_path / "run")])
    (tmp_path / "www").mkdir()
    form = (f"<form id='f' method='POST' action='{srv.url}_dash-update-component' enctype='text/plain'>"
            "<input name='{\"output\":\"x' value='\"}'></form>")
    (tmp_path / "www" / "attack.html").write_text(
        "<!DOCTYPE html><html><head><title>attacker</title><link rel='icon' href='data:,'></head>"
        f"<body><h1>cute cats</h1>{form}</body></html>")
    attacker_port = free_port()
    attacker = serve_attacker_page(attacker_port, tmp_path / "www")
    try:
        driver.get(f"http://evil.example.com:{attacker_port}/attack.html")
        wait_text(driver, "cute cats")
        driver.execute_script("document.getElementById('f').submit()")
        wait_text(driver, "403 Forbidden: cross-origin request")
    finally:
        attacker.terminate()
        attacker.wait(10)
    assert f"Origin 'http://evil.example.com:{attacker_port}'" in srv.output()
    driver.get_log("browser")                                       # the 403 itself is logged; it is expected
    driver.get("about:blank")


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
