"""Runs: the rank files of one run read as one (dashboard.read.run), the runs of one directory, the findings
only a comparison of ranks shows (dashboard.read.crossrank), root causes with their consequences folded
under them; the views and page builders over a run. Stores from synth_store (one file per rank, as
the writer lays them out); no torch."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import synth_store
from dashboard.read import crossrank
from dashboard.read.run import (
    NEWEST,
    RunDir,
    compare_runs,
    fold_causes,
    format_ranks,
    merge_findings,
    root_counts,
    scan_runs,
)
from dashboard.read.store import RunState, Store, StoreError, StoreNotReadyError
from dashboard.web.config import AppConfig
from dashboard.web.pages import findings as findings_page
from dashboard.web.pages import modules as modules_page
from dashboard.web.pages import overview as overview_page
from dashboard.web.poll import banner, header_text, read_tick
from dashboard.web.report import build_report
from probes import schema

W = "encoder.blocks.1.weight"


def source(target: Path, **kw) -> RunDir:
    return RunDir.open(target, crossrank_interval_s=0.0, **kw)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def texts(component) -> str:
    """Every string inside a Dash component tree, joined."""
    out = []

    def walk(c):
        if c is None:
            return
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, (list, tuple)):
            for x in c:
                walk(x)
        else:
            walk(getattr(c, "children", None))
    walk(component)
    return " ".join(out)


# -- the runs of a directory ---------------------------------------------------------------------------
def test_a_directory_lists_its_runs_newest_first(tmp_path):
    synth_store.several_runs(tmp_path, ("aaa", "bbb", "ccc"), world_size=2)
    entries = scan_runs(tmp_path)
    assert [e.key for e in entries] == ["ccc", "bbb", "aaa"]
    assert [e.file_ranks for e in entries] == [(0, 1)] * 3
    assert entries[0].files == (tmp_path / schema.store_filename("ccc", 0), tmp_path / schema.store_filename("ccc", 1))
    infos = source(tmp_path).runs()
    assert [(i.key, i.name, i.ranks, i.status) for i in infos] == \
        [(run_id, f"train-{k}", (0, 1), "closed") for k, run_id in ((2, "ccc"), (1, "bbb"), (0, "aaa"))]
    label = infos[0].label()
    assert label.startswith("ccc · train-2 · ") and label.endswith(" · ranks 0, 1 · closed")
    assert time.strftime("%Y-%m-%d", time.localtime(infos[0].started_at)) in label
    assert scan_runs(tmp_path / "missing") == []
    assert scan_runs(tmp_path / "x" / "later.sqlite")[0].key == "@file:later.sqlite"


def test_the_newest_run_is_shown_and_followed_until_one_is_chosen(tmp_path):
    synth_store.several_runs(tmp_path, ("aaa", "bbb"), world_size=2)
    src = source(tmp_path)
    assert src.run().key == src.run(NEWEST).key == "bbb" and src.run("aaa").key == "aaa"
    assert src.run("gone").key == "bbb"                       # a run that is not there: the newest
    with pytest.raises(StoreError) as exc:
        src.run("gone", strict=True)
    assert str(exc.value) == f"{tmp_path}: no run 'gone' here (runs: bbb, aaa)"
    # a training restarted into the same directory: the newest is the new run, the chosen one stays
    synth_store.rank_run(tmp_path, "ccc", 3, 4, run_name="again")
    assert src.run().key == "ccc" and src.run().ranks() == [0, 1, 2] and src.run("aaa").ranks() == [0, 1]
    # rows of two runs are never shown as one: each run reads its own files only
    assert src.run("aaa").at(0).path.name == schema.store_filename("aaa", 0)
    assert src.run("aaa").at(0).last_step(0) == 4 and src.run("bbb").at(0).last_step(0) == 5


def test_a_rank_file_that_appears_later_joins_its_run(tmp_path):
    st = synth_store.rank_run(tmp_path, "job", 1, 3, close=False)[0]
    src = source(tmp_path)
    run = src.run()
    assert run.ranks() == [0]
    synth_store.rank_run(tmp_path / "other", "job", 2, 3)
    os.replace(tmp_path / "other" / schema.store_filename("job", 1), tmp_path / schema.store_filename("job", 1))
    assert src.run().ranks() == [0, 1] and src.run() is run
    st.close()


def test_a_version_1_store_with_two_ranks_is_one_run(tmp_path):
    synth_store.two_ranks(tmp_path / schema.LEGACY_STORE_FILENAME)
    src = source(tmp_path)
    [entry] = src.entries()
    assert entry.key == "@file:modscope.sqlite" and entry.file_ranks == (None,)
    run = src.run()
    assert run.ranks() == [0, 1] and run.at(0) is run.at(1) and run.run_id() is None
    assert [m["path"] for m in run.at(1).children(1, 0)["items"]] == ["only_on_rank1"]
    merged = run.findings_merged()
    assert {f["code"] for f in merged} == {"unregistered-module", "not-updating"}
    assert all(f["ranks"] == [0] for f in merged)
    assert len(src.runs()) == 1


def test_a_run_not_written_yet(tmp_path):
    src = source(tmp_path / "later")
    run = src.run()
    assert not run.ready()
    with pytest.raises(StoreNotReadyError, match="waiting for the first sample"):
        run.ranks()
    synth_store.rank_run(tmp_path / "later", "job", 2, 2)
    assert src.run().ranks() == [0, 1]


def test_a_rank_that_is_not_there_is_named(tmp_path):
    synth_store.rank_run(tmp_path, "job", 2, 2)
    run = source(tmp_path).run()
    with pytest.raises(StoreError) as exc:
        run.at(5)
    assert str(exc.value) == f"{tmp_path}: rank 5 is not in run job (it has ranks 0, 1)"
    assert run.view_rank(5) == 0 and run.view_rank(1) == 1 and run.view_rank(None) == 0


def test_an_unreadable_rank_file_is_left_out_and_named(tmp_path):
    synth_store.rank_run(tmp_path, "job", 3, 4)
    bad = tmp_path / schema.store_filename("job", 2)
    conn = sqlite3.connect(str(bad))
    conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    run = source(tmp_path).run()
    assert run.ranks() == [0, 1]
    [warning] = run.health().warnings
    assert warning.startswith(f"{bad.name}: left out ({bad}: written by schema version {schema.SCHEMA_VERSION + 1}")
    for r in (0, 1):
        conn = sqlite3.connect(str(tmp_path / schema.store_filename("job", r)))
        conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
        conn.commit()
        conn.close()
    with pytest.raises(StoreError, match="written by schema version"):
        source(tmp_path).run().ranks()


# -- merged findings ---------------------------------------------------------------------------------------
def test_findings_are_listed_once_with_their_ranks(tmp_path):
    stores = synth_store.rank_run(tmp_path, "job", 4, 6, close=False)
    for r, st in enumerate(stores):
        if r != 2:
            st.add_finding("dead-units", "head", "warning" if r else "info", 9, f"dead on rank {r}", count=r + 1,
                           first_step=r, last_step=10 + r)
    stores[3].add_finding("saturated", "stem", "warning", 1, "only on rank 3")
    for st in stores:
        st.close()
    run = source(tmp_path).run()
    merged = {f["code"]: f for f in run.findings_merged()}
    dead = merged["dead-units"]
    assert (dead["ranks"], dead["severity"], dead["count"], dead["first_step"], dead["last_step"]) == \
        ([0, 1, 3], "warning", 1 + 2 + 4, 0, 13)
    assert dead["message"] == "dead on rank 0" and dead["run_id"] == "job" and not dead["cross_rank"]
    assert merged["saturated"]["ranks"] == [3]
    assert run.findings_merged(rank=3)[0]["module_id"] is not None       # drawn on the module of the rank shown
    assert format_ranks(dead["ranks"]) == "ranks 0, 1, 3"


def test_merge_findings_keeps_worst_severity_and_any_active():
    per_rank = {
        1: [{"code": "x", "path": "p", "severity": "warning", "active": 0, "count": 2, "first_step": 5,
             "last_step": 9, "message": "m1", "cause_code": None}],
        0: [{"code": "x", "path": "p", "severity": "error", "active": 1, "count": None, "first_step": None,
             "last_step": 7, "message": "m0", "cause_code": "unregistered-module", "cause_path": "q"}],
    }
    [f] = merge_findings(per_rank)
    assert (f["ranks"], f["severity"], f["active"], f["count"], f["first_step"], f["last_step"], f["message"]) == \
        ([0, 1], "error", 1, 3, 5, 9, "m0")
    assert (f["cause_code"], f["cause_path"]) == ("unregistered-module", "q")


def test_format_ranks():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks(range(8)) == "ranks 0–7"
    assert format_ranks([7, 0, 1, 2, 3, 5, 8]) == "ranks 0–3, 5, 7, 8"
    assert format_ranks([0, 1]) == "ranks 0, 1" and format_ranks([]) == "no rank"
    assert format_ranks([0, 1, 2], word=False) == "0–2"


# -- root causes and their consequences -----------------------------------------------------------------------
def test_three_layers_fold_into_three_root_causes(tmp_path):
    synth_store.three_layers(tmp_path / "modscope.sqlite")
    run = source(tmp_path).run()
    merged = run.findings_merged()
    assert len(merged) == 15
    roots = fold_causes(merged)
    assert [(f["code"], f["path"]) for f in roots] == \
        [("unregistered-module", f"encoder.blocks[{i}]") for i in range(3)]
    for i, root in enumerate(roots):
        assert sorted((c["code"], c["path"]) for c in root["consequences"]) == sorted(
            (code, f"encoder.blocks[{i}].{name}") for code in ("not-updating", "grad-accumulating")
            for name in ("weight", "bias"))
        assert (root["count"], root["first_step"], root["last_step"]) == (12, 3, 40)
    assert root_counts(roots) == {"error": 3, "warning": 0, "info": 0}
    assert root_counts(merged) == {"error": 9, "warning": 6, "info": 0}
    assert run.overview()["root_causes"] == {"error": 3, "warning": 0, "info": 0}
    assert run.overview()["findings_total"] == 15


def test_fold_causes_chains_orphans_and_cycles():
    def f(code, path, cause=None, sev="error"):
        return {"code": code, "path": path, "severity": sev, "cause_code": cause[0] if cause else None,
                "cause_path": cause[1] if cause else None}
    items = [f("a", "1"), f("b", "1", ("a", "1")), f("c", "1", ("b", "1")),        # a <- b <- c: both under a
             f("d", "2", ("resolved", "9")),                                      # its cause is not listed
             f("x", "3", ("y", "3")), f("y", "3", ("x", "3"))]                    # a cycle stays visible
    roots = fold_causes(items)
    assert [(r["code"], [c["code"] for c in r["consequences"]]) for r in roots if r["code"] in ("a", "d")] == \
        [("a", ["b", "c"]), ("d", [])]
    shown = {r["code"] for r in roots} | {c["code"] for r in roots for c in r["consequences"]}
    assert shown == {"a", "b", "c", "d", "x", "y"}


# -- what no single process sees ----------------------------------------------------------------------------
def test_a_weight_changed_on_one_rank_is_a_rank_divergence(tmp_path):
    synth_store.rank_run(tmp_path, "job", 4, 40, diverge={1: {W: (25, 0.5)}})
    run = source(tmp_path).run()
    [d] = [f for f in run.findings_merged() if f["code"] == "rank-divergence"]
    assert (d["path"], d["severity"], d["ranks"], d["first_step"], d["last_step"], d["cross_rank"]) == \
        (W, "error", [1], 25, 39, True)
    ev = d["evidence"]
    assert ev["disagree"] == [1] and ev["agree"] == [0, 2, 3] and ev["quantity"] == "fingerprint"
    assert ev["values"]["1"]["fingerprint"] == pytest.approx(ev["values"]["0"]["fingerprint"] + 0.5)
    assert d["message"].startswith(f"{W} differs between ranks at step 39: rank 1 disagrees with ranks 0, 2, 3 "
                                   "(fingerprint ")
    assert "it has differed at every compared step since step 25" in d["message"]
    assert d["fix"] == schema.CODES["rank-divergence"].fix
    assert d["module_id"] == run.at(0).module_by_path(0, "encoder.blocks.1")["module_id"]
    assert root_counts(fold_causes(run.findings_merged()))["error"] == 1


def test_a_buffer_updated_from_local_data_diverges_and_healthy_ranks_do_not(tmp_path):
    synth_store.rank_run(tmp_path / "healthy", "job", 4, 20)
    assert source(tmp_path / "healthy").run().cross_rank_findings() == []
    synth_store.rank_run(tmp_path / "bn", "job", 2, 20, diverge={0: {"stem.running_mean": (0, 1e-3)}})
    [d] = source(tmp_path / "bn").run().cross_rank_findings()
    assert d["path"] == "stem.running_mean" and d["first_step"] == 0
    assert "(the oldest compared)" in d["message"]


def test_ranks_compared_where_they_have_the_step(tmp_path):
    """A rank that died stops at an older step: the newest step the others share is compared
    without it (a step sampled on two or more ranks)."""
    stores = synth_store.rank_run(tmp_path, "job", 3, 10, close=False, diverge={2: {W: (12, 1.0)}})
    for st in stores[1:]:
        st.add_steps(5)
    for st in stores:
        st.close()
    [d] = source(tmp_path).run().cross_rank_findings()
    assert d["last_step"] == 14 and d["ranks"] == [2] and d["first_step"] == 12
    assert sorted(d["evidence"]["values"]) == ["1", "2"]


def test_values_agree_within_tolerance_and_nan_agrees_with_nan():
    assert crossrank.same(1.0, 1.0 + 1e-9) and not crossrank.same(1.0, 1.0 + 1e-4)
    assert crossrank.same(float("nan"), float("nan")) and not crossrank.same(float("nan"), 1.0)
    assert crossrank.same(None, 3.0)
    assert crossrank.groups({0: 1.0, 1: 2.0, 2: 2.0}) == [[1, 2], [0]]
    assert crossrank.groups({0: 1.0, 1: 2.0}) == [[0], [1]]          # a tie: rank 0 is the reference
    d = crossrank.compare({0: (1.0, 4.0), 1: (1.0, 4.5)})
    assert d is not None and d.quantity == "data_norm" and d.disagree == (1,)
    assert crossrank.compare({0: (1.0, 4.0), 1: (None, 4.0)}) is None
    assert crossrank.compare({0: (1.0, 4.0)}) is None


def test_a_rank_that_is_consistently_slower_is_a_straggler(tmp_path):
    synth_store.rank_run(tmp_path / "slow", "job", 4, 128, step_ms={2: 4.8})
    [s] = source(tmp_path / "slow").run().cross_rank_findings()
    assert (s["code"], s["severity"], s["ranks"], s["path"]) == ("rank-straggler", "warning", [2], "")
    assert s["evidence"]["windows_compared"] == 4 and s["evidence"]["windows_slow"] == 4
    assert s["message"].startswith("rank 2's steps take 1.6× the median of the other ranks' (4.8 ms against 3 ms)")
    synth_store.rank_run(tmp_path / "close", "job", 4, 128, step_ms={2: 4.2})       # 1.4x: not a straggler
    assert source(tmp_path / "close").run().cross_rank_findings() == []


def test_straggler_rule_on_plain_data():
    def steps(ms_by_step):
        return [(s, ms) for s, ms in enumerate(ms_by_step)]
    fast, slow = [10.0] * 160, [16.0] * 160
    assert [s.rank for s in crossrank.stragglers({0: steps(fast), 1: steps(fast), 2: steps(slow)})] == [2]
    # slow in 3 of 5 windows (60% < 80%): not consistent
    mixed = [16.0] * 96 + [10.0] * 64
    assert crossrank.stragglers({0: steps(fast), 1: steps(fast), 2: steps(mixed)}) == []
    # too few windows to say
    assert crossrank.stragglers({0: steps(fast[:64]), 1: steps(slow[:64])}) == []
    assert crossrank.stragglers({0: steps(fast)}) == []


# -- the writers: one rank dies, the others go on --------------------------------------------------------------
def test_a_rank_that_dies_is_ended_and_one_that_falls_silent_is_stalled(tmp_path):
    stores = synth_store.rank_run(tmp_path, "job", 4, 6, close=False, pids={r: os.getpid() for r in range(4)})
    now = time.time()
    for st in stores:
        st.set_rank(updated_at=now)
    stores[1].set_rank(pid=dead_pid())                      # killed: its process is gone (this host)
    stores[2].set_rank(updated_at=now - 45)                 # alive but silent while the others go on
    stores[3].close()
    run = source(tmp_path).run()
    states = run.states(now)
    assert [states[r].state for r in range(4)] == [RunState.RUNNING, RunState.ENDED, RunState.STALLED, RunState.CLOSED]
    rows = run.rank_rows(now)
    assert [r["status_text"] for r in rows] == ["running", "ended without close (process gone)",
                                                "stalled: no update for 45 s", "closed"]
    assert [r["step"] for r in rows] == [5] * 4 and all(r["median_step_ms"] == 3.0 for r in rows)
    # what the header says, with the view on rank 0
    tick = read_tick(AppConfig(mode="live", store=source(tmp_path)), None, 0)
    assert header_text(tick) == "step 5 · running · rank 1 ended without close; rank 2 stalled"
    # silent together (a pause of the whole job) is not a stall of one rank
    for st in stores[:3]:
        st.set_rank(updated_at=now - 45, pid=os.getpid())
    assert {s.state for s in source(tmp_path).run().states(now).values()} == {RunState.RUNNING, RunState.CLOSED}
    for st in stores[:3]:
        st.close()


def test_failed_commits_of_any_rank_reach_the_banner(tmp_path):
    stores = synth_store.rank_run(tmp_path, "job", 3, 3, close=False)
    p = stores[2].path
    schema.status_path(p).write_bytes(schema.encode_status(schema.WriterStatus(
        state=schema.WriterState.FAILING, updated_at=time.time(), failing_since=None,
        error="database or disk is full", failed_commits=2, dropped_samples=7)))
    config = AppConfig(mode="live", store=source(tmp_path))
    tick = read_tick(config, None, 0)
    [div] = banner(tick, config.source)
    assert div.className == "banner-error" and div.children.startswith(
        "rank 2: Store writes are failing: database or disk is full — 2 commits failed, 7 samples dropped")
    for st in stores:
        st.close()


def test_a_store_in_wal_mode_written_from_another_host_is_flagged(tmp_path):
    stores = synth_store.rank_run(tmp_path, "job", 2, 3, close=False)
    stores[1].set_rank(hostname="node-b")
    [warning] = source(tmp_path).run().health().warnings
    assert warning.startswith("rank 1 is written on node-b in WAL mode")
    for st in stores:
        st.close()
    synth_store.rank_run(tmp_path / "delete", "job", 2, 3, journal="delete", hostname="node-b")
    assert source(tmp_path / "delete").run().health().warnings == []      # the rollback journal: read safely


def test_a_rollback_journal_store_being_written_is_never_read_as_immutable(tmp_path):
    """A multi-node job writes its stores with the rollback journal: no -wal while written; the
    writer's .lock says it is live, so the file is read like a live one (each read sees a commit)."""
    st = synth_store.rank_run(tmp_path, "job", 1, 3, journal="delete", close=False)[0]
    assert not Path(str(st.path) + "-wal").exists()
    lock = Path(str(st.path) + schema.LOCK_SUFFIX)
    lock.write_text('{"pid": 1, "hostname": "node-a", "started_at": 0}')
    opened = Store.open_snapshot(st.path)
    assert opened.live
    review = RunDir.open(tmp_path, live=False).run()
    assert review.at(0).live
    st.add_steps(2)
    assert review.at(0).last_step(0) == 4 and opened.last_step(0) == 4
    st.close()
    lock.unlink()
    assert not Store.open_snapshot(st.path).live


# -- snapshots, compare, report ---------------------------------------------------------------------------------
def test_the_snapshot_of_a_run_holds_every_rank_of_it_and_no_other_run(tmp_path):
    synth_store.several_runs(tmp_path / "runs", ("aaa", "bbb"), world_size=3)
    src = source(tmp_path / "runs")
    snap = tmp_path / "snap.sqlite"
    snap.write_bytes(src.run("aaa").snapshot_bytes())
    opened = source(snap, live=False).run()
    assert opened.ranks() == [0, 1, 2] and opened.at(0).last_step(0) == 4     # run aaa: 5 steps
    assert opened.at(0).meta()["run_id"] == "aaa"
    conn = sqlite3.connect(str(snap))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert conn.execute("SELECT COUNT(DISTINCT rank) FROM steps").fetchone()[0] == 3
    conn.close()


def test_compare_two_runs(tmp_path):
    synth_store.demo(tmp_path / "before" / "modscope.sqlite", steps=5)
    synth_store.rank_run(tmp_path / "after", "job", 2, 5)
    cmp = compare_runs(source(tmp_path / "before").run(), source(tmp_path / "after").run())
    summary = {r["metric"]: (r["a"], r["b"]) for r in cmp["summary"]}
    assert summary["unregistered modules"] == (3, 0) and summary["errors"] == (6, 0)
    assert {f["code"] for f in cmp["findings_resolved"]} == {"unregistered-module", "not-updating"}


def test_report_of_a_run_of_several_ranks(tmp_path):
    synth_store.rank_run(tmp_path, "job", 4, 40, diverge={1: {W: (25, 0.5)}})
    text = build_report(source(tmp_path))
    assert "Ranks (4)" in text and "rank-divergence" in text and "rank 1" in text
    assert "seen " in text and "steps 25–39" in text


def test_report_folds_consequences(tmp_path):
    synth_store.three_layers(tmp_path / "modscope.sqlite")
    text = build_report(source(tmp_path))
    assert text.count('<details class="consequences">') == 3 and text.count(">4 consequences<") == 3
    assert "Findings: 3 root causes (3 errors) and 12 consequences" in text and "seen 12 times, steps 3–40" in text


# -- the pages over a run --------------------------------------------------------------------------------------
def test_overview_shows_one_line_per_rank(tmp_path):
    stores = synth_store.rank_run(tmp_path, "job", 3, 6, close=False, pids={0: os.getpid(), 2: os.getpid()})
    stores[1].set_rank(pid=dead_pid())
    run = source(tmp_path).run()
    table = overview_page.rank_table(run.rank_rows())
    text = texts(table)
    assert "Ranks (3)" in text and "ended without close (process gone)" in text
    cells = [td for tr in table.children[1].children[1].children for td in tr.children]
    assert [c.className for c in cells if c.children == "ended without close (process gone)"] == ["bad"]
    assert overview_page.rank_table(run.rank_rows()[:1]) is None
    cards = texts(overview_page.overview_cards(run.overview(1)))
    assert "rank 1 of 3" in cards and "run job" in cards and "Root causes" in cards
    for st in stores:
        st.close()


def test_findings_page_lists_each_finding_once_with_its_ranks(tmp_path):
    stores = synth_store.rank_run(tmp_path, "job", 8, 40, close=False, diverge={1: {W: (25, 0.5)}})
    for st in stores:
        st.add_finding("dead-units", "head", "warning", 9, "dead")
        st.close()
    run = source(tmp_path).run()
    cards = findings_page.finding_list(run.folded_findings(), ["error", "warning", "info"], show_ranks=True)
    assert len(cards) == 3                                   # the summary, then one card per finding
    text = texts(cards)
    assert "ranks 0–7" in text and "rank 1" in text and "rank-divergence" in text
    assert texts(findings_page.finding_list(run.folded_findings(), ["warning"], show_ranks=False)).count("ranks") == 0


def test_findings_page_folds_consequences_under_root_causes(tmp_path):
    synth_store.three_layers(tmp_path / "modscope.sqlite")
    run = source(tmp_path).run()
    cards = findings_page.finding_list(run.folded_findings(), ["error", "warning", "info"])
    roots = cards[1:]
    assert len(roots) == 3
    for card in roots:
        [details] = [c for c in card.children if getattr(c, "className", None) == "consequences"]
        assert details.children[0].children == "4 consequences"
        assert len(details.children[1].children) == 4
    assert "seen 12 times, steps 3–40" in texts(roots[0])
    # the severity filter applies to root causes (their consequences go with them)
    assert texts(findings_page.finding_list(run.folded_findings(), ["warning"])) == "No finding matches the filter."
    # a consequence whose cause is not listed (resolved) is shown on its own and names its cause
    orphans = fold_causes([f for f in run.findings_merged() if f["code"] != "unregistered-module"])
    assert len(orphans) == 12 and all(not f["consequences"] for f in orphans)
    alone = findings_page.finding_list(orphans, ["warning"])
    assert len(alone) == 1 + 6 and "caused by unregistered-module at encoder.blocks[0]" in texts(alone)


def test_module_detail_shows_local_gradient_norms_per_rank(tmp_path):
    synth_store.rank_run(tmp_path, "job", 4, 6)
    run = source(tmp_path).run()
    blk = run.at(2).module_by_path(2, "encoder.blocks.1")
    norms = run.local_grad_norms(2, blk["module_id"])
    assert norms["ranks"] == [0, 1, 2, 3] and [r["name"] for r in norms["rows"]] == ["weight", "bias"]
    weight = norms["rows"][0]["values"]
    assert weight[3] > weight[2] > weight[1] > weight[0]         # each rank's own gradient
    table = modules_page.ranks_table(norms)
    assert "Local gradient norms per rank at step 5" in texts(table)
    detail = modules_page.detail_full(run, 2, blk["module_id"])
    assert detail.ranks is not None and detail.state["view"] == ["job", 2]
    one = source(tmp_path / "one")
    synth_store.demo(tmp_path / "one" / "modscope.sqlite", steps=3)
    assert modules_page.detail_full(one.run(), 0, 1).ranks is None


def test_local_gradient_norms_of_a_removed_module_come_from_each_rank_s_removed_module(tmp_path):
    synth_store.rank_run(tmp_path, "job", 4, 6)
    for path in sorted(tmp_path.glob("modscope-job-rank*.sqlite")):      # every rank swapped the block at step 4
        con = sqlite3.connect(path)
        with con:
            con.execute("UPDATE modules SET removed_step = 4 WHERE path = 'encoder.blocks.1'")
            con.execute("INSERT INTO modules (rank, module_id, path, parent_id, name, type, type_module, kind, depth) "
                        "SELECT rank, (SELECT MAX(module_id) + 1 FROM modules), path, parent_id, name, type, "
                        "type_module, kind, depth FROM modules WHERE path = 'encoder.blocks.1'")
        con.close()
    run = source(tmp_path).run()
    old = run.at(2).module_like(2, "encoder.blocks.1", 4)
    assert old is not None and old["removed_step"] == 4
    norms = run.local_grad_norms(2, old["module_id"])
    assert [r["name"] for r in norms["rows"]] == ["weight", "bias"]
    assert sorted(norms["rows"][0]["values"]) == [0, 1, 2, 3]      # not the new block's (it has no tensors yet)


def test_read_tick_names_the_view(tmp_path):
    synth_store.several_runs(tmp_path, ("aaa", "bbb"), world_size=2)
    config = AppConfig(mode="live", store=source(tmp_path))
    tick = read_tick(config)
    assert (tick.run, tick.runs, tick.rank, tick.ranks, tick.last_step) == ("bbb", ("bbb", "aaa"), 0, (0, 1), 5)
    tick = read_tick(config, "aaa", 1)
    assert (tick.run, tick.rank, tick.last_step) == ("aaa", 1, 4)
    assert read_tick(config, "aaa", 7).rank == 0             # a rank the run does not have: its lowest
    assert read_tick(config, NEWEST, 1).run == "bbb"
