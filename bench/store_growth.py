"""Store growth: bytes per sampled module-step and per tensor-step, the size of a 1,000,000-step run of a
1,000-module model once thinned, and the dashboard's first render on it.

    python -m bench.store_growth                       # ~3 minutes
    python -m bench.store_growth --interval 1          # the worst case: every step sampled

1. A real store: ``probes.watch(every=1)`` on a model of 1,000 modules (333 residual blocks, see
   bench/many_modules.py) for 40 steps; the bytes of each table and index (SQLite's dbstat) per row.
2. A simulated 1,000,000-step run: the store a run of that length keeps, built directly in the state the
   writer's thinning leaves it in (the last THIN_RECENT sampled steps, the first sampled step of each of
   about THIN_OLD older buckets, up to THIN_EVERY not yet thinned; the loss rows likewise), every row
   copied from the real store's last sampled step. ``--interval`` is the sampling interval of that run.
3. The dashboard (``python app.py --snapshot``) on it, in real headless Chromium: the first render of the
   overview and of the module tree.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

import probes
from bench.browser import free_port, make_driver, until
from bench.dashboard_scale import q
from bench.many_modules import make, one_step
from probes.store import session

REPO = Path(__file__).resolve().parent.parent


def real_store(workdir: Path) -> Path:
    model, opt, x, y = make(333)
    with probes.watch(model, opt, run_dir=workdir / "real", every=1) as w:
        for _ in range(40):
            one_step(model, opt, x, y, w)
    return Path(w.store_path)


def table_bytes(path: Path) -> dict[str, int]:
    con = sqlite3.connect(path)
    try:
        return dict(con.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall())
    finally:
        con.close()


def retained_steps(total_steps: int, interval: int) -> tuple[list[int], list[int]]:
    """The sampled steps and the loss-only step rows a run of ``total_steps`` keeps after thinning."""
    sampled = list(range(0, total_steps, interval))
    pending = len(sampled) % session.THIN_EVERY                   # sampled since the last thinning pass
    done = sampled[:len(sampled) - pending]
    if len(done) >= session.THIN_RECENT:
        cutoff = done[-session.THIN_RECENT]
        bucket = max(1, -(-cutoff // session.THIN_OLD))
        old = sorted({s // bucket: s for s in reversed([s for s in done if s < cutoff])}.values())
        kept = old + [s for s in sampled if s >= cutoff]
        last_cutoff = cutoff
    else:
        kept, last_cutoff, bucket = sampled, 0, 1
    kept_set = set(kept)
    plain_old = sorted({s // bucket: s for s in reversed(range(last_cutoff)) if s not in kept_set}.values())
    plain = plain_old + [s for s in range(last_cutoff, total_steps) if s % interval]
    return kept, plain


def simulated_store(template: Path, dest: Path, total_steps: int, interval: int) -> tuple[int, int]:
    probes.schema.snapshot([template], dest)
    con = sqlite3.connect(dest, isolation_level=None)
    last = con.execute("SELECT MAX(step) FROM module_stats").fetchone()[0]
    mrows = con.execute("SELECT * FROM module_stats WHERE step = ?", (last,)).fetchall()
    prows = con.execute("SELECT * FROM param_stats WHERE step = ?", (last,)).fetchall()
    for t in ("module_stats", "param_stats", "steps"):
        con.execute(f"DELETE FROM {t}")
    kept, plain = retained_steps(total_steps, interval)
    now = time.time()
    con.execute("BEGIN")
    for step in kept:
        con.executemany(f"INSERT INTO module_stats VALUES ({','.join('?' * len(mrows[0]))})",
                        [(r[0], r[1], step, *r[3:]) for r in mrows])
        con.executemany(f"INSERT INTO param_stats VALUES ({','.join('?' * len(prows[0]))})",
                        [(r[0], r[1], step, *r[3:]) for r in prows])
    con.executemany("INSERT INTO steps (rank, step, wall_time, loss, step_ms, probe_ms, sampled) "
                    "VALUES (0, ?, ?, ?, 30.0, ?, ?)",
                    [(s, now, 2.0 / (1 + s / 1e5), 3.0 if smp else 0.01, smp)
                     for s, smp in sorted([(s, 1) for s in kept] + [(s, 0) for s in plain])])
    con.execute("UPDATE ranks SET step = ?, status = 'closed'", (total_steps - 1,))
    con.execute("COMMIT")
    con.execute("VACUUM")
    con.close()
    return len(kept), len(plain)


def first_render(snapshot: Path) -> dict[str, float]:
    port = free_port()
    server = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--snapshot", str(snapshot), "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the dashboard did not start") from None
                time.sleep(0.2)
        driver = make_driver()
        try:
            out = {}
            for name, path, ready in (("overview", "", q("#ov-cards .card")),
                                      ("modules", "modules", q(".tree-row[data-path='blocks']"))):
                driver.get("about:blank")
                t0 = time.perf_counter()
                driver.get(url + path)
                until(driver, ready)
                out[f"{name}_first_render_s"] = time.perf_counter() - t0
            return out
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(15)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000, help="length of the simulated run")
    ap.add_argument("--interval", type=int, default=32, help="its sampling interval (1: every step)")
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="modscope-growth-") as d:
        work = Path(d)
        real = real_store(work)
        con = sqlite3.connect(real)
        n_mod, n_ten = (con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("module_stats", "param_stats"))
        modules, tensors = (con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("modules", "params"))
        con.close()
        sizes = table_bytes(real)
        per_module = (sizes["module_stats"] + sizes["module_stats_by_step"]) / n_mod
        per_tensor = (sizes["param_stats"] + sizes["param_stats_by_step"]) / n_ten
        print(f"real store, {modules:,} modules, {tensors:,} tensors: {per_module:.0f} bytes per sampled "
              f"module-step, {per_tensor:.0f} bytes per sampled tensor-step (tables and their step index)")
        sim = work / "simulated.sqlite"
        kept, plain = simulated_store(real, sim, args.steps, args.interval)
        size_mb = os.path.getsize(sim) / 1e6
        print(f"simulated {args.steps:,}-step run (interval {args.interval}): {kept:,} sampled and {plain:,} "
              f"loss-only steps kept -> {size_mb:.0f} MB (target < 500 MB)")
        render = first_render(sim)
        print("dashboard on it: " + ", ".join(f"{k} {v:.2f} s" for k, v in render.items()))
        if args.json:
            Path(args.json).write_text(json.dumps({
                "bytes_per_module_step": per_module, "bytes_per_tensor_step": per_tensor, "modules": modules,
                "tensors": tensors, "steps": args.steps, "interval": args.interval, "kept_sampled": kept,
                "kept_plain": plain, "size_mb": size_mb, **render}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
