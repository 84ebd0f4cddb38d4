"""Debian's headless Chromium and its driver (``chromium`` + ``chromium-driver``; ``MODSCOPE_CHROMIUM`` /
``MODSCOPE_CHROMEDRIVER`` point elsewhere), a dashboard server as a process of its own and its peak
memory: what the browser tests and the dashboard benchmarks share."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("MODSCOPE_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("MODSCOPE_CHROMEDRIVER", shutil.which("chromedriver") or "/usr/bin/chromedriver")
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1500,1000")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chrome_options(*extra_args: str, profile: str | None = None) -> Any:
    """selenium ChromeOptions for Debian's headless Chromium, with a profile directory of its own."""
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    profile = profile or tempfile.mkdtemp(prefix="modscope-chrome-")
    for a in (*CHROME_FLAGS, f"--user-data-dir={profile}", *extra_args):
        opts.add_argument(a)
    opts.binary_location = CHROMIUM
    return opts


def make_driver(*extra_args: str, profile: str | None = None) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=chrome_options(*extra_args, profile=profile))


def until(driver: Any, js: str, *args: Any, timeout: float = 60.0) -> float:
    """Seconds until the JS expression (``args`` in scope) returns truthy, polled every 5 ms in the page."""
    t0 = time.perf_counter()
    driver.set_script_timeout(timeout)
    ok = driver.execute_async_script(
        "const done = arguments[arguments.length - 1]; const args = arguments;"
        "const f = new Function('args', 'return (' + args[0] + ');');"
        "const t = setInterval(() => { let v = false; try { v = f(args); } catch (e) {}"
        " if (v) { clearInterval(t); done(true); } }, 5);", js, *args)
    if not ok:
        raise RuntimeError(f"never true: {js}")
    return time.perf_counter() - t0


class DashboardProcess:
    """``python app.py --run DIR`` on a free loopback port, its output in ``log``; ``url`` once it answers."""

    def __init__(self, run_dir: Path, log: Path, timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115  (the server writes to it until stop())
        self.proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--run", str(run_dir),
                                      "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(REPO))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit(f"dashboard did not start, see {log}") from None
                time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def load_seconds(driver: Any, url: str, ready: str, cold: bool) -> float:
    """Seconds from navigating to ``url`` until the JS expression ``ready`` holds; with the HTTP cache
    cleared first when ``cold`` (every script fetched and compiled again)."""
    if cold:
        driver.get("about:blank")
        driver.execute_cdp_cmd("Network.clearBrowserCache", {})
    t0 = time.perf_counter()
    driver.get(url)
    until(driver, ready)
    return time.perf_counter() - t0


def stop_process(proc: subprocess.Popen, grace: float = 15) -> None:
    """Terminate ``proc``; kill it if it has not exited after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class RSSSampler(threading.Thread):
    """The peak resident memory of a process, sampled every 50 ms until ``stop`` is set."""

    def __init__(self, pid: int) -> None:
        import psutil

        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)
