"""The Overview opened as a real training starts and left open through a long run stays readable (a real
headless Chromium against a real server, a real ``probes.watch`` loop in a child process):

* the loss chart, drawn at step 2 and extended by every poll up to step 319, has a linear step axis with a
  handful of tick labels that do not overlap: the same ticks as the chart loaded fresh at the end;
* the header names the run (``watch(run_name=...)``), not the run directory's absolute path (which stays in
  the name's tooltip)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time

import pytest
from browser_helpers import REPO, demo_available, screenshot, wait_for, wait_text
from selenium.webdriver.common.by import By

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not demo_available(), reason="needs torch and probes")]

STEPS = 320
RUN_NAME = "long-live-run"

# a tiny model, every step's loss stored; after 3 steps it waits for the file `go` (the page has drawn them)
TRAIN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import torch
    import probes

    run_dir, steps, go = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with probes.watch(model, opt, run_dir=run_dir, run_name={name!r}) as w:
        for step in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if step == 2:
                deadline = time.monotonic() + 120
                while not go.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(0.01)
""")

# the loss chart's x-axis tick labels as drawn: text and box
TICKS_JS = """
const g = document.getElementById('ov-loss');
return Array.from(g ? g.querySelectorAll('.xaxislayer-above .xtick text') : []).map(t => {
  const r = t.getBoundingClientRect();
  return {text: t.textContent, left: r.left, right: r.right, top: r.top, bottom: r.bottom};
});
"""
POINTS_JS = """
const g = document.querySelector('#ov-loss .js-plotly-plot');
return g && g.data && g.data.length ? g.data[0].x.length : 0;
"""


def header_step(driver) -> int:
    parts = driver.find_element(By.ID, "run-status").text.split()      # "step 12 · running"
    return int(parts[1]) if len(parts) > 1 and parts[0] == "step" and parts[1].isdigit() else -1


def loss_ticks(driver) -> list[dict]:
    return driver.execute_script(TICKS_JS)


def assert_readable(ticks: list[dict]) -> None:
    texts = [t["text"] for t in ticks]
    assert 2 <= len(ticks) <= 12, f"{len(ticks)} x-axis tick labels: {texts}"
    boxes = sorted(ticks, key=lambda t: t["left"])
    for a, b in itertools.pairwise(boxes):
        overlap = a["right"] > b["left"] and a["bottom"] > b["top"] and b["bottom"] > a["top"]
        assert not overlap, f"tick labels {a['text']!r} and {b['text']!r} overlap: {texts}"
    steps = [int(t.replace(",", "")) for t in texts]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), texts     # a linear axis, whole steps


def test_overview_left_open_through_a_long_live_run_stays_readable(page, server_factory, tmp_path):
    run_dir = tmp_path / "alice" / "experiments" / "exp-7"
    go = tmp_path / "go"
    script = tmp_path / "train_long.py"
    script.write_text(TRAIN.format(repo=str(REPO), name=RUN_NAME))
    srv = server_factory(["serve", "--run", str(run_dir), "--poll-ms", "250"])
    page.get(srv.url)                                               # open before the run starts
    wait_text(page, "waiting for the first sample", "#run-status")
    train = subprocess.Popen([sys.executable, str(script), str(run_dir), str(STEPS), str(go)], cwd=str(REPO),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(page, lambda d: d.execute_script(POINTS_JS) >= 1, "the loss chart drawn at the run's start", 120)
        first = page.execute_script(POINTS_JS)
        assert first <= 3, f"the chart was first drawn with {first} steps: not at the start"
        go.touch()
        wait_for(page, lambda d: header_step(d) >= 100, "step 100 shown", 120)
        assert page.execute_script(POINTS_JS) >= 50                 # extended by the live polls meanwhile
        _, err = train.communicate(timeout=180)
        assert train.returncode == 0, err.decode(errors="replace")
        wait_text(page, "finished", "#run-status")
        wait_for(page, lambda d: d.execute_script(POINTS_JS) == STEPS, f"{STEPS} steps in the loss chart")
        time.sleep(0.5)                                             # the last draw has settled
        live = loss_ticks(page)
        screenshot(page, "overview-long-live-run")
        assert_readable(live)

        # the header: the run's name, the absolute path only in its tooltip
        header = page.find_element(By.ID, "header")
        assert RUN_NAME in header.text
        assert str(tmp_path) not in header.text and "alice" not in header.text, header.text
        name = page.find_element(By.ID, "run-name")
        assert name.text == RUN_NAME and name.get_attribute("title") == str(run_dir)

        # the same axis as the chart loaded fresh
        page.refresh()
        wait_for(page, lambda d: d.execute_script(POINTS_JS) == STEPS, "the loss chart loaded fresh")
        time.sleep(0.5)
        assert [t["text"] for t in loss_ticks(page)] == [t["text"] for t in live]
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
