"""Filtering the module tree by a finding: the query the Modules page runs (``Store.search_modules(code=...)``)
side by side with the correlated form it replaced, on a 10,000-module tree with a finding on every third module.

    python -m bench.filter_by_finding              # a few seconds

Prints the median time of each form over a few runs, and their ratio.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench import synth_store
from dashboard.read.store import MAX_SEARCH, Store

# the form search_modules had: EXISTS per module, which read every finding of the code for every module
CORRELATED = ("SELECT m.module_id FROM modules m WHERE m.rank = ? AND EXISTS (SELECT 1 FROM findings f "
              "WHERE f.rank = m.rank AND f.module_id = m.module_id AND f.code = ? AND f.active = 1) "
              "ORDER BY m.removed_step IS NULL DESC, m.depth, m.module_id LIMIT ?")


def build(path: Path, modules: int = 10_000) -> int:
    st = synth_store.big(path, n_modules=modules, steps=0, findings_every=10**9, keep_open=True)
    rows = [(m["path"], m["module_id"]) for m in st.modules[1::3]]
    st.conn.executemany("INSERT INTO findings (rank, code, path, severity, module_id, message, fix, evidence, "
                        "first_step, last_step, active, count) VALUES (0, 'dead-units', ?, 'warning', ?, 'm', 'f', "
                        "'{}', 0, 0, 1, 1)", rows)
    st.commit()
    st.close()
    return len(rows)


def median_s(fn: object, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "modscope.sqlite"
        findings = build(path)
        store = Store(path, live=False)
        assert store.ready()
        conn = store._conn()
        now = median_s(lambda: store.search_modules(0, "", "dead-units", MAX_SEARCH))
        before = median_s(lambda: conn.execute(CORRELATED, (0, "dead-units", MAX_SEARCH + 1)).fetchall(), runs=3)
        print(f"10,000 modules x {findings:,} findings of the code: correlated {before * 1e3:,.1f} ms, "
              f"search_modules {now * 1e3:,.1f} ms, {before / now:,.0f}x")


if __name__ == "__main__":
    main()
