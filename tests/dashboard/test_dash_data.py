"""The data-access layer: plain-data functions behind every page, limits, errors, versions, the
run directory's files, the writer's heartbeat and health. (What the real writer writes, read
through every query: tests/contract.)"""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import synth_store
from dashboard.read.compare import compare_stores
from dashboard.read.liveness import STALL_MIN_S
from dashboard.read.store import (
    Heartbeat,
    QueryTimeoutError,
    RunState,
    Store,
    StoreError,
    StoreNotReadyError,
    liveness,
    process_alive,
    resolve_store_path,
)
from probes import schema


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
    assert ov["write_errors"] == 0 and ov["last_error"] is None and ov["status"] == "closed"


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
    assert before.search_modules(0, "encoder")["items"][0]["path"] == "encoder"
    assert len(before.search_modules(0, "", "not-updating")["items"]) == 3
    assert before.search_modules(0, "%")["items"] == []          # LIKE wildcards are literal
    capped = before.search_modules(0, "e", limit=2)
    assert len(capped["items"]) == 2 and capped["truncated"]


def test_findings_sorted_by_severity(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=3, live=True)
    st.add_finding("frozen-parameter", "stem.bias", "info", 1, "frozen")
    st.add_finding("dead-units", "head", "warning", 6, "dead", count=4, cause=("dead-layer", "stem"))
    st.add_finding("saturated", "stem", "warning", 1, "old", active=0)
    st.close()
    s = Store.open_snapshot(tmp_path / "modscope.sqlite")
    sev = [f["severity"] for f in s.findings()]
    assert sev == sorted(sev, key=["error", "warning", "info"].index) and sev[-1] == "info"
    assert len(s.findings(active=None)) == len(s.findings()) + 1
    dead = s.findings(module_id=6)[0]
    assert (dead["code"], dead["count"], dead["cause_code"], dead["cause_path"]) == ("dead-units", 4, "dead-layer",
                                                                                    "stem")
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
    # v2 columns: a fingerprint at every sampled step; a local gradient norm only in a run of several ranks
    assert params[0]["local_grad_norm"] is None and params[0]["fingerprint"] is not None


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


def test_snapshot_bytes_are_one_consistent_file(tmp_path):
    """The download button's snapshot is probes.schema.snapshot's: one file in rollback-journal mode
    (no -wal), with what it was taken of, as of one instant."""
    st = synth_store.demo(tmp_path / "run" / "modscope.sqlite", steps=10, live=True)
    live = Store.open_run(tmp_path / "run")
    snap = tmp_path / "snap.sqlite"
    snap.write_bytes(live.snapshot_bytes())
    st.add_steps(3)
    st.close()
    conn = sqlite3.connect(str(snap))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()
    s = Store.open_snapshot(snap)
    assert s.overview()["step"] == 9 and s.last_step() == 9
    assert s.meta()["snapshot_of"] == live.path.name      # the file name, not where it was
    assert not (tmp_path / "snap.sqlite-wal").exists()


def test_live_store_not_there_yet(tmp_path):
    s = Store.open_run(tmp_path / "later")
    assert not s.ready()
    with pytest.raises(StoreNotReadyError, match="waiting for the first sample"):
        s.overview()
    synth_store.demo(tmp_path / "later" / "modscope.sqlite", steps=2)
    assert s.ready() and s.overview()["step"] == 1


def test_a_per_rank_store_that_appears_later_is_found(tmp_path):
    """The writer's file names (modscope-<run>-rank<R>.sqlite) are looked for again until one exists."""
    run = tmp_path / "later"
    s = Store.open_run(run)
    assert not s.ready() and s.where == run
    run.mkdir()
    (run / "demo.log").write_text("not a store")
    assert not s.ready()
    synth_store.demo(run / schema.store_filename("r1", 0), steps=3)
    assert s.ready() and s.path == run / schema.store_filename("r1", 0) and s.last_step() == 2


def test_resolve_store_path_picks_the_newest_runs_lowest_rank(tmp_path):
    assert resolve_store_path(tmp_path / "missing") is None
    assert resolve_store_path(tmp_path) is None
    old, new = (tmp_path / schema.store_filename(r, k) for r, k in (("aaa", 0), ("bbb", 1)))
    for p in (old, new, tmp_path / schema.store_filename("bbb", 2), tmp_path / "modscope-bbb-rank2.sqlite.status"):
        p.write_bytes(b"")
    os.utime(old, (1000, 1000))
    for p in (new, tmp_path / schema.store_filename("bbb", 2)):
        os.utime(p, (2000, 2000))
    assert resolve_store_path(tmp_path) == new                   # the newest run, its lowest rank
    os.utime(old, (3000, 3000))
    assert resolve_store_path(tmp_path) == old
    Path(str(new) + "-wal").write_bytes(b"")                     # an empty -wal (a reader opened it): no commit
    os.utime(Path(str(new) + "-wal"), (4000, 4000))
    assert resolve_store_path(tmp_path) == old
    Path(str(new) + "-wal").write_bytes(b"\x37" * 32)            # a commit to run bbb's WAL makes it the newest
    os.utime(Path(str(new) + "-wal"), (4000, 4000))
    assert resolve_store_path(tmp_path) == new
    tie = tmp_path / "tie"
    tie.mkdir()
    for run_id in ("r1", "r2"):
        p = tie / schema.store_filename(run_id, 0)
        p.write_bytes(b"")
        os.utime(p, (5000, 5000))
    assert resolve_store_path(tie) == tie / schema.store_filename("r2", 0)     # a tie: the larger run id
    (tie / schema.LEGACY_STORE_FILENAME).write_bytes(b"")
    assert resolve_store_path(tie) == tie / schema.LEGACY_STORE_FILENAME     # a version-1 run directory


def test_a_bad_store_that_appears_later_says_what_is_wrong(tmp_path):
    """A store that appears after the dashboard started and is newer or corrupt: the same one-line
    error as at start-up, not "waiting" forever."""
    run = tmp_path / "run"
    s = Store.open_run(run)
    assert not s.ready()
    p = run / schema.store_filename("r1", 0)
    synth_store.demo(p, steps=1)
    conn = sqlite3.connect(str(p))
    conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    expected = f"{p}: written by schema version {schema.SCHEMA_VERSION + 1}, this dashboard reads up to " \
               f"{schema.SCHEMA_VERSION}"
    assert _err(s.ready) == expected
    assert _err(lambda: Store.open_run(run)) == expected
    p.write_bytes(b"plain text, not a database" * 50)
    assert _err(s.ready) == _err(lambda: Store.open_run(run)) == f"{p}: not an SQLite file"


def test_reads_while_the_writer_writes(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=1, live=True)
    s = Store.open_run(tmp_path)
    done = threading.Event()

    def write():
        st.add_steps(40)
        done.set()
    t = threading.Thread(target=write)
    t.start()
    seen = []
    while not done.is_set():
        seen.append(s.last_step())
    t.join()
    st.close()
    assert s.last_step() == 40
    # every read saw a committed state: a step the writer had reached, never going back
    assert seen and all(isinstance(x, int) and 0 <= x <= 40 for x in seen) and seen == sorted(seen)


def test_queries_are_time_limited(before):
    slow = Store(before.path, live=True, timeout_s=0.2)
    with pytest.raises(QueryTimeoutError):
        slow._query("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                    "SELECT COUNT(*) FROM c")


# -- versions ------------------------------------------------------------------------------------------
def test_a_version_1_store_reads_the_added_columns_as_their_defaults(tmp_path):
    p = tmp_path / "modscope.sqlite"
    st = synth_store.demo(p, steps=5, live=True)
    st.add_finding("dead-units", "head", "warning", 6, "dead", count=3)
    st.close()
    synth_store.as_version_1(p)
    conn = sqlite3.connect(str(p))
    assert "count" not in {r[1] for r in conn.execute("PRAGMA table_info(findings)")}
    conn.close()
    s = Store.open_snapshot(p)
    assert s.validate().schema_version == 1
    f = s.findings(module_id=6)[0]
    assert (f["code"], f["count"], f["cause_code"], f["cause_path"]) == ("dead-units", 1, None, None)
    ov = s.overview()
    assert ov["write_errors"] == 0 and ov["last_error"] is None and ov["findings"]["warning"] == 1
    blk = s.module_by_path(0, "encoder.blocks[0]")
    params = s.module_params(0, blk["module_id"])
    assert params[0]["local_grad_norm"] is None and params[0]["fingerprint"] is None
    assert params[0]["grad_norm"] is not None
    assert s.change_signature().write_errors == 0 and s.write_trouble() is None
    assert Store.open_run(tmp_path).ready()                       # live too


def test_newer_schema(tmp_path):
    p = tmp_path / "modscope.sqlite"
    synth_store.demo(p, steps=1)
    conn = sqlite3.connect(str(p))
    conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    assert _err(lambda: Store.open_snapshot(p)) == \
        f"{p}: written by schema version {schema.SCHEMA_VERSION + 1}, this dashboard reads up to " \
        f"{schema.SCHEMA_VERSION}"
    assert f"schema version {schema.SCHEMA_VERSION + 1}" in _err(lambda: Store.open_run(tmp_path))


# -- bad files: one line naming the path and the problem ------------------------------------------
def _err(fn) -> str:
    with pytest.raises(StoreError) as exc:
        fn()
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_store_errors_are_one_line():
    assert str(StoreError("x.sqlite: corrupt SQLite file (*** in database main ***\nPage 5: bad\n)")) == \
        "x.sqlite: corrupt SQLite file (*** in database main *** Page 5: bad )"


def test_missing_file(tmp_path):
    p = tmp_path / "nope.sqlite"
    assert _err(lambda: Store.open_snapshot(p)) == f"{p}: no such file"
    assert _err(lambda: Store.open_snapshot(tmp_path)) == f"{tmp_path}: no store in this directory"


def test_not_sqlite(tmp_path):
    p = tmp_path / "x.sqlite"
    p.write_text("hello, this is not a database at all")
    assert _err(lambda: Store.open_snapshot(p)) == f"{p}: not an SQLite file"
    assert _err(lambda: Store.open_run(p)) == f"{p}: not an SQLite file"
    e = tmp_path / "empty.sqlite"
    e.write_bytes(b"")
    assert "empty file" in _err(lambda: Store.open_snapshot(e))


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


# -- the writer's heartbeat ---------------------------------------------------------------------------
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def beat(**kw) -> Heartbeat:
    values = {"status": "running", "updated_at": 1000.0, "pid": os.getpid(), "hostname": socket.gethostname(),
              "median_step_s": 0.1}
    values.update(kw)
    return Heartbeat(**values)


def test_liveness_rules():
    assert liveness(beat(), now=1000.0 + STALL_MIN_S - 1, alive=True).state is RunState.RUNNING
    stalled = liveness(beat(), now=1000.0 + 300, alive=True)
    assert stalled.state is RunState.STALLED and stalled.silent_s == 300
    assert liveness(beat(), now=1000.0 + 300, alive=None).state is RunState.STALLED       # another host
    assert liveness(beat(), now=1000.0 + 1, alive=False).state is RunState.ENDED          # gone: at once
    # slow steps: 5 median steps (here 60 s each) before a silence counts as a stall
    assert liveness(beat(median_step_s=60.0), now=1000.0 + 290, alive=True).state is RunState.RUNNING
    assert liveness(beat(median_step_s=60.0), now=1000.0 + 301, alive=True).state is RunState.STALLED
    assert liveness(beat(status="closed"), now=1e9, alive=False).state is RunState.CLOSED
    assert liveness(beat(status=None), now=1e9, alive=None).state is RunState.UNKNOWN


def test_process_alive_only_on_this_host():
    me = socket.gethostname()
    assert process_alive(os.getpid(), me) is True
    assert process_alive(dead_pid(), me) is False
    assert process_alive(os.getpid(), me + "-elsewhere") is None
    assert process_alive(None, me) is None and process_alive(0, me) is None
    assert process_alive(1, me) is True                          # pid 1 exists (maybe not ours to signal)


def test_store_liveness_from_its_heartbeat(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=3, live=True)
    s = Store.open_run(tmp_path)
    st.set_rank(hostname=socket.gethostname(), pid=os.getpid(), updated_at=time.time())
    assert s.liveness().state is RunState.RUNNING
    st.set_rank(updated_at=time.time() - 600)
    life = s.liveness()
    assert life.state is RunState.STALLED and life.silent_s >= 600
    st.set_rank(pid=dead_pid())
    assert s.liveness().state is RunState.ENDED
    st.set_rank(hostname="another-host")
    assert s.liveness().state is RunState.STALLED
    st.close()
    assert s.liveness().state is RunState.CLOSED


def test_a_snapshot_says_what_it_recorded(tmp_path):
    st = synth_store.demo(tmp_path / "run" / "modscope.sqlite", steps=3, live=True)
    st.set_rank(hostname=socket.gethostname(), pid=dead_pid(), updated_at=0.0)
    snap = tmp_path / "snap.sqlite"
    snap.write_bytes(Store.open_run(tmp_path / "run").snapshot_bytes())
    st.close()
    assert Store.open_snapshot(snap).liveness().state is RunState.COPIED_RUNNING


# -- the writer's health: failed commits ---------------------------------------------------------------
def write_status(store_path: Path, **kw) -> None:
    values = {"state": schema.WriterState.OK, "updated_at": time.time()}
    values.update(kw)
    schema.status_path(store_path).write_bytes(schema.encode_status(schema.WriterStatus(**values)))


def test_write_trouble_while_failing_and_after(tmp_path):
    p = tmp_path / schema.store_filename("r1", 0)
    st = synth_store.demo(p, steps=3, live=True)
    s = Store.open_run(tmp_path)
    assert s.write_trouble() is None
    write_status(p, state=schema.WriterState.FAILING, failing_since=1000.0, error="database or disk is full",
                 failed_commits=3, dropped_samples=120)
    t = s.write_trouble()
    assert (t.failing, t.failing_since, t.error, t.failed_commits, t.dropped_samples) == \
        (True, 1000.0, "database or disk is full", 3, 120)
    write_status(p, failed_commits=3, dropped_samples=120, error="database or disk is full")   # recovered
    st.set_rank(write_errors=3, last_error="database or disk is full")
    t = s.write_trouble()
    assert (t.failing, t.failed_commits, t.dropped_samples, t.error) == (False, 3, 120, "database or disk is full")
    assert s.change_signature().write_errors == 3
    schema.status_path(p).write_bytes(b"\x00garbage")             # an unreadable status is no status
    t = s.write_trouble()
    assert (t.failing, t.failed_commits, t.error) == (False, 3, "database or disk is full")
    st.close()


def test_change_signature_moves_with_the_store(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=3, live=True)
    s = Store.open_run(tmp_path)
    a = s.change_signature()
    assert (a.last_step, a.stats_step, a.status, a.structure[0]) == (2, 2, "running", 7)
    st.add_steps(1)
    b = s.change_signature()
    assert b.last_step == 3 and b.structure == a.structure        # a step: the tree is unchanged
    st.add_finding("dead-units", "head", "warning", 6, "dead")
    assert s.change_signature().structure != b.structure          # a finding: the tree's badges change
    st.close()
    assert s.change_signature().status == "closed"


def test_finished_run_in_a_read_only_place():
    """A finished run's store is still a WAL-mode file; where the -shm file cannot be created
    (a read-only copy of runs/), it must still open (as immutable: nothing writes it)."""
    import shutil
    import tempfile
    repo = Path(__file__).resolve().parents[2]
    base = Path(tempfile.mkdtemp(prefix="modscope-ro-"))   # not under pytest's 0700 tmp dir
    run, lib = base / "run", base / "lib"
    synth_store.demo(run / "modscope.sqlite", steps=3)
    assert not (run / "modscope.sqlite-wal").exists()
    shutil.copytree(repo / "dashboard", lib / "dashboard")
    (lib / "probes").mkdir()
    # the stdlib files the dashboard uses: the contract and its parts
    for name in ("__init__.py", "_version.py", "_compat.py", "schema.py", "paths.py", "state_dict_keys.py",
                 "store_copy.py", "writer_status.py"):
        shutil.copy(repo / "probes" / name, lib / "probes" / name)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from dashboard.read import store as data; "
            "s = data.Store.open_run(sys.argv[2]); print(s.overview()['step'], len(s.module_series(0, 1)['step']))")
    for p in (*lib.rglob("*"), run / "modscope.sqlite"):
        if p.is_file():
            os.chmod(p, 0o444)
    dirs = [base, run, lib, *(p for p in lib.rglob("*") if p.is_dir())]
    for p in dirs:
        os.chmod(p, 0o555)
    try:
        if os.geteuid() != 0:
            cmd = [sys.executable, "-c", code, str(lib), str(run)]
        elif shutil.which("runuser") and os.path.exists("/usr/bin/python3"):
            cmd = ["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", code, str(lib), str(run)]
        else:
            pytest.skip("needs a non-root user to make a directory read-only")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""},
                           check=False)
        if r.returncode != 0 and "Permission denied" in r.stderr and "python" in r.stderr:
            pytest.skip("no interpreter usable by the unprivileged user")
        assert r.returncode == 0 and r.stdout.split() == ["2", "3"], r.stderr
    finally:
        for p in dirs:
            os.chmod(p, 0o755)
        shutil.rmtree(base, ignore_errors=True)


# -- one definition everywhere: tied weights, root causes, optimizers, snapshot names -------------------
def tied_store(path: Path) -> synth_store.SynthStore:
    """A GPT-2-like model whose lm_head.weight is transformer.wte.weight (stored once, with an alias), a
    module whose path only matches lm_head's under LIKE's ``_`` wildcard, and two optimizers."""
    st = synth_store.SynthStore(path, run_name="tied", model_class="GPT2")
    root = st.add_module("", None, "", "GPT2", params=4096 + 64)
    tr = st.add_module("transformer", root, "transformer", "Transformer", params=4096)
    wte = st.add_module("transformer.wte", tr, "wte", "Embedding", params=4096)
    st.add_param(wte, "transformer.wte.weight", "weight", [128, 32], aliases=["lm_head.weight"])
    st.add_module("lm_head", root, "lm_head", "Linear", params=0, trainable=0, in_opt=0)
    lmx = st.add_module("lmXhead", root, "lmXhead", "Linear", params=64)
    st.add_param(lmx, "lmXhead.weight", "weight", [2, 32])
    st.commit()
    st.add_steps(3)
    st.close()
    return st


def test_a_tied_weight_is_listed_under_every_module_that_owns_it(tmp_path):
    st = tied_store(tmp_path / "modscope.sqlite")
    s = Store.open_run(tmp_path)
    mid = {m["path"]: m["module_id"] for m in st.modules}
    [head] = s.module_params(0, mid["lm_head"])
    assert (head["name"], head["path"], head["primary"]) == ("weight", "lm_head.weight", False)
    assert head["shared_with"] == ["transformer.wte.weight"] and head["numel"] == 4096
    assert head["grad_norm"] is not None and head["stat_step"] == 2          # its statistics come along
    [wte] = s.module_params(0, mid["transformer.wte"])
    assert (wte["path"], wte["primary"], wte["shared_with"]) == ("transformer.wte.weight", True, ["lm_head.weight"])
    assert [p["path"] for p in s.module_params(0, mid["lmXhead"])] == ["lmXhead.weight"]   # `_` is no wildcard
    assert s.module_params(0, mid["transformer"]) == [] and s.module_params(0, mid[""]) == []
    # the store's counts stay each tensor once per subtree: lm_head counts 0, the root once
    assert s.module(0, mid["lm_head"])["params_total"] == 0 and s.overview()["params"]["total"] == 4096 + 64


def test_compare_counts_root_causes_like_every_other_page(tmp_path):
    from dashboard.read.run import fold_causes, root_counts
    synth_store.three_layers(tmp_path / "a" / "modscope.sqlite")      # 3 root causes, 12 consequences
    a = Store.open_run(tmp_path / "a")
    assert len(a.findings()) == 15
    roots = root_counts(fold_causes(a.findings()))
    assert roots["error"] == 3 and roots["warning"] == 0
    summary = {r["metric"]: r for r in compare_stores(a, a)["summary"]}
    assert (summary["errors"]["a"], summary["warnings"]["a"]) == (3, 0)


def test_optimizer_count(tmp_path):
    st = tied_store(tmp_path / "modscope.sqlite")
    s = Store.open_run(tmp_path)
    assert s.optimizer_count(0) == 1
    conn = sqlite3.connect(st.path)
    conn.execute("UPDATE params SET opt_index = 1 WHERE path = 'lmXhead.weight'")
    conn.commit()
    conn.close()
    assert Store.open_run(tmp_path).optimizer_count(0) == 2


def test_snapshot_is_named_by_the_step_it_holds(tmp_path):
    from dashboard.read.run import RunDir
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=5, live=True)
    run = RunDir.open(tmp_path).run()
    data, step = run.snapshot_with_step(0)
    st.add_steps(3)                      # the writer moves on: the copy still holds step 4
    out = tmp_path / "copy.sqlite"
    out.write_bytes(data)
    assert step == 4 == Store.open_snapshot(out).overview()["step"] < run.at(0).overview()["step"]
    st.close()


def removed_store(path: Path) -> tuple[synth_store.SynthStore, dict[str, int]]:
    """The fixed demo classifier whose head was replaced at step 10 (the old one's tensors with it) and whose last
    block was deleted then, as the writer marks them (modules.removed_step, params.removed_step)."""
    st = synth_store.demo(path, steps=10, fixed=True, live=True)
    ids = {m["path"]: m["module_id"] for m in st.modules}
    new_head = st.add_module("head", ids[""], "head", "Linear", params=34, relu=False)
    st.add_param(new_head, "head.weight", "weight", [2, 16], in_optimizer=False)
    st.add_param(new_head, "head.bias", "bias", [2], in_optimizer=False)
    for table in ("modules", "params"):             # a module's tensors leave the model with it
        st.conn.execute(f"UPDATE {table} SET removed_step = 10 WHERE module_id IN (?, ?)",
                        (ids["head"], ids["encoder.blocks.2"]))
    st.conn.execute("UPDATE modules SET n_children = 3, params_total = 898 - 272 WHERE module_id = ?", (ids[""],))
    st.add_finding("not-updating", "head.weight", "error", ids["head"], "old head", active=0)
    st.add_finding("dead-units", "encoder.blocks.2", "warning", ids["encoder.blocks.2"], "dead")
    st.add_steps(2, modules=[i for p, i in ids.items() if p not in ("head", "encoder.blocks.2")] + [new_head])
    return st, {**ids, "new head": new_head}


def test_modules_that_left_the_model_are_not_the_model(tmp_path):
    """The tree, the counts and the checkpoint keys are the model's now; a module that left it is found (search, by
    id, by path when nothing is there now) and keeps its tensors, statistics and findings."""
    st, ids = removed_store(tmp_path / "modscope.sqlite")
    s = Store.open_run(tmp_path)
    root = s.root()
    assert [m["path"] for m in s.children(0, root["module_id"])["items"]] == ["stem", "encoder", "head"]
    assert s.children(0, root["module_id"])["items"][-1]["module_id"] == ids["new head"]
    lst = ids["encoder.blocks"]
    assert [m["path"] for m in s.children(0, lst)["items"]] == ["encoder.blocks.0", "encoder.blocks.1"]
    # the one selected is drawn where it was, after the modules there now
    also = s.children(0, root["module_id"], also=ids["head"])["items"]
    assert [(m["path"], m["removed_step"]) for m in also] == [("stem", None), ("encoder", None), ("head", None),
                                                               ("head", 10)]
    assert s.children(0, lst, limit=1) == {"items": s.children(0, lst)["items"][:1], "more": 1}
    assert s.module_by_path(0, "head")["module_id"] == ids["new head"]                 # the one there now
    assert s.module_by_path(0, "encoder.blocks.2")["removed_step"] == 10                # else the one removed
    assert s.module_for_path(0, "head.bias")["module_id"] == ids["new head"]
    assert s.modules_for_paths(0, ["head.weight"])["head.weight"]["module_id"] == ids["new head"]
    assert s.module(0, ids["head"])["removed_step"] == 10
    assert {m["path"] for m in s.all_modules(removed=True)} == {"head", "encoder.blocks.2"}
    assert "encoder.blocks.2" not in {m["path"] for m in s.all_modules()}
    res = s.search_modules(0, "head")["items"]
    assert [(m["module_id"], m["removed_step"]) for m in res] == [(ids["new head"], None), (ids["head"], 10)]
    ov = s.overview()
    assert ov["modules"] == {"registered": 7, "unregistered": 0, "runtime": 0} and ov["modules_removed"] == 2
    assert ov["params"]["total"] == 898 - 272 and ov["params"]["in_optimizer"] == 898 - 272 - 34
    assert s.state_dict_keys() == sorted(["stem.weight", "stem.bias", "head.weight", "head.bias",
                                          *(f"encoder.blocks.{i}.{p}" for i in (0, 1) for p in ("weight", "bias"))])
    # the old head: its own tensors and history; the new head: its own
    old = s.module_params(0, ids["head"])
    assert [p["in_optimizer"] for p in old] == [1, 1] and {p["param_id"] for p in old} == \
        {p["param_id"] for p in st.params if p["module_id"] == ids["head"]}
    assert [p["in_optimizer"] for p in s.module_params(0, ids["new head"])] == [0, 0]
    assert s.module_series(0, ids["head"])["step"] == list(range(10))
    assert s.module_series(0, ids["new head"])["step"] == [10, 11]
    assert [f["message"] for f in s.findings(active=False, module_id=ids["head"])] == ["old head"]
    # a finding on a module that left the model is not counted "inside" the tree that no longer holds it
    assert s.subtree_finding_counts() == {}
    st.conn.execute("UPDATE params SET opt_index = 1 WHERE module_id = ?", (ids["head"],))   # its own optimizer
    st.commit()
    assert s.optimizer_count() == 1                  # that holds nothing of the model now
    st.close()


def test_a_tensor_removed_from_a_module_of_the_model_is_not_listed_under_it(tmp_path):
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=3, fixed=True, live=True)
    stem = st.modules[1]["module_id"]
    st.conn.execute("UPDATE params SET removed_step = 2 WHERE path = 'stem.bias'")      # del stem.bias
    st.commit()
    s = Store.open_run(tmp_path)
    assert [p["path"] for p in s.module_params(0, stem)] == ["stem.weight"]
    assert "stem.bias" not in s.state_dict_keys()
    st.close()


def test_change_signature_moves_when_a_module_leaves_the_model(tmp_path):
    """A module deleted changes no count of rows: the tree must still be drawn again."""
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=3, fixed=True, live=True)
    s = Store.open_run(tmp_path)
    a = s.change_signature()
    st.conn.execute("UPDATE modules SET removed_step = 3 WHERE path = 'encoder.blocks.2'")
    st.commit()
    b = s.change_signature()
    assert b.structure[0] == a.structure[0] and b.structure != a.structure
    st.conn.execute("UPDATE modules SET removed_step = NULL WHERE path = 'encoder.blocks.2'")     # back
    st.conn.execute("UPDATE modules SET removed_step = 3 WHERE path = 'encoder.blocks.1'")
    st.commit()
    assert s.change_signature().structure != b.structure
    st.close()
