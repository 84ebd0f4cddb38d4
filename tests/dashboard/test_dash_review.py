"""What a review of the dashboard against real runs found (a head swapped and a block popped mid-run), at the
level of the data and the page builders: no torch, of probes only ``probes.schema``."""

from __future__ import annotations

from test_dash_app import _text
from test_dash_data import removed_store

from dashboard.components import finding_card
from dashboard.data import Store
from dashboard.pages import findings as findings_page
from dashboard.pages import overview as overview_page
from dashboard.run import RunDir


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
