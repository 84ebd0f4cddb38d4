"""Make the README's and the docs' screenshots from real runs: ``python docs/make_images.py [--work DIR]``.

It trains, in a fresh temporary folder, the demo classifier (its encoder's plain-list bug), the same model fixed,
and a 6-layer tanh MLP; serves the dashboard on each (paths relative to that folder, so that no temporary path
shows) and takes one screenshot per page with headless Chromium (Debian's ``chromium`` and ``chromium-driver``):
docs/img/overview.png, modules.png, layers.png, findings.png and compare.png. Needs torch, selenium and Chromium.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.browser import CHROMEDRIVER, chrome_options, free_port, stop_process  # noqa: E402

IMG = REPO / "docs" / "img"
SIZE = (1400, 900)
WAIT_S = 60

MLP = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    import probes

    torch.manual_seed(0)
    dims = [32] + [256] * 5 + [10]
    layers = []
    for i in range(6):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < 5:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(512, 32), torch.randint(0, 10, (512,))
    with probes.watch(model, opt, run_dir=sys.argv[1], every=4, run_name="tanh-mlp") as w:
        for step in range(200):
            i = (step % 4) * 128
            loss = nn.functional.cross_entropy(model(x[i:i + 128]), y[i:i + 128])
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
""")


def train(work: Path) -> None:
    env_path = {"PYTHONPATH": str(REPO)}
    demo = [sys.executable, str(REPO / "examples" / "demo_train.py"), "--steps", "300", "--every", "5"]
    for args in (["--run-dir", "runs/demo"], ["--run-dir", "runs/demo-fixed", "--fixed"]):
        subprocess.run([*demo, *args], cwd=work, check=True, stdout=subprocess.DEVNULL, timeout=600)
    (work / "mlp.py").write_text(MLP)
    subprocess.run([sys.executable, "mlp.py", "runs/tanh-mlp"], cwd=work, check=True, timeout=600,
                   env={**__import__("os").environ, **env_path})


def serve(work: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), *args, "--port", str(port)], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    import urllib.request
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.3)
    stop_process(proc)
    raise RuntimeError(f"the dashboard did not start: {args}")


def wait(driver, script: str, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if driver.execute_script(script):
                time.sleep(0.8)          # let plotly finish drawing
                return
        except Exception:          # an element re-rendered between two looks
            pass
        time.sleep(0.2)
    raise RuntimeError(f"waited {WAIT_S} s for {what}")


def shoot(driver, name: str) -> None:
    path = IMG / f"{name}.png"
    driver.save_screenshot(str(path))
    print(f"wrote {path.relative_to(REPO)}")


def pages(driver, url: str, mlp_url: str, compare_url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(url)
    wait(driver, "return document.querySelector('#ov-loss .scatterlayer .trace') &&"
                 " document.querySelector('#ov-top-findings .top-finding');", "the Overview")
    shoot(driver, "overview")
    driver.get(url + "modules")
    wait(driver, "return document.querySelector(\".tree-row[data-path='encoder.blocks[1]']\");", "the tree")
    driver.find_element(By.CSS_SELECTOR, ".tree-row[data-path='encoder.blocks[1]'] .tree-label").click()
    wait(driver, "return document.querySelector('#detail-activation .scatterlayer .trace') &&"
                 " document.querySelector('#detail-heat .heatmaplayer *');", "the module's charts")
    shoot(driver, "modules")
    driver.get(url + "findings")
    wait(driver, "return document.querySelector('#findings-list .finding');", "the findings")
    driver.find_element(By.CSS_SELECTOR, "#findings-list > .finding details.consequences > summary").click()
    time.sleep(0.5)
    shoot(driver, "findings")
    driver.get(mlp_url + "layers")
    wait(driver, "const g = document.querySelector('#layers-heat .js-plotly-plot');"
                 "return g && g.data && g.data.length && g.data[0].x.length > 10;", "the Layers page")
    driver.find_element(By.CSS_SELECTOR, "#layers-metric").click()
    wait(driver, "return [...document.querySelectorAll('[role=option]')]"
                 ".some(e => e.textContent.startsWith('update-to-data ratio'));", "the metric's options")
    option = next(el for el in driver.find_elements(By.CSS_SELECTOR, "[role=option]")
                  if el.text.startswith("update-to-data ratio"))
    option.click()
    wait(driver, "const g = document.querySelector('#layers-lines .js-plotly-plot');"
                 "return g && g.layout && g.layout.shapes && g.layout.shapes.length;", "the update ratio's guide")
    shoot(driver, "layers")
    driver.get(compare_url)
    wait(driver, "return document.querySelector('#cmp-summary table');", "the Compare page")
    shoot(driver, "compare")


def main(argv: list[str]) -> int:
    """``--work DIR``: train in DIR (once: its runs are used again), not in a temporary folder."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    IMG.mkdir(parents=True, exist_ok=True)
    keep = Path(argv[argv.index("--work") + 1]).resolve() if "--work" in argv else None
    with tempfile.TemporaryDirectory(prefix="modscope-images-") as tmp:
        work = keep or Path(tmp)
        if keep is None or not (keep / "runs" / "tanh-mlp").is_dir():
            work.mkdir(parents=True, exist_ok=True)
            train(work)
        servers = [serve(work, "serve", "--run", "runs/demo"), serve(work, "serve", "--run", "runs/tanh-mlp"),
                   serve(work, "serve", "--compare", "runs/demo", "runs/demo-fixed")]
        profile = tempfile.mkdtemp(prefix="modscope-chrome-")
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=chrome_options(profile=profile))
        try:
            driver.set_window_size(*SIZE)
            pages(driver, servers[0][1], servers[1][1], servers[2][1])
        finally:
            driver.quit()
            for proc, _ in servers:
                stop_process(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
