"""Modules removed mid-run (a head swapped, a block popped) and what the pages say of them, at the level of the
data and the page builders: no torch, of probes only ``probes.schema``."""

from __future__ import annotations

from test_dash_app import _text
from test_dash_data import removed_store

from dashboard.read.run import RunDir
from dashboard.read.store import Store
from dashboard.web.components import finding_card
from dashboard.web.pages import findings as findings_page
from dashboard.web.pages import overview as overview_page


def test_a_finding_about_a_removed_module_says_so_not_resolved(tmp_path):
    """The old head's finding ended when the head was replaced: nothing was fixed. Its card (Findings page with
    "show resolved", the module's detail) says "module removed at step 10", not "resolved"; a resolved finding of a
    module still in the model still says "resolved"."""
    st, ids = removed_store(tmp_path / "modscope.sqlite")
    st.add_finding("dead-units", "stem", "warning", ids["stem"], "fixed since", active=0)
    st.commit()
    s = Store.open_run(tmp_path)
    [old] = s.findings(active=False, module_id=ids["head"])
    assert old["module_removed_step"] == 10
    assert [f["module_removed_step"] for f in s.findings(active=False, module_id=ids["stem"])] == [None]
    run = RunDir.from_store(s).run()
    merged = {f["path"]: f for f in run.findings_merged(active=None)}
    assert merged["head.weight"]["module_removed_step"] == 10 and merged["stem"]["module_removed_step"] is None
    card = _text(finding_card(merged["head.weight"], opens_module=True))
    assert "module removed at step 10" in card and "resolved" not in card
    assert "resolved" in _text(finding_card(merged["stem"], opens_module=True))
    page = _text(findings_page.finding_list(run.folded_findings(active=None), ["error", "warning", "info"]))
    assert "module removed at step 10" in page
    st.close()


def test_overview_counts_the_modules_removed_during_the_run(tmp_path):
    """The Overview's module count is the model as it is now; the modules that left it are counted beside it, as
    the HTML report's overview does ("Modules removed during the run")."""
    st, _ = removed_store(tmp_path / "modscope.sqlite")
    ov = Store.open_run(tmp_path).overview()
    cards = _text(overview_page.overview_cards(ov))
    assert "all registered · 2 removed during the run" in cards
    st.close()


def test_compare_summary_tells_apart_the_values_it_highlights():
    """Compare highlighted "final loss 1.39 | 1.39" as changed (1.3874 and 1.3901): two values that differ are
    shown with the digits that tell them apart; equal ones, and integers, as before."""
    from dashboard.web.pages import compare as compare_page
    cmp = {"a": {"path": "a"}, "b": {"path": "b"}, "summary": [
        {"metric": "final loss", "a": 1.3874, "b": 1.3901, "changed": True},
        {"metric": "last step", "a": 79, "b": 79, "changed": False},
        {"metric": "held by optimizer", "a": 3712, "b": 3844, "changed": True},
        {"metric": "std", "a": 0.25, "b": 0.25, "changed": False},
        {"metric": "model class", "a": "Net", "b": "Net", "changed": False}]}
    text = _text(compare_page.summary_table(cmp, ["before", "after"]))
    assert "1.387 1.39" in text                      # the first digits that differ
    assert "79 79" in text and "3,712 3,844" in text and "0.25 0.25" in text and "Net Net" in text


def test_report_says_what_the_header_says_of_the_writer(tmp_path):
    """The HTML report of a run whose training process is gone said "Status running" (the store's own word, as
    nobody closed it) where the dashboard says "ended without close (process gone)"; a snapshot taken while it
    ran says "running when copied" in both."""
    import re
    import subprocess
    import sys

    from bench import synth_store
    from dashboard.web.report import build_report
    from probes import schema
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run = tmp_path / "run"
    st = synth_store.demo(run / schema.store_filename("r1", 0), steps=4, live=True)
    st.set_rank(pid=gone.pid)

    def status(html_text: str) -> list[str]:
        return re.findall(r"<th>Status</th><td>([^<]*)</td>", html_text)
    assert status(build_report(RunDir.open(run))) == ["ended without close (process gone)"]
    snap = tmp_path / "snap.sqlite"
    snap.write_bytes(RunDir.open(run).run().snapshot_bytes())
    assert status(build_report(Store.open_snapshot(snap))) == ["running when copied"]
    st.conn.close()


def test_a_removed_module_under_a_removed_parent_is_drawn_where_it_was_when_selected(tmp_path):
    """model.blocks.pop(3) removes blocks.3 and its ReLU blocks.3.1; the ReLU's dead-units finding opens it. The
    head (its parent, the root, still there) was drawn where it was; the ReLU was not drawn at all (its parent
    is no longer in the tree): 9 rows, none selected. It is drawn under its parent, itself drawn where it was."""
    from dashboard.web.pages import modules as modules_page
    st, ids = removed_store(tmp_path / "modscope.sqlite")
    act = st.add_module("encoder.blocks.2.act", ids["encoder.blocks.2"], "act", "ReLU")
    st.conn.execute("UPDATE modules SET removed_step = 10 WHERE module_id = ?", (act,))
    st.conn.execute("UPDATE modules SET n_children = 1 WHERE module_id = ?", (ids["encoder.blocks.2"],))
    st.commit()
    s = Store.open_run(tmp_path)
    expanded = [ids[""], ids["encoder"], ids["encoder.blocks"], ids["encoder.blocks.2"]]
    data, _ = modules_page.build_tree(s, 0, expanded, act)
    rows = [(r["path"], r["kind"], r["selected"]) for r in data["rows"]]
    assert ("encoder.blocks.2", "removed", False) in rows and ("encoder.blocks.2.act", "removed", True) in rows
    assert rows.index(("encoder.blocks.2.act", "removed", True)) == rows.index(("encoder.blocks.2", "removed",
                                                                                False)) + 1
    # another selection: neither is drawn (the model as it is now)
    data, _ = modules_page.build_tree(s, 0, expanded, ids["stem"])
    assert not [r for r in data["rows"] if r["kind"] == "removed"]
    st.close()


def test_a_module_inside_torchscript_says_why_it_has_no_samples(tmp_path):
    """A TorchScript submodule's children run in TorchScript (no hook sees them): on a closed run their detail
    said "No activation samples for this module yet." as if they would come. It says where they run; a module
    not called yet still says "yet"."""
    from bench import synth_store
    from dashboard.web.pages import modules as modules_page
    path = tmp_path / "modscope.sqlite"
    st = synth_store.demo(path, steps=3, live=True)
    root = st.modules[0]["module_id"]
    scripted = st.add_module("scripted", root, "scripted", "RecursiveScriptModule", params=32, relu=False)
    fc = st.add_module("scripted.fc", scripted, "fc", "RecursiveScriptModule", params=32, relu=False)
    idle = st.add_module("idle", root, "idle", "Linear", params=4, relu=False)
    st.commit()
    st.close()
    run = RunDir.from_store(Store.open_snapshot(path)).run()

    def chart_text(mid: int) -> str:
        fig = modules_page.detail_full(run, 0, mid).chart
        return " ".join(a["text"] for a in fig["layout"].get("annotations", [])).replace("<br>", " ")
    assert "inside the TorchScript module scripted" in chart_text(fc)
    assert chart_text(idle) == "No activation samples for this module yet."
