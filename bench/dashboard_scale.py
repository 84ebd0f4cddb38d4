"""Dashboard scale benchmark (issue "Overhead and scale v1", dashboard side).

Generates a synthetic store (10,000 modules, 10,000 steps, findings spread over the tree),
starts the real dashboard on it (``python app.py --run DIR``, live mode, polling) and
measures in a real headless Chromium:

  * time to first render of the overview and of the module tree,
  * expanding a node, filtering the tree by name, opening a module's detail (p50/p95),
  * the live-update round trip: a sample written to the store -> visible in the page,
  * the dashboard process's peak RSS.

    python -m bench.dashboard_scale                       # defaults below, ~2 minutes
    python -m bench.dashboard_scale --modules 2000 --steps 2000 --repeat 5 --json out.json

Store shape: every step has a loss row; every module has statistics every ``--stride``
steps (a thinned history); ``--hot`` modules (along one branch of the tree) have statistics
and activation histograms at every step, so their detail charts read 10,000 samples.
Targets: first render <= 2 s, each interaction p95 <= 200 ms, live update <= 2 s, RSS <= 500 MB.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from bench import synth_store  # writes with the schema's DDL
from bench.browser import DashboardProcess, RSSSampler, load_seconds, make_driver, until

TARGETS = {"first_render_s": 2.0, "interaction_p95_ms": 200.0, "live_update_s": 2.0, "rss_mb": 500.0}


# -- the store ------------------------------------------------------------------------------------
def build_store(path: Path, n_modules: int, n_steps: int, stride: int, n_hot: int) -> tuple:
    t0 = time.perf_counter()
    st = synth_store.big(path, n_modules=n_modules, steps=0, fanout=10, findings_every=97, hist=False,
                         keep_open=True)
    conn = st.conn
    now = time.time()
    conn.executemany("INSERT INTO steps (rank, step, wall_time, loss, step_ms, probe_ms, sampled) "
                     "VALUES (0, ?, ?, ?, 3.0, 0.02, 1)",
                     ((s, now, 2.0 * math.exp(-s / (n_steps / 3)) + 0.05) for s in range(n_steps)))
    # the hot branch: layers.0, layers.0.layers.0, ... (the first child at every level)
    hot = [0]
    while len(hot) < n_hot:
        row = conn.execute("SELECT module_id FROM modules WHERE rank = 0 AND parent_id = ? ORDER BY module_id "
                           "LIMIT 1", (hot[-1],)).fetchone()
        if row is None:
            break
        hot.append(row[0])
    hot_set = set(hot)
    hists = st._hists[True]

    def rows():
        for mid in range(n_modules):
            every = 1 if mid in hot_set else stride
            for s in range(0, n_steps, every):
                scale = 0.5 + 0.3 * math.sin(s / 150 + mid)
                yield (0, mid, s, 1, 64, scale * 0.4, scale, scale * 3, 0.05, 0.05, 0.0, 0,
                       0.01 / (1 + s) ** 0.5, 1, 1, hists[(s // 50 + mid) % 12] if mid in hot_set else None)
    batch = []
    for r in rows():
        batch.append(r)
        if len(batch) >= 200_000:
            conn.executemany("INSERT INTO module_stats VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             batch)
            batch.clear()
    if batch:
        conn.executemany("INSERT INTO module_stats VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", batch)
    conn.execute("UPDATE ranks SET step = ?, samples_written = ? WHERE rank = 0", (n_steps - 1, n_steps))
    conn.commit()
    st.step = n_steps - 1
    n_stats = conn.execute("SELECT COUNT(*) FROM module_stats").fetchone()[0]
    return st, hot, n_stats, time.perf_counter() - t0


# -- the browser ----------------------------------------------------------------------------------
def q(css: str) -> str:
    return f"document.querySelector({json.dumps(css)})"


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]


class Store(NamedTuple):
    """The synthetic store the dashboard reads, kept open for the live-update phase."""
    run_dir: Path
    writer: synth_store.SynthStore
    hot: list[int]          # module ids sampled at every step (one branch of the tree)
    n_stats: int
    size_mb: float


class FilterTimes(NamedTuple):
    from_first_key: list[float]     # seconds, typing included
    from_enter: list[float]         # seconds, from the Enter key


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--stride", type=int, default=100, help="steps between samples of ordinary modules")
    ap.add_argument("--hot", type=int, default=4, help="modules sampled at every step (one branch)")
    ap.add_argument("--repeat", type=int, default=10, help="repetitions of each interaction")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--keep", help="write the store here (kept) instead of a temporary directory")
    return ap.parse_args(argv)


def prepare_store(args: argparse.Namespace) -> Store:
    run_dir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="modscope-scale-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    store_path = run_dir / "modscope.sqlite"
    if store_path.exists():
        for suffix in ("", "-wal", "-shm"):
            Path(str(store_path) + suffix).unlink(missing_ok=True)
    print(f"building store: {args.modules:,} modules, {args.steps:,} steps ...", flush=True)
    writer, hot, n_stats, build_s = build_store(store_path, args.modules, args.steps, args.stride, args.hot)
    size_mb = store_path.stat().st_size / 2**20
    print(f"  {n_stats:,} module_stats rows, {size_mb:.0f} MB, built in {build_s:.1f} s", flush=True)
    return Store(run_dir, writer, hot, n_stats, size_mb)


def measure_first_render(driver: Any, url: str, results: dict[str, Any]) -> None:
    """First render: overview (cards + loss curve), then the tree. The very first page load of a freshly
    started Chromium also pays for the browser's own start-up (new renderer process, first JS compile); it is
    reported, and the target is checked on a page load with the HTTP cache cleared (all scripts fetched and
    compiled again)."""
    overview_ready = (f"{q('#ov-cards')} && {q('#ov-cards')}.innerText.includes('BigModel')"
                      f" && {q('#ov-loss .scatterlayer .trace')}")

    def load(page: str, ready: str, cold: bool) -> float:
        return load_seconds(driver, url + page, ready, cold)

    results["overview_first_render_fresh_browser_s"] = load("", overview_ready, cold=False)
    results["overview_first_render_s"] = load("", overview_ready, cold=True)
    results["tree_first_render_s"] = load("modules", q(".tree-row[data-path='layers.0']"), cold=True)
    results["tree_rows_rendered"] = driver.execute_script("return document.querySelectorAll('.tree-row').length")


def measure_expand(driver: Any, repeat: int) -> list[float]:
    """Seconds to expand a node (each collapsed again afterwards)."""
    expand = []
    for i in range(repeat):
        path = f"layers.{i % 10}"
        child = f"{path}.layers.9"
        toggle = q(f".tree-row[data-path={json.dumps(path)}] .tree-toggle")
        if driver.execute_script(f"return {toggle}.textContent") == "▾":   # opened by default: close first
            driver.execute_script(f"{toggle}.click()")
            until(driver, f"!{q(f'.tree-row[data-path={json.dumps(child)}]')}")
        driver.execute_script(f"{toggle}.click()")
        expand.append(until(driver, q(f".tree-row[data-path={json.dumps(child)}]")))
        driver.execute_script(f"{toggle}.click()")
        until(driver, f"!{q(f'.tree-row[data-path={json.dumps(child)}]')}")
    return expand


def measure_filter(driver: Any, repeat: int) -> FilterTimes:
    """Filtering the tree by name (type + Enter), then clearing the filter."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    filt, filt_enter = [], []    # from the first key typed / from Enter
    for i in range(repeat):
        text = f"layers.{i % 10}.layers.{(i * 3) % 10}.layers"
        box = driver.find_element(By.ID, "tree-search")
        box.send_keys(Keys.CONTROL, "a")
        t0 = time.perf_counter()
        box.send_keys(text)      # (typing through WebDriver: one round trip per key)
        t1 = time.perf_counter()
        box.send_keys(Keys.ENTER)
        until(driver, f"{q('#tree-info')}.innerText.includes('match') && "
                      f"{q('.tree-row .tree-label')}.innerText.startsWith({json.dumps(text)})")
        filt.append(time.perf_counter() - t0)
        filt_enter.append(time.perf_counter() - t1)
    box = driver.find_element(By.ID, "tree-search")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE, Keys.ENTER)
    until(driver, q(".tree-row[data-path='layers.0']"))
    return FilterTimes(filt, filt_enter)


def hot_paths_of(store: Store) -> list[str]:
    hot = store.hot
    return [p for (p,) in store.writer.conn.execute(
        f"SELECT path FROM modules WHERE module_id IN ({','.join('?' * len(hot))}) ORDER BY depth", hot)]


def measure_detail(driver: Any, hot_path: str, repeat: int) -> list[float]:
    """Seconds to open a module's detail, alternating between a hot module (every step sampled) and
    ordinary ones."""
    toggle0 = q(".tree-row[data-path='layers.0'] .tree-toggle")
    if driver.execute_script(f"return {toggle0}.textContent") == "▸":
        driver.execute_script(f"{toggle0}.click()")
    until(driver, q(".tree-row[data-path='layers.0.layers.9']"))
    candidates = [hot_path] + [f"layers.0.layers.{i}" for i in range(1, 10)]
    detail = []
    for i in range(repeat):
        path = candidates[i % len(candidates)]
        sel = f".tree-row[data-path={json.dumps(path)}] .tree-label"
        t0 = time.perf_counter()
        driver.execute_script(f"{q(sel)}.click()")
        until(driver, f"{q('#detail-header h2')} && {q('#detail-header h2')}.innerText === {json.dumps(path)}"
                      f" && {q('#detail-activation .scatterlayer .trace')}"
                      f" && document.querySelector('#detail-activation .js-plotly-plot').data[0].x.length > 0")
        detail.append(time.perf_counter() - t0)
    return detail


def measure_live_update(driver: Any, store: Store, hot_path: str, repeat: int) -> list[float]:
    """The live-update round trip: one step written (loss + the open module's sample) -> the header shows it."""
    driver.execute_script(f"{q(f'.tree-row[data-path={json.dumps(hot_path)}] .tree-label')}.click()")
    until(driver, f"{q('#detail-header h2')}.innerText === {json.dumps(hot_path)}")
    writer = store.writer
    live = []
    for _ in range(repeat):
        step = writer.step + 1
        time.sleep(0.37)   # de-phase from the 1 s polling interval
        t0 = time.perf_counter()
        writer.add_steps(1, modules=store.hot[:2])
        until(driver, f"{q('#run-status')}.innerText.includes('step {step} ')"
                      f" || {q('#run-status')}.innerText.endsWith('step {step}')")
        live.append(time.perf_counter() - t0)
    return live


def measure_dashboard(store: Store, repeat: int, results: dict[str, Any]) -> None:
    """Every browser phase against the real dashboard process, and its peak RSS, into ``results``."""
    server = DashboardProcess(store.run_dir, store.run_dir / "dashboard.log")
    url = server.url
    rss = RSSSampler(server.pid)
    rss.start()
    driver = make_driver()
    try:
        measure_first_render(driver, url, results)
        expand = measure_expand(driver, repeat)
        filt = measure_filter(driver, repeat)
        hot_path = hot_paths_of(store)[1]
        detail = measure_detail(driver, hot_path, repeat)
        results["expand_ms"] = [round(x * 1000, 1) for x in expand]
        results["filter_ms"] = [round(x * 1000, 1) for x in filt.from_first_key]
        results["filter_from_enter_ms"] = [round(x * 1000, 1) for x in filt.from_enter]
        results["detail_ms"] = [round(x * 1000, 1) for x in detail]
        live = measure_live_update(driver, store, hot_path, repeat)
        results["live_update_s"] = [round(x, 3) for x in live]
        time.sleep(1.5)
        results["detail_points_after_live"] = driver.execute_script(
            "return document.querySelector('#detail-activation .js-plotly-plot').data[0].x.length")
    finally:
        driver.quit()
        rss.stop.set()
        rss.join(1)
        server.stop()
        store.writer.close()
    results["dashboard_peak_rss_mb"] = round(rss.peak / 2**20, 1)


def summarize(results: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Each measure against its target: name -> (value, target)."""
    return {
        "overview first render (s)": (results["overview_first_render_s"], TARGETS["first_render_s"]),
        "tree first render (s)": (results["tree_first_render_s"], TARGETS["first_render_s"]),
        "expand node p95 (ms)": (pct(results["expand_ms"], 95), TARGETS["interaction_p95_ms"]),
        "filter by name p95 (ms)": (pct(results["filter_ms"], 95), TARGETS["interaction_p95_ms"]),
        "open module detail p95 (ms)": (pct(results["detail_ms"], 95), TARGETS["interaction_p95_ms"]),
        "live update p95 (s)": (pct(results["live_update_s"], 95), TARGETS["live_update_s"]),
        "dashboard peak RSS (MB)": (results["dashboard_peak_rss_mb"], TARGETS["rss_mb"]),
    }


def print_table(args: argparse.Namespace, store: Store, results: dict[str, Any],
                summary: dict[str, tuple[float, float]]) -> None:
    print(f"\nstore: {args.modules:,} modules, {args.steps:,} steps, {store.n_stats:,} module_stats rows, "
          f"{store.size_mb:.0f} MB; tree rows rendered at first view: {results['tree_rows_rendered']}")
    print(f"{'measure':32s} {'value':>10s} {'target':>10s}  ok")
    for name, (value, target) in summary.items():
        print(f"{name:32s} {value:10.3f} {target:10.3f}  {'yes' if value <= target else 'NO'}")
    fresh = results['overview_first_render_fresh_browser_s']
    print(f"overview first render in a freshly started browser: {fresh:.2f} s")
    print(f"medians: expand {statistics.median(results['expand_ms']):.0f} ms, filter "
          f"{statistics.median(results['filter_ms']):.0f} ms, detail {statistics.median(results['detail_ms']):.0f} ms, "
          f"live {statistics.median(results['live_update_s']):.2f} s")
    fe = results["filter_from_enter_ms"]
    print(f"filter by name timed from Enter (without the typing): p95 {pct(fe, 95):.0f} ms, "
          f"median {statistics.median(fe):.0f} ms")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    store = prepare_store(args)
    results: dict[str, Any] = {"modules": args.modules, "steps": args.steps, "module_stats_rows": store.n_stats,
                     "store_mb": round(store.size_mb, 1)}
    measure_dashboard(store, args.repeat, results)
    summary = summarize(results)
    print_table(args, store, results, summary)
    results["summary"] = {k: {"value": v, "target": t, "ok": v <= t} for k, (v, t) in summary.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(v <= t for v, t in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
