"""Helpers for the browser tests: a headless Chromium (Debian's chromium +
chromium-driver), dashboard servers started as real subprocesses on free ports, and
helpers that wait for visible text and check the browser console."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.browser import CHROMEDRIVER, CHROMIUM, chrome_options, free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "test-artifacts" / "screenshots"
WAIT = 30  # seconds: the upper bound of every wait (a wait, never a timed assert)


class Server:
    """``python app.py ARGS --port P`` as a subprocess; ``url`` once it answers HTTP."""

    def __init__(self, args: list[str], *, host: str = "127.0.0.1", cwd: Path | None = None,
                 port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.host = host
        self.log = tempfile.NamedTemporaryFile(prefix="modscope-server-", suffix=".log", delete=False)
        cmd = [sys.executable, str(REPO / "app.py"), *args, "--port", str(self.port), "--host", host]
        env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(cwd or REPO),
                                     env=env)
        self.url = f"http://127.0.0.1:{self.port}/"
        self._wait_up()

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def _wait_up(self) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dashboard exited with {self.proc.returncode}:\n{self.output()}")
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except urllib.error.HTTPError:
                return  # it answers (e.g. 401 without the token)
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"dashboard did not start:\n{self.output()}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


@pytest.fixture
def server_factory():
    servers: list[Server] = []

    def make(args: list[str], **kw) -> Server:
        s = Server(args, **kw)
        servers.append(s)
        return s
    yield make
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def download_dir():
    d = Path(tempfile.mkdtemp(prefix="modscope-downloads-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_chrome(*extra_args: str, download_dir: Path | None = None):
    """A headless Chromium driver with the options every browser test uses, plus
    ``extra_args`` (e.g. ``--host-resolver-rules=...``); returns ``(driver, profile_dir)``:
    ``driver.quit()`` and remove the profile when done."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail(f"headless Chromium needed for the browser tests: {CHROMIUM} / {CHROMEDRIVER} "
                    "(apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="modscope-chrome-")
    opts = chrome_options(*extra_args, profile=profile)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    if download_dir is not None:
        opts.add_experimental_option("prefs", {"download.default_directory": str(download_dir),
                                               "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    if download_dir is not None:
        driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(download_dir)})
    return driver, profile


@pytest.fixture(scope="session")
def browser(download_dir):
    driver, profile = start_chrome(download_dir=download_dir)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser, server_factory):
    """The shared browser, with its console drained before and checked after the test. It
    depends on ``server_factory`` so that the console is checked, and the page left, before the
    test's servers stop (a poll still in flight then would fail with "connection refused")."""
    browser.get("about:blank")
    browser.get_log("browser")
    yield browser
    try:
        assert_console_clean(browser)
    finally:
        # what the page kept in the tab's sessionStorage (the open <details>) must not reach a later
        # test's server on the same port (the same origin)
        try:
            browser.execute_script("try { sessionStorage.clear(); } catch (e) {}")
        finally:
            browser.get("about:blank")


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def assert_console_clean(driver) -> None:
    errors = console_errors(driver)
    assert not errors, "browser console errors:\n" + "\n".join(e["message"] for e in errors)


def wait_for(driver, predicate, what: str, timeout: float = WAIT):
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate(driver)
            if value:
                return value
        except (StaleElementReferenceException, WebDriverException) as exc:  # element re-rendered
            last_exc = exc
        time.sleep(0.1)
    raise AssertionError(f"waited {timeout:g}s for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def wait_text(driver, text: str, css: str = "body", timeout: float = WAIT):
    """Wait until ``text`` is visible inside an element matching ``css``."""
    from selenium.webdriver.common.by import By

    def seen(d):
        for el in d.find_elements(By.CSS_SELECTOR, css):
            if el.is_displayed() and text in el.text:
                return el
        return None
    return wait_for(driver, seen, f"text {text!r} in {css}", timeout)


def click(driver, css: str, text: str | None = None, timeout: float = WAIT):
    """Click the first visible element matching ``css`` (and containing ``text``)."""
    from selenium.webdriver.common.by import By

    def find(d):
        for el in d.find_elements(By.CSS_SELECTOR, css):
            if el.is_displayed() and (text is None or text in el.text):
                el.click()
                return True
        return False
    return wait_for(driver, find, f"clickable {css} {text or ''}", timeout)


def screenshot(driver, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def demo_available() -> bool:
    """The real demo (examples/demo_train.py + probes.watch + torch) is present."""
    if not (REPO / "examples" / "demo_train.py").exists():
        return False
    try:
        import probes
        return hasattr(probes, "watch")
    except ImportError:
        return False


# Hand-made checks in the spirit of axe-core's "nested-interactive" and "button-name" rules, over the
# elements under ``root``: a control (a button or link, native or by role) holds nothing interactive
# (a screen reader reads a button's content as one flat name: a toggle inside it cannot be reached),
# every control has a name, and every <summary> is a tab stop of its own.
ARIA_PROBLEMS_JS = """
const root = document.querySelector(arguments[0]);
if (!root) { return ['no element ' + arguments[0]]; }
const CONTROL = 'button, a[href], [role=button], [role=link]';
const INTERACTIVE = 'a[href], button, input, select, textarea, details, summary, [tabindex], [contenteditable], '
  + '[role=button], [role=link], [role=checkbox], [role=switch], [role=tab], [role=menuitem], [role=option]';
const what = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '')
  + (el.className && typeof el.className === 'string' ? '.' + el.className.trim().split(/\\s+/).join('.') : '')
  + (el.getAttribute('role') ? '[role=' + el.getAttribute('role') + ']' : '');
const out = [];
root.querySelectorAll(CONTROL).forEach(c => {
  c.querySelectorAll(INTERACTIVE).forEach(x => out.push('nested-interactive: ' + what(x) + ' inside ' + what(c)));
  const name = (c.getAttribute('aria-label') || c.textContent || '').trim();
  if (!name) { out.push('no name: ' + what(c)); }
});
root.querySelectorAll('summary').forEach(s => { if (s.tabIndex < 0) { out.push('not a tab stop: ' + what(s)); } });
return out;
"""


def aria_problems(driver, root: str = "body") -> list[str]:
    """What :data:`ARIA_PROBLEMS_JS` finds under the element ``root`` (a CSS selector); [] when none."""
    return driver.execute_script(ARIA_PROBLEMS_JS, root)
