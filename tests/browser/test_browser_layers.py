"""Browser tests of how a run's layers train and how its findings are counted: the Layers page of a real
200-step run of a 6-layer tanh MLP (one heat-map row per layer, a column per stored step, hover, a click that
opens the module, the module's parameter history), a finished run said plainly, and one count of findings in
the summary of ``modscope run``, ``modscope findings``, the Overview, the Findings page and the report."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import tanh_mlp
from browser_helpers import REPO, click, demo_available, screenshot, wait_for, wait_text
from selenium.webdriver.common.by import By

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not demo_available(), reason="needs torch, probes and examples/demo_train.py")]

HEAT = "document.querySelector('#layers-heat .js-plotly-plot')"


def heat_shape(driver) -> tuple[int, int]:
    """(rows, columns) of the heat map as drawn."""
    return tuple(driver.execute_script(
        f"const g = {HEAT}; return g && g.data && g.data.length ? [g.data[0].y.length, g.data[0].x.length] : [0, 0];"))


def mouse_on_cell(driver, cell: tuple[int, int], shape: tuple[int, int], kinds: tuple[str, ...]) -> None:
    """Real mouse events (as a user's: plotly tells them from scripted ones) on heat-map cell (row, column) of
    a map of ``shape`` (rows, columns)."""
    area = driver.find_element(By.CSS_SELECTOR, "#layers-heat .nsewdrag")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", area)
    left, top, width, height = driver.execute_script(
        "const b = arguments[0].getBoundingClientRect(); return [b.left, b.top, b.width, b.height];", area)
    x, y = left + width * (cell[1] + 0.5) / shape[1], top + height * (cell[0] + 0.5) / shape[0]
    for kind in kinds:
        driver.execute_cdp_cmd("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left",
                                                            "clickCount": 1})


def test_layers_page_of_a_finished_mlp_run(page, server_factory, tmp_path_factory):
    mlp = tanh_mlp.shared_run(tmp_path_factory)
    srv = server_factory(["--run", str(mlp.run_dir)])
    page.get(srv.url + "layers")
    # a finished run says so: no live badge
    wait_text(page, "finished", "#run-status")
    assert page.find_element(By.ID, "mode-badge").text.lower() == "finished"
    assert not page.find_elements(By.CSS_SELECTOR, ".mode-live")

    shape = wait_for(page, lambda d: (s := heat_shape(d))[0] and s, "the heat map")
    assert shape[0] == len(mlp.layer_paths) == 6 and shape[1] >= 40, shape      # a row per layer, 40+ steps
    labels = page.execute_script(f"return {HEAT}.data[0].y;")
    assert labels == list(mlp.layer_paths)
    assert page.execute_script(f"return {HEAT}.data[0].x.slice(0, 3);") == [0, tanh_mlp.EVERY, 2 * tanh_mlp.EVERY]
    wait_for(page, lambda d: d.execute_script(
        "const g = document.querySelector('#layers-lines .js-plotly-plot'); return g && g.data.length;") == 6,
        "a line per layer")
    wait_text(page, "6 rows · 50 steps shown · 50 full samples", "#layers-info")
    # hover says layer, step and value
    mouse_on_cell(page, (2, 10), shape, ("mouseMoved",))
    hover = wait_for(page, lambda d: d.find_element(By.CSS_SELECTOR, "#layers-heat .hoverlayer").text,
                     "the hover label")
    assert "4" in hover and "step 40" in hover and "gradient norm" in hover, hover
    screenshot(page, "layers")

    # a click on a row opens that module on the Modules page, with each parameter's history
    # (as a user does: the pointer rests on the row, its label shows, then the click)
    mouse_on_cell(page, (3, 20), shape, ("mouseMoved",))
    wait_for(page, lambda d: "step 80" in d.find_element(By.CSS_SELECTOR, "#layers-heat .hoverlayer").text,
             "the hover label of row 3, step 80")
    mouse_on_cell(page, (3, 20), shape, ("mousePressed", "mouseReleased"))
    wait_for(page, lambda d: d.current_url.endswith("/modules"), "the Modules page")
    wait_for(page, lambda d: d.find_element(By.CSS_SELECTOR, "#detail-header h2").text == mlp.layer_paths[3],
             f"{mlp.layer_paths[3]} in the module's header")
    history = wait_for(page, lambda d: d.execute_script(
        "const g = document.querySelector('#detail-param-history .js-plotly-plot');"
        "return g && g.data && g.data.length ? g.data.map(t => [t.name, t.x.length]) : null;"),
        "the parameters' history")
    assert [name for name, _ in history] == ["weight", "weight", "bias", "bias"]
    assert all(n >= 40 for _, n in history), history                     # grad norm and update ratio over time


SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import torch.nn.functional as F
    from demo_train import Classifier, xor_data

    torch.manual_seed(0)
    X, y, _, _ = xor_data()
    model = Classifier()                      # its encoder keeps three layers in a plain list
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(12):
        loss = F.cross_entropy(model(X), y)
        opt.zero_grad(); loss.backward(); opt.step()
""")


def test_findings_are_counted_alike_everywhere(page, server_factory, tmp_path):
    """Root causes first, then "and N consequences": the same words from `modscope run`'s summary, `modscope
    findings`, the Overview, the Findings page and the HTML report."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    app = [sys.executable, str(REPO / "app.py")]
    r = subprocess.run([*app, "run", "--run-dir", str(run_dir), "--every", "1", str(script), str(REPO / "examples")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    summary = next(line for line in r.stderr.splitlines() if line.startswith("modscope: Classifier: "))
    counted = summary.removeprefix("modscope: Classifier: ").rsplit(" (modscope findings", 1)[0]
    assert counted.startswith("1 root cause (1 error) and ") and counted.endswith(" consequences"), counted
    cli = subprocess.run([*app, "findings", "--run", str(run_dir)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert cli.stdout.splitlines()[0] == f"{run_dir}: {counted}"
    report = tmp_path / "report.html"
    assert subprocess.run([*app, "export", "--run", str(run_dir), "-o", str(report)], capture_output=True,
                          timeout=120, check=False).returncode == 0
    assert f"<h2>Findings: {counted}</h2>" in report.read_text()

    srv = server_factory(["--run", str(run_dir)])
    page.get(srv.url)
    wait_for(page, lambda d: d.find_element(By.CSS_SELECTOR, "#ov-cards .findings-count").text == counted,
             f"the Overview's count: {counted}")
    click(page, ".nav-link", "Findings")
    wait_for(page, lambda d: d.find_element(By.CSS_SELECTOR, "#findings-list .findings-count").text == counted,
             f"the Findings page's count: {counted}")
    assert len(page.find_elements(By.CSS_SELECTOR, "#findings-list > .finding")) == 1       # one card: the list
