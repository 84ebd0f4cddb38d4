"""The data-access layer: plain-data functions behind every page, limits, errors."""

from __future__ import annotations

import sqlite3
import threading

import pytest

import synth_store
from dashboard.data import (SUPPORTED_SCHEMA_VERSION, QueryTimeout, Store, StoreError, StoreNotReady,
                            compare_stores, normalize_path)


@pytest.fixture
def before(tmp_path):
    synth_store.demo(tmp_path / "before" / "modscope.sqlite", steps=30)
    return Store.open_run(tmp_path / "before")


@pytest.fixture
def after(tmp_path):
    synth_store.demo(tmp_path / "after" / "modscope.sqlite", steps=30, fixed=True)
    return Store.open_run(tmp_path / "after")


def test_overview(before):
    ov = before.overview()
    assert ov["run_name"] == "demo" and ov["model_class"] == "Classifier"
    assert ov["step"] == 29 and ov["steps_recorded"] == 30 and ov["samples_stored"] == 30
    assert ov["findings"] == {"error": 6, "warning": 0, "info": 0}
    assert ov["modules"] == {"registered": 4, "unregistered": 3, "runtime": 0}
    assert ov["params"]["total"] == 82 and ov["params"]["unregistered"] == 816
    assert ov["overhead"] == pytest.approx(0.004)


def test_tree_is_lazy_and_marks_unregistered(before):
    root = before.root()
    top = before.children(0, root["module_id"])
    assert [m["path"] for m in top["items"]] == ["stem", "encoder", "head"] and top["more"] == 0
    enc = before.module_by_path(0, "encoder")
    blocks = before.children(0, enc["module_id"])["items"]
    assert [(m["name"], m["kind"]) for m in blocks] == [(f"blocks[{i}]", "unregistered") for i in range(3)]
    # the first view opens the root and the encoder (where the errors are)
    assert before.default_expanded() == [root["module_id"], enc["module_id"]]
    inside = before.subtree_finding_counts()
    assert inside[enc["module_id"]] == {"error": 6}
    assert before.ancestors(0, blocks[0]["module_id"]) == [root["module_id"], enc["module_id"]]


def test_children_limit_reports_the_rest(tmp_path):
    synth_store.big(tmp_path / "modscope.sqlite", n_modules=60, steps=0, fanout=50)
    s = Store.open_snapshot(tmp_path / "modscope.sqlite")
    res = s.children(0, 0, limit=20)
    assert len(res["items"]) == 20 and res["more"] == 30


def test_search_and_filter(before):
    assert [m["path"] for m in before.search_modules(0, "BLOCKS")["items"]] == \
        [f"encoder.blocks[{i}]" for i in range(3)]
    assert [m["path"] for m in before.search_modules(0, "encoder")["items"]][0] == "encoder"
    assert len(before.search_modules(0, "", "not-updating")["items"]) == 3
    assert before.search_modules(0, "%")["items"] == []          # LIKE wildcards are literal
    capped = before.search_modules(0, "e", limit=2)
    assert len(capped["items"]) == 2 and capped["truncated"]


def test_findings_sorted_by_severity(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=3, live=True)
    st.add_finding("frozen-parameter", "stem.bias", "info", 1, "frozen")
    st.add_finding("dead-units", "head", "warning", 6, "dead")
    st.add_finding("saturated", "stem", "warning", 1, "old", active=0)
    st.close()
    s = Store.open_snapshot(tmp_path / "modscope.sqlite")
    sev = [f["severity"] for f in s.findings()]
    assert sev == sorted(sev, key=["error", "warning", "info"].index) and sev[-1] == "info"
    assert len(s.findings(active=None)) == len(s.findings()) + 1
    assert s.findings(module_id=6)[0]["code"] == "dead-units"
    assert s.finding_codes() == ["dead-units", "frozen-parameter", "not-updating", "unregistered-module"]
    assert s.module_for_path(0, "encoder.blocks[1].weight")["path"] == "encoder.blocks[1]"
    assert s.module_for_path(0, "nothing.here")["path"] == ""


def test_module_series_incremental_and_downsampled(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=50, live=True)
    s = Store.open_run(tmp_path)
    full = s.module_series(0, 1)
    assert full["step"] == list(range(50)) and full["last"] == 49
    st.add_steps(5)
    new = s.module_series(0, 1, since_step=full["last"])
    assert new["step"] == [50, 51, 52, 53, 54]                   # only what is new
    assert s.module_series(0, 1, since_step=54)["step"] == []
    small = s.module_series(0, 1, max_points=10)
    assert 1 < len(small["step"]) <= 11 and small["step"][-1] == 54
    loss = s.loss_series(max_points=10)
    assert len(loss["step"]) <= 11 and loss["last"] == 54
    assert s.loss_series(since_step=52)["step"] == [53, 54]
    st.close()


def test_histograms_and_params(before):
    blk = before.module_by_path(0, "encoder.blocks[0]")
    hist = before.module_hist(0, blk["module_id"], max_cols=10)
    assert len(hist["step"]) <= 11 and len(hist["counts"][0]) == len(hist["edges"]) + 1
    params = before.module_params(0, blk["module_id"])
    assert [p["name"] for p in params] == ["weight", "bias"]
    assert params[0]["shape"] == [16, 16] and params[0]["in_optimizer"] == 0 and params[0]["moved"] == 0
    assert params[0]["grad_norm"] is not None and params[0]["kind"] == "tensor"


def test_state_dict_keys_and_compare(before, after):
    assert before.state_dict_keys() == ["head.bias", "head.weight", "stem.bias", "stem.weight"]
    cmp = compare_stores(before, after)
    summary = {r["metric"]: (r["a"], r["b"]) for r in cmp["summary"]}
    assert summary["parameters (registered)"] == (82, 898)
    assert summary["checkpoint keys"] == (4, 10)
    assert summary["unregistered modules"] == (3, 0)
    assert cmp["keys_added"] == [f"encoder.blocks.{i}.{n}" for i in range(3) for n in ("bias", "weight")]
    assert cmp["keys_removed"] == [] and cmp["findings_appeared"] == []
    assert {f["code"] for f in cmp["findings_resolved"]} == {"unregistered-module", "not-updating"}
    row = next(m for m in cmp["modules"] if m["key"] == "encoder.blocks.0")
    assert (row["path_a"], row["path_b"], row["kind_a"], row["kind_b"]) == \
        ("encoder.blocks[0]", "encoder.blocks.0", "unregistered", "registered")
    assert row["in_opt_a"] == 0 and row["in_opt_b"] == 272 and row["changed"]
    assert normalize_path("a.b['x'][3]") == "a.b.x.3"


def test_snapshot_is_one_consistent_file(tmp_path):
    st = synth_store.demo(tmp_path / "run" / "modscope.sqlite", steps=10, live=True)
    live = Store.open_run(tmp_path / "run")
    snap = live.snapshot_to(tmp_path / "snap.sqlite")
    st.add_steps(3)
    st.close()
    conn = sqlite3.connect(str(snap))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()
    s = Store.open_snapshot(snap)
    assert s.overview()["step"] == 9 and s.last_step() == 9
    assert not (tmp_path / "snap.sqlite-wal").exists()
    assert snap.read_bytes()[:16] == b"SQLite format 3\x00"
    assert len(live.snapshot_bytes()) > 0


def test_live_store_not_there_yet(tmp_path):
    s = Store.open_run(tmp_path / "later")
    assert not s.ready()
    with pytest.raises(StoreNotReady):
        s.overview()
    synth_store.demo(tmp_path / "later" / "modscope.sqlite", steps=2)
    assert s.ready() and s.overview()["step"] == 1


def test_reads_while_the_writer_writes(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=1, live=True)
    s = Store.open_run(tmp_path)
    done = threading.Event()

    def write():
        st.add_steps(40)
        done.set()
    t = threading.Thread(target=write)
    t.start()
    seen = 0
    while not done.is_set():
        seen = max(seen, s.last_step() or 0)
    t.join()
    st.close()
    assert s.last_step() == 40


def test_queries_are_time_limited(before):
    slow = Store(before.path, live=True, timeout_s=0.2)
    with pytest.raises(QueryTimeout):
        slow._query("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                    "SELECT COUNT(*) FROM c")


# -- bad files: one line naming the path and the problem ------------------------------------------
def _err(fn) -> str:
    with pytest.raises(StoreError) as exc:
        fn()
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_missing_file(tmp_path):
    p = tmp_path / "nope.sqlite"
    assert _err(lambda: Store.open_snapshot(p)) == f"{p}: no such file"


def test_not_sqlite(tmp_path):
    p = tmp_path / "x.sqlite"
    p.write_text("hello, this is not a database at all")
    assert _err(lambda: Store.open_snapshot(p)) == f"{p}: not an SQLite file"
    assert _err(lambda: Store.open_run(p)) == f"{p}: not an SQLite file"
    e = tmp_path / "empty.sqlite"
    e.write_bytes(b"")
    assert "empty file" in _err(lambda: Store.open_snapshot(e))


def test_newer_schema(tmp_path):
    p = tmp_path / "modscope.sqlite"
    synth_store.demo(p, steps=1)
    conn = sqlite3.connect(str(p))
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    assert _err(lambda: Store.open_snapshot(p)) == \
        f"{p}: written by schema version 3, this dashboard reads up to {SUPPORTED_SCHEMA_VERSION}"
    assert "schema version 3" in _err(lambda: Store.open_run(tmp_path))


def test_not_a_modscope_store(tmp_path):
    p = tmp_path / "other.sqlite"
    conn = sqlite3.connect(str(p))
    conn.execute("CREATE TABLE t (x)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    assert "not a modscope store (missing tables: meta" in _err(lambda: Store.open_snapshot(p))


def test_corrupt_file(tmp_path):
    p = tmp_path / "modscope.sqlite"
    synth_store.demo(p, steps=30)
    data = bytearray(p.read_bytes())
    for i in range(4096 * 2, len(data), 7):
        data[i] = 0xA5
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(bytes(data))
    assert _err(lambda: Store.open_snapshot(bad)).startswith(f"{bad}: ")


def test_snapshot_flag_on_a_live_store_reads_its_wal(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=4, live=True)
    assert (tmp_path / "modscope.sqlite-wal").exists()
    s = Store.open_snapshot(tmp_path / "modscope.sqlite")
    assert s.live and s.last_step() == 3
    st.close()


def test_ranks_are_separate(tmp_path):
    s = Store.open_snapshot(synth_store.two_ranks(tmp_path / "modscope.sqlite"))
    assert s.ranks() == [0, 1]
    assert s.overview(0)["step"] == 5 and s.overview(1)["step"] == 2
    assert s.overview(1)["world_size"] == 2 and s.overview(1)["findings"]["error"] == 0
    assert [m["path"] for m in s.children(1, 0)["items"]] == ["only_on_rank1"]
    assert s.search_modules(1, "blocks")["items"] == []


def test_finished_run_in_a_read_only_place():
    """A finished run's store is still a WAL-mode file; where the -shm file cannot be created
    (a read-only copy of runs/), it must still open (as immutable: nothing writes it)."""
    import os
    import shutil
    import subprocess
    import sys as _sys
    import tempfile
    from pathlib import Path as _P
    base = _P(tempfile.mkdtemp(prefix="modscope-ro-"))   # not under pytest's 0700 tmp dir
    run, lib = base / "run", base / "lib"
    synth_store.demo(run / "modscope.sqlite", steps=3)
    assert not (run / "modscope.sqlite-wal").exists()
    lib.mkdir()
    shutil.copy(_P(__file__).resolve().parents[2] / "dashboard" / "data.py", lib / "data.py")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import data; "
            "s = data.Store.open_run(sys.argv[2]); print(s.overview()['step'], len(s.module_series(0, 1)['step']))")
    for p in (lib / "data.py", run / "modscope.sqlite"):
        os.chmod(p, 0o444)
    for p in (base, run, lib):
        os.chmod(p, 0o555)
    try:
        if os.geteuid() != 0:
            cmd = [_sys.executable, "-c", code, str(lib), str(run)]
        elif shutil.which("runuser") and os.path.exists("/usr/bin/python3"):
            cmd = ["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", code, str(lib), str(run)]
        else:
            pytest.skip("needs a non-root user to make a directory read-only")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0 and "Permission denied" in r.stderr and "python" in r.stderr:
            pytest.skip("no interpreter usable by the unprivileged user")
        assert r.returncode == 0 and r.stdout.split() == ["2", "3"], r.stderr
    finally:
        for p in (base, run, lib):
            os.chmod(p, 0o755)
        shutil.rmtree(base, ignore_errors=True)
