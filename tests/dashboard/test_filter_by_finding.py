"""Filtering the module tree by a finding is one indexed query: the findings of that code are read once through
the key's (rank, code) prefix, and each module is looked up in them. The query that ran per module (a correlated
subquery, every finding of the code scanned for every module: 2.6 s at 10,000 modules x 3,000 findings) is gone.
The time itself is a benchmark's, not a test's (docs/benchmarks.md); here, the plan and the results."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from bench import synth_store
from dashboard.read.store import Store


def store_with_findings(path: Path) -> tuple[Store, dict[str, set[int]]]:
    st = synth_store.big(path, n_modules=400, steps=1, fanout=8, findings_every=10**9, keep_open=True)
    active: dict[str, set[int]] = {"dead-units": set(), "saturated": set()}
    for m in st.modules[1:]:
        mid = m["module_id"]
        if mid % 3 == 0:
            st.add_finding("dead-units", m["path"], "warning", mid, "dead", active=int(mid % 9 != 0))
            if mid % 9 != 0:
                active["dead-units"].add(mid)
        if mid % 5 == 0:
            st.add_finding("saturated", m["path"], "warning", mid, "saturated")
            active["saturated"].add(mid)
    st.add_finding("dead-units", "not.a.module", "warning", None, "no module")       # drawn on no module
    st.close()
    return Store(path, live=False), active


def test_the_filter_finds_the_modules_with_an_active_finding_of_the_code(tmp_path):
    store, active = store_with_findings(tmp_path / "modscope.sqlite")
    for code, ids in active.items():
        res = store.search_modules(0, "", code, limit=1000)
        assert {m["module_id"] for m in res["items"]} == ids and not res["truncated"]
    text = store.search_modules(0, "layers.3", "dead-units", limit=1000)["items"]
    assert text and all("layers.3" in m["path"] and m["module_id"] in active["dead-units"] for m in text)
    assert store.search_modules(0, "", "dead-layer")["items"] == []


def test_it_is_one_query_through_the_findings_key(tmp_path):
    path = tmp_path / "modscope.sqlite"
    store, _ = store_with_findings(path)
    ran: list[str] = []
    assert store.ready()
    store._conn().set_trace_callback(ran.append)
    store.search_modules(0, "", "dead-units")
    store._conn().set_trace_callback(None)
    (sql,) = [q for q in ran if "FROM modules m" in q]
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql)]
    assert not any("CORRELATED" in step for step in plan), plan            # nothing run again per module
    assert any(step.startswith("SEARCH f USING INDEX") and "(rank=? AND code=?)" in step for step in plan), plan
    assert not any(step.startswith("SCAN f") for step in plan), plan
