"""``w.show()`` in a real Jupyter kernel (ipykernel, driven by nbclient), with modscope installed
from the wheel: the cell's output holds an ``<iframe>`` of the dashboard's loopback URL, the URL
answers, Dash never enters the kernel, a second ``show()`` reuses the server, and the server
stops with the kernel."""

from __future__ import annotations

import http.server
import re
import shutil
import threading
import time
import urllib.error
import urllib.request

import nbformat
import pytest
import wheel_site
from browser_helpers import start_chrome, wait_for
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from bench import synth_store

TRAIN = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import probes


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = [nn.Linear(16, 16) for _ in range(3)]      # the bug: a plain list

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


model = nn.Sequential(nn.Linear(2, 16), Encoder(), nn.Linear(16, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
X = torch.randn(128, 2)
y = (X.sum(1) > 0).long()
w = probes.watch(model, opt, run_dir="nb-run", every=1)
for _ in range(5):
    loss = F.cross_entropy(model(X), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    w.step(loss)
print(sorted({f.path for f in w.findings() if f.code == "unregistered-module"}))
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> wheel_site.Site:
    return wheel_site.build_and_install(tmp_path_factory.mktemp("wheel"))


def outputs_of(cell) -> tuple[str, list[str]]:
    """(stdout text, text/html outputs) of an executed cell."""
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    htmls = [o.data["text/html"] for o in cell.outputs
             if o.output_type in ("display_data", "execute_result") and "text/html" in o.get("data", {})]
    return text, htmls


def test_show_displays_the_live_dashboard_inline(site, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(site.root))      # the kernel imports modscope from the wheel only
    nb = new_notebook(cells=[
        new_code_cell("import probes\nprint(probes.__file__)"),
        new_code_cell(TRAIN),
        new_code_cell("url = w.show()"),
        new_code_cell("import sys\nprint(w.show() == url, 'dash' in sys.modules, 'flask' in sys.modules)"),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        assert outputs_of(nb.cells[0])[0].strip() == str(site.root / "probes" / "__init__.py")
        assert "'encoder.blocks[0]'" not in outputs_of(nb.cells[1])[0]      # nn.Sequential names it 1.blocks[0]
        assert "['1.blocks']" in outputs_of(nb.cells[1])[0]              # the plain list: one finding at it

        text, htmls = outputs_of(nb.cells[2])
        (frame,) = htmls
        m = re.search(r'<iframe[^>]*\ssrc="(http://127\.0\.0\.1:(\d+)/)"', frame)
        assert m, frame
        url = m.group(1)
        assert f"modscope dashboard: {url}" in text                        # the fallback for other front ends
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200
            # a notebook on this machine may frame it (a foreign site may not: tests/dashboard/test_security.py)
            assert "http://localhost:*" in resp.headers["Content-Security-Policy"]
        text, htmls = outputs_of(nb.cells[3])
        assert text.splitlines() == [f"modscope dashboard: {url}", "True False False"]   # one server, no Dash here
        assert len(htmls) == 1 and url in htmls[0]                                        # shown again
        nbformat.write(nb, str(tmp_path / "executed.ipynb"))
    # the kernel exited: its dashboard stopped with it
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
        except urllib.error.URLError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"{url} still answers after the kernel exited")


NOTEBOOK_PAGE = ('<!DOCTYPE html><html><body><iframe id="nb" width="1200" height="700" src="{url}">'
                 '</iframe></body></html>')


@pytest.mark.browser
def test_a_page_on_this_machine_can_frame_the_dashboard_and_another_site_cannot(server_factory, tmp_path):
    """In Chromium: a page served from localhost (as Jupyter serves a notebook) shows the framed
    dashboard, its callbacks working; the same page from another site name is refused (CSP
    frame-ancestors), with the browser's own console line."""
    from selenium.webdriver.common.by import By

    synth_store.demo(tmp_path / "run" / "modscope.sqlite", steps=5)
    srv = server_factory(["serve", "--snapshot", str(tmp_path / "run" / "modscope.sqlite")])
    body = NOTEBOOK_PAGE.format(url=srv.url).encode()

    class NotebookPage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotebookPage)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    driver, profile = start_chrome("--host-resolver-rules=MAP elsewhere.test 127.0.0.1")

    def framed_text(d):
        d.switch_to.default_content()
        d.switch_to.frame(d.find_element(By.ID, "nb"))
        try:
            return d.find_element(By.TAG_NAME, "body").text
        finally:
            d.switch_to.default_content()
    try:
        driver.get(f"http://localhost:{port}/")
        # "Findings" with its count comes from a callback: the framed app runs, its POSTs are accepted
        wait_for(driver, lambda d: "SNAPSHOT" in framed_text(d) and "Findings" in framed_text(d),
                 "the dashboard inside the frame")
        driver.get_log("browser")
        driver.get(f"http://elsewhere.test:{port}/")
        wait_for(driver, lambda d: any("frame-ancestors" in e["message"] for e in d.get_log("browser")),
                 "Chromium refusing the frame")
        assert "SNAPSHOT" not in framed_text(driver)
    finally:
        driver.quit()
        httpd.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
