"""Reading a store from someone else (dashboard.read.store_guard): real SQLite files built with sqlite3, read through
the dashboard's own Store and pages' functions. Refusals are one line naming the file and the object; wrong values
read as unknown; long strings are cut where they are shown; a single SQL function call cannot allocate more than
the length limit."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from dash.exceptions import PreventUpdate
from hostile_stores import HOSTILE, generated_path, long_finding_paths, long_run_name, trigger_on_meta, wrong_values

from bench import synth_store
from dashboard.read import store_guard
from dashboard.read.run import RunDir
from dashboard.read.shown_text import LABEL_MAX, TITLE_MAX, file_part
from dashboard.read.store import Store, StoreError
from dashboard.web.components import finding_card
from dashboard.web.pages import modules
from dashboard.web.report import build_report
from dashboard.web.server import AppConfig, create_app
from probes import schema

REPO = Path(__file__).resolve().parents[2]


def refusal(fn) -> str:
    with pytest.raises(StoreError) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def read_all(path: Path) -> dict:
    """What the pages read of a store, through the run (as the server does)."""
    run = RunDir.open(path, live=False).run()
    store = run.at(0)
    ids = [m["module_id"] for m in store.all_modules(0)]
    return {"overview": run.overview(0), "findings": run.folded_findings(active=None, rank=0),
            "tree": modules.build_tree(store, 0, ids, None)[0]["rows"],
            "details": [modules.detail_full(run, 0, i) for i in ids], "hists": [store.module_hist(0, i) for i in ids],
            "modules": {m["module_id"]: m for m in store.all_modules(0)}, "store": store, "run": run,
            "report": build_report(run, 0)}


# -- one function call -----------------------------------------------------------------------------------------
LENGTH_PROBE = """
import sqlite3, sys
sys.path.insert(0, sys.argv[1])
from probes import schema
conn = sqlite3.connect(":memory:")
if sys.argv[2] == "guarded":
    schema.guard_reads(conn, "probe")
try:
    sql = "SELECT 1" if sys.argv[2] == "baseline" else "SELECT length(hex(zeroblob(50000000)))"
    print("built", conn.execute(sql).fetchone()[0])
except sqlite3.DataError as exc:
    print("refused", exc)
# this process's own peak (VmHWM: ru_maxrss would count the parent's memory at the fork, kept across exec)
print(next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def test_the_length_limit_stops_a_single_function_call():
    """hex(zeroblob(50000000)) builds 100 MB in one call: under the reader's limits it fails at once (a real process,
    its peak memory measured), where an unguarded connection builds it."""
    def probe(mode: str) -> tuple[str, int]:
        # -E and a bare environment: what this process imports is the probe's own, whatever the tests set
        r = subprocess.run([sys.executable, "-E", "-c", LENGTH_PROBE, str(REPO), mode], capture_output=True,
                           text=True, timeout=300, check=False, env={"PATH": os.environ.get("PATH", "")})
        assert r.returncode == 0, (mode, r.returncode, r.stderr)
        first, peak = r.stdout.split("\n")[:2]
        return first, int(peak)
    _, baseline = probe("baseline")                     # the interpreter and the schema module: peak in MiB
    verdict, peak = probe("guarded")
    assert verdict == "refused string or blob too big" and peak < baseline + 50, (verdict, peak, baseline)
    verdict, peak = probe("bare")
    assert verdict == "built 100000000" and peak > baseline + 90, (verdict, peak, baseline)   # what it prevents


# -- schema objects --------------------------------------------------------------------------------------------
def test_a_generated_column_is_refused_naming_the_file_and_the_column(tmp_path):
    p = generated_path(tmp_path / "gen.sqlite")
    assert p.stat().st_size < 200_000
    assert refusal(lambda: Store.open_snapshot(p).overview()) == (
        f"{p}: modules.path is a generated column; modscope writes none (reading it would run the file's own SQL)")


@pytest.mark.parametrize("make, what", [
    ("DROP TABLE findings; CREATE VIEW findings AS SELECT * FROM ranks", "findings is a view"),
    ("DROP TABLE findings; CREATE VIRTUAL TABLE findings USING fts5(code, path)", "findings is a virtual table"),
])
def test_a_view_or_a_virtual_table_under_a_tables_name_is_refused(tmp_path, make, what):
    p = tmp_path / "modscope.sqlite"
    synth_store.demo(p, steps=3)
    conn = sqlite3.connect(p)
    conn.executescript(make)
    conn.close()
    assert refusal(lambda: Store.open_snapshot(p).overview()) == \
        f"{p}: {what}; expected the table modscope writes"


def test_triggers_views_and_extra_tables_are_ignored_and_named(tmp_path):
    p = trigger_on_meta(tmp_path / "trig.sqlite")
    seen = read_all(p)
    assert seen["overview"]["model_class"] == "Classifier" and seen["tree"]
    note = (f"{p}: ignored trigger 'spin' on 'meta', trigger 'spin_update' on 'meta', view 'everything', "
            "table 'notes': modscope writes no such object (never read, never copied)")
    assert seen["store"].schema_note == note
    assert note in seen["run"].health().warnings                  # the page's banner


# -- values ----------------------------------------------------------------------------------------------------
def test_wrong_types_and_out_of_range_numbers_read_as_unknown(tmp_path):
    p = wrong_values(tmp_path / "wrong.sqlite")
    seen = read_all(p)
    ov = seen["overview"]
    assert ov["run_name"] == "tmp" or ov["run_name"] == p.parent.name          # meta run_name 42: not a name
    assert ov["created_at"] is None and ov["status"] is None    # overhead 9e999: from the steps' times instead
    assert ov["world_size"] == 1 and ov["pid"] is None and ov["started_at"] is None and ov["probe_errors"] is None
    assert seen["run"].meta()["run_id"] is None and seen["run"].meta()["hist_edges"] is None
    stem = seen["modules"][1]
    assert stem["kind"] == store_guard.UNKNOWN and stem["type"] == store_guard.UNKNOWN == stem["name"]
    assert stem["depth"] is None and stem["n_children"] is None and stem["params_total"] is None
    assert stem["params_trainable"] is None and stem["first_step"] is None and stem["removed_step"] is None
    assert seen["modules"][2]["params_total"] is None and seen["modules"][2]["type_module"] is None
    assert 99 not in seen["modules"] and 98 not in seen["modules"]          # a bad key: the row is not there
    header = json.dumps(seen["details"][1].header, default=lambda c: c.to_plotly_json())
    assert "unknown parameters" in header and "unknown children" in header
    store = seen["store"]
    assert sorted(s for s in store.sampled_steps(0)) == [0, 2, 3, 4, 5]       # step 'x', -1, 1e300 gone; 1: sampled=2
    loss = store.loss_series(0)
    assert None not in loss["step"] and all(v is None or abs(v) < 1e308 for v in loss["loss"])
    series = store.module_series(0, 1)
    at1 = series["step"].index(1)
    assert series["mean"][at1] is None and series["std"][at1] is None and series["dead_frac"][at1] is None
    assert series["out_grad_norm"][at1] is None and series["nonfinite"][at1] is None
    for hist in seen["hists"]:
        assert all(len(c) == schema.HIST_BINS for c in hist["counts"]) and not {1, 2, 3} & set(hist["step"])
    params = store.module_params(0, 1)
    assert params and all(p["numel"] is None and p["shape"] is None and p["aliases"] == [] and p["lr"] is None
                          and p["requires_grad"] is None and p["moved"] is None for p in params)
    first = next(f for f in store.findings(0, active=None) if f["severity"] == "42")
    assert first["severity"] == "42" and first["message"] == store_guard.UNKNOWN and first["evidence"] is None
    assert first["active"] is None and first["count"] is None and first["fix"] is None
    assert all(isinstance(f["code"], str) for f in store.findings(0, active=None))
    error = next(e for e in store.probe_errors(0) if e["error_type"] == "ValueError")
    assert error["count"] is None and error["message"] is None and error["first_step"] is None
    assert "unknown" in seen["report"]


def test_json_nested_deeper_than_modscope_writes_reads_as_unknown(tmp_path):
    p = tmp_path / "modscope.sqlite"
    synth_store.demo(p, steps=3)
    conn = sqlite3.connect(p)
    conn.execute("UPDATE findings SET evidence = ?", ("[" * 40 + "]" * 40,))
    conn.commit()
    conn.close()
    assert all(f["evidence"] is None for f in Store.open_snapshot(p).findings(0))
    assert store_guard.loads_json("[" * 5000 + "]" * 5000, "default") == "default"     # no RecursionError


def test_a_read_returning_more_text_than_the_budget_is_refused(tmp_path, monkeypatch):
    p = long_finding_paths(tmp_path / "long.sqlite", size=300_000, count=4)
    monkeypatch.setattr(store_guard, "MAX_QUERY_BYTES", 1_000_000)
    assert refusal(lambda: Store.open_snapshot(p).findings(0)) == (
        f"{p}: one read returned more than 1,000,000 characters of text; modscope writes far less (refused)")


def test_values_longer_than_a_store_may_hold_are_refused(tmp_path):
    p = long_finding_paths(tmp_path / "long.sqlite", size=schema.MAX_VALUE_BYTES + 10, count=2)
    assert refusal(lambda: Store.open_snapshot(p).findings(0)) == (
        f"{p}: holds a string or blob longer than 1,000,000 bytes; modscope writes none (refused)")


# -- long strings where they are shown ----------------------------------------------------------------------
def test_long_strings_are_cut_where_they_are_shown_and_whole_where_asked_for(tmp_path):
    p = tmp_path / "modscope.sqlite"
    synth_store.demo(p, steps=3)
    plain_report = len(build_report(RunDir.open(p, live=False).run(), 0))
    long_path = "encoder." + "x" * 400_000          # name and path: a row under the 1 MB a read may build
    conn = sqlite3.connect(p)
    conn.execute("UPDATE modules SET name = ?, path = ? WHERE module_id = 1", (long_path, long_path))
    conn.execute("UPDATE findings SET message = ?, path = ? WHERE rowid = 1", ("m" * 300_000, long_path))
    conn.commit()
    conn.close()
    seen = read_all(p)
    row = next(r for r in seen["tree"] if r["id"] == 1)
    assert len(row["label"]) <= LABEL_MAX and len(row["path"]) <= TITLE_MAX
    header = json.dumps(seen["details"][1].header, default=lambda c: c.to_plotly_json())
    assert "show the first 100,000 of 400,008 characters" in header and len(header) < 110_000
    card = json.dumps(finding_card(next(f for f in seen["findings"] if f["path"] == long_path), opens_module=True),
                      default=lambda c: c.to_plotly_json())
    assert "show the first 100,000 of 300,000 characters" in card and len(card) < 110_000
    assert len(seen["report"]) < plain_report + 250_000            # cut: names, tooltips, one "show all"


def test_a_20000_character_run_name_is_cut_in_the_run_selector_and_in_file_names(tmp_path):
    long_run_name(tmp_path / "modscope-named-rank0.sqlite")
    info = RunDir.open(tmp_path, live=False).runs()[0]
    assert len(info.label()) < 300
    assert file_part("n" * 20_000) == "n" * 80


# -- ids from a request ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["x", 10**30, -1, None, [1], 1.5, True, "1" * 40])
def test_a_click_with_a_bad_module_id_is_no_click(tmp_path, bad):
    p = tmp_path / "modscope.sqlite"
    synth_store.demo(p, steps=3)
    store = Store.open_snapshot(p)
    with pytest.raises(PreventUpdate):
        modules.handle_click(store, {"action": "toggle", "id": bad}, None, 0, ["", 0])
    assert store_guard.valid_id(bad) is None
    assert store_guard.valid_id("12") == 12 and store_guard.valid_id(7) == 7


# -- the page's shell ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_shell_of_a_hostile_store_served_alone_loads(tmp_path, name):
    """What ``--snapshot FILE`` serves, the layout every page load builds (its failure is "Error loading layout"):
    built, or the store refused at open in one line (the command line's exit 2)."""
    store = HOSTILE[name](tmp_path / f"modscope-{name}-rank0.sqlite")
    try:
        opened = Store.open_snapshot(store)
    except StoreError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(str(store))
        return
    layout = create_app(AppConfig(mode="review", store=opened)).layout()
    text = json.dumps(layout, default=lambda c: c.to_plotly_json())
    assert len(text) < 200_000
