"""The app without a browser: command line errors, token check, report, page builders, the
shell's poll, the callback guard, and the rule that the dashboard imports neither torch nor
anything of probes but the torch-free contract (probes.schema)."""

from __future__ import annotations

import html
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from bench import synth_store
from dashboard.read.run import RunDir
from dashboard.read.store import Store
from dashboard.web import figures
from dashboard.web.config import ServedAt
from dashboard.web.pages import compare as compare_page
from dashboard.web.pages import findings as findings_page
from dashboard.web.pages import modules as modules_page
from dashboard.web.pages import overview as overview_page
from dashboard.web.report import build_report
from dashboard.web.security import is_loopback
from dashboard.web.server import AppConfig, create_app
from probes import schema

REPO = Path(__file__).resolve().parents[2]


def run_app(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "app.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO), check=False)


@pytest.fixture
def demo_snapshot(tmp_path) -> Path:
    p = tmp_path / "run" / "modscope.sqlite"
    synth_store.demo(p, steps=20)
    return p


# -- command line ---------------------------------------------------------------------------------
def bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    notdb = tmp_path / "notdb.sqlite"
    notdb.write_text("plain text")
    newer = tmp_path / "newer" / "modscope.sqlite"
    synth_store.demo(newer, steps=1)
    c = sqlite3.connect(str(newer))
    c.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    c.commit()
    c.close()
    corrupt = tmp_path / "corrupt.sqlite"
    good = tmp_path / "good" / "modscope.sqlite"
    synth_store.demo(good, steps=30)
    data = bytearray(good.read_bytes())
    corrupt.write_bytes(bytes(data[: len(data) // 3]))
    return {
        "missing": (tmp_path / "missing.sqlite", "no such file"),
        "not sqlite": (notdb, "not an SQLite file"),
        "newer schema": (newer, f"written by schema version {schema.SCHEMA_VERSION + 1}, this dashboard reads up "
                                f"to {schema.SCHEMA_VERSION}"),
        "corrupt": (corrupt, "corrupt SQLite file"),
    }


@pytest.mark.parametrize("how", ["--snapshot", "export", "--compare"])
def test_bad_files_exit_2_with_one_line(tmp_path, how):
    for name, (path, problem) in bad_files(tmp_path).items():
        if how == "export":
            r = run_app("export", "--snapshot", str(path), "-o", str(tmp_path / "r.html"))
        elif how == "--compare":
            r = run_app("--compare", str(path), str(path), "--port", "1")
        else:
            r = run_app(how, str(path), "--port", "1")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (name, r.stderr)
        assert len(lines) == 1 and "Traceback" not in r.stderr, (name, r.stderr)
        assert str(path) in lines[0] and problem in lines[0], (name, lines[0])


def test_run_with_newer_schema_is_refused(tmp_path):
    path, problem = bad_files(tmp_path)["newer schema"]
    r = run_app("--run", str(path.parent), "--port", "1")
    assert r.returncode == 2 and problem in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_export_writes_a_standalone_report(tmp_path, demo_snapshot):
    out = tmp_path / "report.html"
    r = run_app("export", "--run", str(demo_snapshot.parent), "-o", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "<script src" not in text and "<link" not in text
    assert "Plotly" in text and "encoder.blocks[0]" in text and "unregistered-module" in text


def test_export_of_a_run_not_written_yet(tmp_path):
    r = run_app("export", "--run", str(tmp_path / "nothing"), "-o", str(tmp_path / "r.html"))
    assert r.returncode == 2 and "no store yet" in r.stderr


def test_bad_port_and_usage(tmp_path, demo_snapshot):
    r = run_app("--snapshot", str(demo_snapshot), "--port", "70000")
    assert r.returncode == 2 and "not a port number" in r.stderr
    r = run_app("--snapshot")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_dashboard_needs_no_torch_and_only_the_schema_of_probes(demo_snapshot, tmp_path):
    """Without torch (blocked), every dashboard module imports, a snapshot opens, the report and the
    app build: of probes only the torch-free contract (probes.schema, and the stdlib module it calls) is loaded."""
    code = (
        "import sys, builtins, pkgutil, importlib\n"
        "sys.modules['torch'] = None\n"                 # as if torch were not installed
        "real = builtins.__import__\n"
        "def guard(name, globals=None, locals=None, fromlist=(), level=0):\n"
        "    if level == 0 and name.split('.')[0] == 'torch':\n"
        "        raise ImportError('blocked: ' + name)\n"
        "    if level == 0 and name.startswith('probes.') and name != 'probes.schema':\n"
        "        raise ImportError('blocked: ' + name)\n"
        "    return real(name, globals, locals, fromlist, level)\n"
        "builtins.__import__ = guard\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import app, dashboard\n"
        "for m in pkgutil.walk_packages(dashboard.__path__, 'dashboard.'):\n"
        "    importlib.import_module(m.name)\n"
        "from dashboard.read.store import Store\n"
        "from dashboard.web.report import build_report\n"
        "import dashboard.web.server\n"
        "s = Store.open_snapshot(sys.argv[2])\n"
        "build_report(s)\n"
        "dashboard.web.server.create_app(dashboard.web.server.AppConfig(mode='review', store=s)).layout()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'probes') and sys.modules[m])\n"
        # the schema's stdlib parts (the path grammar, the status file, the state-dict key prefixes, the read guard and
        # the snapshot)
        "assert loaded == ['probes', 'probes._compat', 'probes._version', 'probes.paths', 'probes.schema', "
        "'probes.state_dict_keys', 'probes.store_copy', 'probes.writer_status'], loaded\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code, str(REPO), str(demo_snapshot)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_sql_only_on_the_read_side():
    pattern = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE)\b\s+[\w*(]")
    offenders = []
    for p in (REPO / "dashboard").rglob("*.py"):
        if p.parent.name == "read":
            continue
        if pattern.search(p.read_text()) or "sqlite3" in p.read_text():
            offenders.append(p.name)
    assert offenders == []


# -- token ---------------------------------------------------------------------------------------
def test_token_check(demo_snapshot):
    token = "T0k-0123456789abcdef"                               # (the rest: tests/dashboard/test_security.py)
    app = create_app(AppConfig(mode="review", store=Store.open_snapshot(demo_snapshot),
                               served=ServedAt("0.0.0.0", 8050, token)))
    client = app.server.test_client()
    assert client.get("/").status_code == 401
    assert client.get("/_dash-layout").status_code == 401
    assert client.get("/?token=bad").status_code == 401
    r = client.get(f"/?token={token}")                           # sets the cookie, then drops the token from the URL
    assert r.status_code == 200 and f"modscope_token_8050={token}" in r.headers.get("Set-Cookie", "")
    assert client.get("/_dash-layout").status_code == 200        # the cookie now
    fresh = app.server.test_client()
    assert fresh.get("/_dash-layout", headers={"X-Modscope-Token": token}).status_code == 200
    assert fresh.get("/_dash-layout", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_loopback_needs_no_token(demo_snapshot):
    app = create_app(AppConfig(mode="review", store=Store.open_snapshot(demo_snapshot)))
    assert app.server.test_client().get("/").status_code == 200
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")


# -- escaping ------------------------------------------------------------------------------------
EVIL = "<script>alert(1)</script>"


def test_report_escapes_user_strings(tmp_path):
    st = synth_store.SynthStore(tmp_path / "modscope.sqlite", run_name=EVIL, model_class=EVIL)
    root = st.add_module("", None, "", EVIL, params=1)
    m = st.add_module("x</script>", root, "x</script>", EVIL, kind="unregistered", params=1)
    st.commit()
    st.add_finding("unregistered-module", "x</script>", "error", m, EVIL, EVIL, {"k": EVIL})
    st.add_steps(3)
    st.close()
    text = build_report(Store.open_snapshot(tmp_path / "modscope.sqlite"))
    assert EVIL not in text
    assert "x</script>" not in text
    assert html.escape(EVIL) in text


def test_pages_render_user_strings_as_text(tmp_path):
    """Dash renders children as text; make sure no page uses raw HTML (dangerously_allow_html)."""
    for p in (REPO / "dashboard").rglob("*.py"):
        body = p.read_text()
        assert "dangerously_allow_html" not in body and "DangerouslySetInnerHTML" not in body, p
        assert "dcc.Markdown" not in body, p


# -- page builders and figures (pure) ----------------------------------------------------------------
def test_page_builders(demo_snapshot, tmp_path):
    s = Store.open_snapshot(demo_snapshot)
    cards = overview_page.overview_cards(s.overview())
    assert len(cards) >= 8
    tree, info = modules_page.build_tree(s, 0, s.default_expanded(), None)
    assert info == "7 nodes shown" and len(tree["rows"]) == 7
    results, info = modules_page.build_results(s, 0, "blocks", None, None)
    assert info == "3 matches" and [r["label"] for r in results["rows"]] == [f"encoder.blocks[{i}]" for i in range(3)]
    assert findings_page.finding_list(s.findings(), ["error"])
    assert findings_page.finding_list([], ["error"])[0].children == "No findings. ✓"
    synth_store.demo(tmp_path / "after" / "modscope.sqlite", fixed=True, steps=5)
    from dashboard.read.compare import compare_stores
    cmp = compare_stores(s, Store.open_snapshot(tmp_path / "after" / "modscope.sqlite"))
    assert compare_page.modules_table(cmp, True, ("before", "after"))
    create_app(AppConfig(mode="compare", store=s, store_b=s))



def test_findings_tab_count_comes_with_the_page(demo_snapshot, tmp_path):
    """The number of active root causes next to "Findings" is in the page as it is loaded: the shell's
    callback only follows changes of the tick, and a closed run or a snapshot never changes."""
    from dashboard.read.run import fold_causes, root_counts
    from dashboard.web import ids
    s = Store.open_snapshot(demo_snapshot)
    errors = root_counts(fold_causes(RunDir.from_store(s).run().findings_merged(active=True, rank=0)))["error"]
    assert errors > 0
    for config in (AppConfig(mode="review", store=s), AppConfig(mode="live", store=RunDir.open(demo_snapshot.parent))):
        count = create_app(config).layout()[ids.NAV_COUNT]
        assert (count.children, count.className) == (str(errors), "nav-count sev-error")
    waiting = create_app(AppConfig(mode="live", store=RunDir.open(tmp_path / "not-yet"))).layout()[ids.NAV_COUNT]
    assert (waiting.children, waiting.className) == ("", "nav-count")


def test_findings_are_drawn_as_the_user_left_them(tmp_path):
    """The Findings page draws the evidence and consequences the user opened open again (the list is
    drawn again on every poll of a live run); a toggle reported by the page's script opens or closes one."""
    from dash import html

    from dashboard.web.components import details_key
    path = tmp_path / "three" / "modscope.sqlite"
    synth_store.three_layers(path)            # 3 root causes with evidence, each with 4 consequences
    items = RunDir.from_store(Store.open_snapshot(path)).run().folded_findings(active=True, rank=0)
    cause = items[1]
    evidence, consequences = details_key("evidence", cause), details_key("consequences", cause)
    # the browser reports the whole set after each toggle: the latest wins, whatever the server drew last
    keys = findings_page.toggled([evidence], {"keys": [evidence, consequences], "t": 2})
    assert keys == [evidence, consequences]
    assert findings_page.toggled(keys, {"keys": [consequences], "t": 3}) == [consequences]
    assert findings_page.toggled(keys, None) == keys                      # a poll: what was drawn stays
    assert findings_page.toggled(None, None) == [] and findings_page.toggled(["a", 1], {"keys": [2, "b"]}) == ["b"]

    def drawn(opened):
        out = html.Div(findings_page.finding_list(items, ["error", "warning", "info"], opened=opened))
        props = [d.to_plotly_json()["props"] for d in out._traverse() if isinstance(d, html.Details)]
        return {p["data-open-key"]: (bool(p.get("open")), p["data-open"]) for p in props}
    assert set(drawn(set()).values()) == {(False, "false")}
    now = drawn(set(keys))
    assert now[evidence] == now[consequences] == (True, "true")
    assert sum(is_open for is_open, _ in now.values()) == 2


def test_findings_page_keeps_what_was_opened_in_the_tabs_session(demo_snapshot):
    """The toggles' store lives in the tab's sessionStorage (the page is built anew after another page:
    its restored value, an input of the list, draws open again what was); the list's own copy does not."""
    from dash import dcc

    from dashboard.web import ids
    config = AppConfig(mode="review", store=Store.open_snapshot(demo_snapshot))
    stores = {c.id: c for c in findings_page.layout(config)._traverse() if isinstance(c, dcc.Store)}
    assert stores[ids.FINDINGS_TOGGLE].storage_type == "session"
    assert getattr(stores[ids.FINDINGS_OPEN], "storage_type", "memory") == "memory"


def props_of(component) -> dict:
    return component.to_plotly_json()["props"]


def test_a_finding_opens_its_module_by_a_button_of_its_own(tmp_path):
    """A finding card holds toggles (evidence, consequences): the card is no control (no role, no tab stop,
    the mouse's click only); its path is the native button that opens the module, and so is each of its
    consequences'. A finding without a module has no button, and a click on it opens nothing."""
    from dash import html

    from dashboard.web import ids
    from dashboard.web.components import finding_card
    path = tmp_path / "three" / "modscope.sqlite"
    synth_store.three_layers(path)
    items = RunDir.from_store(Store.open_snapshot(path)).run().folded_findings(active=True, rank=0)
    cause = items[0]
    card = findings_page.finding_list(items, ["error", "warning", "info"])[1]
    cards = [c for c in card._traverse() if isinstance(c, html.Div) and "finding " in f"{c.className} "]
    assert len(cards) == 4                                                # its consequences
    for c, f in zip([card, *cards], [cause, *cause["consequences"]], strict=True):
        own = props_of(c)
        assert not {"role", "tabIndex", "aria-label"} & set(own) and own["data-action"] == ids.ClickAction.OPEN
        [button] = [b for b in c.children[0].children if isinstance(b, html.Button)]
        b = props_of(button)
        assert (b["data-action"], b["data-mid"], b["type"]) == ("open", str(f["module_id"]), "button")
        where = schema.display_path(f["path"])
        assert button.children == where and b["aria-label"] == f"{f['code']} at {where}: show this module"
        assert "finding-open" in b["className"] and b["data-focus-key"]
    assert props_of(card)["data-mid"] == str(cause["module_id"])
    # nothing inside a control: the buttons hold text only
    assert all(isinstance(b.children, str) for b in card._traverse() if isinstance(b, html.Button))
    # no module: no button, a click on it opens nothing (nor the card around it)
    orphan = finding_card({**cause, "module_id": None, "consequences": []}, opens_module=True)
    assert not [b for b in orphan._traverse() if isinstance(b, html.Button)]
    assert props_of(orphan)["data-mid"] == "-1" and "clickable" not in orphan.className
    # a module's detail (cards that open nothing): no click, no button
    plain = finding_card(cause)
    assert "data-action" not in props_of(plain) and not [b for b in plain._traverse() if isinstance(b, html.Button)]
    # the Overview's top findings: each a button with nothing interactive inside
    top = overview_page.top_findings(items)
    assert [type(t) for t in top] == [html.Button] * 3
    for t in top:
        tp = props_of(t)
        assert tp["data-action"] == "open" and tp["type"] == "button" and tp["data-focus-key"]
        assert tp["aria-label"].endswith("4 consequences: show this module")
        assert not [x for x in t._traverse() if isinstance(x, (html.Button, html.A, html.Details))]


def test_module_detail_is_drawn_as_the_user_left_them(tmp_path):
    """The open module's detail is drawn again on every poll of a live run: the evidence the user opened
    in its findings is drawn open in the whole detail, in a poll's increment, and in the findings alone
    (drawn again for a toggle); the detail panel names the store its script reports toggles into."""
    from dash import Patch, html, no_update

    from dashboard.web import ids
    from dashboard.web.components import details_key, toggled
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=5, live=True)
    run = RunDir.from_store(Store.open_run(tmp_path)).run()
    mid = run.at(0).search_modules(0, "encoder.blocks[1]", None, 1)["items"][0]["module_id"]
    unregistered, stale = modules_page.module_findings(run, 0, mid)            # both with evidence
    closed, opened = details_key("evidence", unregistered), details_key("evidence", stale)
    keys = set(toggled([], {"keys": [opened], "t": 1}))

    def drawn(section):
        props = [d.to_plotly_json()["props"] for d in section._traverse() if isinstance(d, html.Details)]
        return {p["data-open-key"]: (bool(p.get("open")), p["data-open"]) for p in props}
    want = {closed: (False, "false"), opened: (True, "true")}
    full = modules_page.detail_full(run, 0, mid, keys)
    assert drawn(full.findings) == want
    st.add_steps(2)
    inc = modules_page.detail_increment(run, 0, mid, full.state, keys)
    assert isinstance(inc.chart, Patch) and drawn(inc.findings) == want
    alone = modules_page.detail_findings(run, 0, mid, set())
    assert drawn(alone.findings) == {closed: (False, "false"), opened: (False, "false")}
    assert all(out is no_update for out in alone._replace(findings=no_update))
    st.close()
    config = AppConfig(mode="review", store=Store.open_snapshot(tmp_path / "modscope.sqlite"))
    panel = next(c for c in modules_page.layout(config)._traverse()
                 if getattr(c, "className", None) == "panel detail-panel")
    assert panel.to_plotly_json()["props"]["data-toggle-store"] == ids.DETAIL_TOGGLE
    assert {ids.DETAIL_OPEN, ids.DETAIL_TOGGLE} <= {getattr(c, "id", None) for c in panel._traverse()}



def test_heat_map_drawn_again_keeps_its_layout():
    """The open module's heat map drawn again (new samples) changes its data only (a Patch): the layout,
    where plotly keeps the user's zoom, stays; another module's, or the first real one, is a new figure."""
    from dash import Patch, no_update
    heat = figures.heatmap_figure({"step": [0, 1], "counts": [[1, 2], [2, 1]], "edges": [-1.0, 0.0, 1.0]}, "r-0-4")
    shows = {"key": "r-0-4", "has_data": True}
    again = modules_page.heat_update(heat, "r-0-4", shows)
    assert isinstance(again[0], Patch) and again[1] is no_update
    assert again[0].to_plotly_json()["operations"] == [
        {"operation": "Assign", "location": ["data"], "params": {"value": heat["data"]}}]
    assert modules_page.heat_update(heat, "r-0-4", None) == (heat, shows)
    assert modules_page.heat_update(heat, "r-0-4", {"key": "r-0-5", "has_data": True}) == (heat, shows)
    assert modules_page.heat_update(heat, "r-0-4", {"key": "r-0-4", "has_data": False}) == (heat, shows)
    empty = figures.heatmap_figure({"step": [], "counts": []}, "r-0-4")
    assert modules_page.heat_update(empty, "r-0-4", {"key": "r-0-4", "has_data": False}) == (
        empty, {"key": "r-0-4", "has_data": False})

def test_figures_are_pure_and_escaped():
    series = {"step": [0, 1, 2], "mean": [0.1, 0.2, 0.3], "std": [1, 1, 1], "dead_frac": [0, 0, 0],
              "sat_frac": [0, 0, 0], "zero_frac": [0, 0, 0], "out_grad_norm": [1.0, 0.1, 0.01]}
    assert len(figures.activation_figure(series, "r")["data"]) == 2
    assert len(figures.fractions_figure(series, "r")["data"]) == 3
    assert figures.grad_figure(series, "r")["layout"]["yaxis"]["type"] == "log"
    assert figures.loss_figure({"step": [], "loss": []})["layout"]["annotations"]
    edges = [-1.0, 0.0, 1.0]
    heat = figures.heatmap_figure({"step": [0, 1], "counts": [[1, 2, 3, 4], [4, 3, 2, 1]], "edges": edges}, "r")
    assert len(heat["data"][0]["z"]) == 4
    import plotly.graph_objects as go
    for fig in (heat, figures.activation_figure(series, "r"), figures.detail_series_figure(series, "r"),
                figures.loss_figure({"step": [0, 1], "loss": [1.0, 0.5]}), figures.empty_figure("x")):
        go.Figure(fig)   # valid plotly figures (validated here, not on every request)
    assert len(figures.bin_labels(edges)) == 4
    assert figures.plot_text("<b>x</b>") == "&lt;b&gt;x&lt;/b&gt;"
    assert figures.fmt_num(float("nan")) == "NaN" and figures.fmt_count(1_500_000) == "1.5M"


def test_live_detail_update_extends_or_redraws(tmp_path):
    """Live: the open module's chart (three panels, one figure) is extended with the new steps only
    (Patch); while its grad panel is still a placeholder (no gradients yet) it is drawn whole instead."""
    from dash import Patch
    st = synth_store.demo(tmp_path / "modscope.sqlite", steps=5, live=True)
    s = RunDir.from_store(Store.open_run(tmp_path)).run()
    full = modules_page.detail_full(s, 0, 1)
    assert full.state["last"] == 4 and full.state["has_grad"]
    st.add_steps(2)
    inc = modules_page.detail_increment(s, 0, 1, full.state)
    assert isinstance(inc.chart, Patch) and inc.state["last"] == 6
    st.add_steps(1)
    redraw = modules_page.detail_increment(s, 0, 1, {**inc.state, "has_grad": False})
    assert isinstance(redraw.chart, dict) and len(redraw.chart["data"]) == 6 and redraw.state["has_grad"]
    assert modules_page.detail_full(s, 0, 999).header[0].children == "Module 999 is not in this store."
    st.close()


def test_port_in_use(demo_snapshot):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = run_app("--snapshot", str(demo_snapshot), "--port", str(port))
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr
    assert "modscope dashboard:" not in r.stdout           # no URL printed for a server that is not there


def _text(component) -> str:
    """The text a component tree draws."""
    if isinstance(component, (list, tuple)):
        return " ".join(_text(c) for c in component)
    if isinstance(component, (str, int, float)):
        return str(component)
    return _text(getattr(component, "children", None) or [])


def test_module_detail_lists_a_tied_weight_and_names_the_optimizer(tmp_path):
    """lm_head owns transformer.wte.weight by its alias: the detail lists it (shared, with its
    statistics) and says where it is counted, never "owns no parameters"; with two optimizers the
    "in optimizer" column names the one holding each tensor."""
    from dash import html
    st = synth_store.SynthStore(tmp_path / "modscope.sqlite", run_name="tied", model_class="GAN")
    root = st.add_module("", None, "", "GAN", params=4096 + 64)
    wte = st.add_module("wte", root, "wte", "Embedding", params=4096)
    st.add_param(wte, "wte.weight", "weight", [128, 32], aliases=["lm_head.weight"])
    head = st.add_module("lm_head", root, "lm_head", "Linear", params=0, trainable=0, in_opt=0)
    d = st.add_module("D", root, "D", "Linear", params=64)
    st.add_param(d, "D.weight", "weight", [2, 32])
    st.commit()
    st.add_steps(2)
    st.close()
    run = RunDir.from_store(Store.open_snapshot(st.path)).run()
    full = modules_page.detail_full(run, 0, head)
    params = _text(html.Div(full.params))
    assert "owns no parameters" not in params and "weight" in params and "same tensor as wte.weight" in params
    assert "+ 4,096 shared with wte.weight (counted there)" in _text(html.Div(full.header))
    assert "yes (group 0, lr 0.01)" in params                         # one optimizer: no number
    conn = sqlite3.connect(st.path)
    conn.execute("UPDATE params SET opt_index = 1 WHERE path = 'D.weight'")
    conn.commit()
    conn.close()
    run = RunDir.from_store(Store.open_snapshot(st.path)).run()
    assert "yes (optimizer 1, group 0, lr 0.01)" in _text(html.Div(modules_page.detail_full(run, 0, d).params))
    assert "yes (optimizer 0, group 0" in _text(html.Div(modules_page.detail_full(run, 0, wte).params))


def test_module_detail_shows_the_same_folded_card_as_the_findings_page(tmp_path):
    """A root cause on `head` whose consequences are drawn on `head` and on the root: the module's
    detail shows it with all three, as the Findings page and the Overview do."""
    st = synth_store.SynthStore(tmp_path / "modscope.sqlite", run_name="bugs")
    ids = synth_store.demo_model(st)
    cause = ("not-in-optimizer", "head.bias")
    st.add_finding(*cause, "error", ids["head"], "head.bias is in no optimizer.")
    st.add_finding("not-updating", "head.bias", "error", ids["head"], "never changes", cause=cause)
    st.add_finding("grad-accumulating", "head.bias", "warning", ids["head"], "never zeroed", cause=cause)
    st.add_finding("stale-optimizer-param", "optimizer.param_groups[0]['params'][7]", "warning", ids[""],
                   "the optimizer holds a tensor the model no longer has", cause=cause)
    st.add_steps(2)
    st.close()
    run = RunDir.from_store(Store.open_snapshot(st.path)).run()
    [page_card] = [f for f in run.folded_findings(active=None, rank=0) if (f["code"], f["path"]) == cause]
    assert len(page_card["consequences"]) == 3
    assert modules_page.module_findings(run, 0, ids["head"]) == [page_card]
    # the root shows the card too (one of its consequences is drawn there), whole
    assert page_card in modules_page.module_findings(run, 0, ids[""])
