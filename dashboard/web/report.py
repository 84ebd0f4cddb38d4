"""The standalone HTML report: one self-contained file (CSS and plotly.js inlined, no CDN)
with the overview (and, for a run of several ranks, one line per rank), the module tree of one
rank, the run's findings (merged over its ranks; root causes with their consequences folded under
them, expandable) and the main charts.

Every string from the store is passed through ``html.escape``, and cut (``shown_text``: a long one whole, to
``TITLE_MAX``, in its tooltip; a message whole, to ``FULL_MAX``, under "show all"). The report names the store by
its file name, never the folder it is in (docs/security.md: what a report contains)."""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import plotly.io as pio
from plotly.offline import get_plotlyjs

from probes.schema import ModuleKind, Severity, count_text, display_path

from ..paths import assets_dir
from ..read.caps import findings_cap
from ..read.run import Run, RunDir, as_run_dir, format_ranks, others_note, root_counts
from ..read.shown_text import FULL_MAX, LABEL_MAX, TEXT_MAX, TITLE_MAX, clip, title
from ..read.store import REMOVED, Store, status_text
from . import figures
from .components import badge_specs, cause_text, consequences_text, seen_text, severity_of

MAX_TREE_NODES = 5000
MAX_NESTED_DEPTH = 48      # levels of the report's tree drawn nested
MAX_CHART_MODULES = 8
ASSETS = assets_dir()


def esc(x: object, limit: int = FULL_MAX) -> str:
    """``x`` as HTML text, cut to ``limit`` characters."""
    return html.escape(clip(x, limit), quote=True)


def esc_name(x: object) -> str:
    """A name as HTML: cut to ``shown_text.LABEL_MAX``, whole (to ``TITLE_MAX``) in its tooltip."""
    tip = title(x)
    return f'<span title="{esc(tip)}">{esc(clip(x))}</span>' if tip else esc(x)


def esc_tail(x: object) -> str:
    """A path as HTML, cut at its start to ``LABEL_MAX`` (its end tells modules apart); its last ``TITLE_MAX``
    characters in its tooltip."""
    s = "" if x is None else str(x)
    if len(s) <= LABEL_MAX:
        return esc(s)
    tip = s if len(s) <= TITLE_MAX else "…" + s[1 - TITLE_MAX:]
    return f'<span title="{esc(tip)}">{esc("…" + s[1 - LABEL_MAX:])}</span>'


def esc_text(x: object) -> str:
    """A message as HTML: cut to ``TEXT_MAX``; whole (to ``FULL_MAX``) under "show all"."""
    s = "" if x is None else str(x)
    if len(s) <= TEXT_MAX:
        return esc(s)
    return (f'{esc(s, TEXT_MAX)}<details><summary>show all {len(s):,} characters</summary>'
            f'<pre class="full-text">{esc(s)}</pre></details>')


def _fig_html(fig: dict[str, Any], div_id: str) -> str:
    return str(pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id, validate=False,
                           config=figures.graph_config(responsive=True)))


def _css() -> str:
    parts = []
    for name in ("modscope.css", "report.css"):
        p = ASSETS / name
        if p.exists():
            parts.append(p.read_text(encoding="utf-8"))
    return "\n".join(parts)


def _badges(findings: list[dict[str, Any]], kind: str = ModuleKind.REGISTERED) -> str:
    return "".join(f'<span class="badge sev-{b.severity.value}" title="{esc(b.code)}">{esc(b.label)}</span>'
                   for b in badge_specs(findings, kind))


def _removed_text(m: dict[str, Any]) -> str:
    return f"removed at step {m['removed_step']}: no longer part of the model"


def _tree_html(store: Store, rank: int) -> str:
    """The model as it is now; below it, the modules that left it during the run (each under the module it was
    in, when that one left too), with the step at which they did."""
    mods = store.all_modules(rank, MAX_TREE_NODES)
    if not mods:
        return '<p class="muted">No modules recorded.</p>'
    tree = _forest_html(store, rank, mods)
    note = (f'<p class="muted">First {MAX_TREE_NODES:,} modules shown.</p>'
            if len(mods) >= MAX_TREE_NODES else "")
    gone = store.all_modules(rank, MAX_TREE_NODES, removed=True)
    if gone:
        note += (f'<h3>Removed during the run ({len(gone):,})</h3>'
                 '<p class="muted">No longer part of the model: not in the tree above nor in its counts.</p>'
                 + _forest_html(store, rank, gone, full_paths=True))
    return tree + note


def _forest_html(store: Store, rank: int, mods: list[dict[str, Any]], full_paths: bool = False) -> str:
    """``mods`` as trees (a module whose parent is not among them is a root: labelled by its path with
    ``full_paths``). Built with a stack, not recursion: a model may be nested hundreds of modules deep. Below
    ``MAX_NESTED_DEPTH`` levels a node's descendants are listed flat under it, labelled by their paths (their ends,
    when long: ``esc_tail``; a browser flattens markup nested deeper than a few hundred elements on its own,
    wherever it likes)."""
    own = store.findings_for_modules(rank, [m["module_id"] for m in mods])
    kids: dict[int, list[dict[str, Any]]] = {}
    roots = []
    ids_present = {m["module_id"] for m in mods}
    for m in mods:
        if m["parent_id"] is None or m["parent_id"] not in ids_present:
            roots.append(m)
        else:
            kids.setdefault(m["parent_id"], []).append(m)

    def label(m: dict[str, Any], by_path: bool, deep: bool = False) -> str:
        name = display_path(m["path"]) if by_path or deep else m["name"] or display_path(m["path"])
        kind = (f'<span class="badge kind-{REMOVED}" title="{esc(_removed_text(m))}">{REMOVED} at step '
                f'{esc(m["removed_step"])}</span>' if m.get("removed_step") is not None
                else "" if m["kind"] == ModuleKind.REGISTERED
                else f'<span class="badge kind-{esc(m["kind"], 40)}">{esc_name(m["kind"])}</span>')
        total = m["params_total"]
        params = f'<span class="tree-params">{total:,} params</span>' if isinstance(total, int) and total else ""
        badges = _badges(own.get(m["module_id"], []), m["kind"])
        return (f'<span class="tree-label mono">{esc_tail(name) if deep else esc_name(name)}</span>'
                f'<span class="tree-type">{esc_name(m["type"])}</span>{kind}{badges}{params}')

    out: list[str] = []
    flattened = False
    # items: a module and its depth, or the markup that closes a node once its children are written
    stack: list[tuple[dict[str, Any], int] | str] = [(r, 0) for r in reversed(roots)]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        m, depth = item
        children = kids.get(m["module_id"], [])
        text = label(m, full_paths and depth == 0, depth > MAX_NESTED_DEPTH)
        if not children or depth >= MAX_NESTED_DEPTH:
            out.append(f'<li class="{"leaf " if not children else ""}kind-{esc(m["kind"], 40)}">{text}</li>')
            flattened = flattened or bool(children)
            stack.extend((c, depth + 1) for c in reversed(children))     # written after it, at its level
            continue
        opened = " open" if depth < 2 else ""
        out.append(f'<li class="kind-{esc(m["kind"], 40)}"><details{opened}><summary>{text}</summary><ul>')
        stack.append("</ul></details></li>")
        stack.extend((c, depth + 1) for c in reversed(children))
    note = (f'<p class="muted">Modules more than {MAX_NESTED_DEPTH} levels deep are listed under their ancestor '
            "at that level, by path.</p>" if flattened else "")
    return f'<ul class="report-tree">{"".join(out)}</ul>{note}'


def _finding_html(f: dict[str, Any], show_ranks: bool, folded: bool = False) -> str:
    sev = severity_of(f["severity"]).value
    ev = ""
    if f.get("evidence"):
        ev = ('<details><summary>evidence</summary><pre class="evidence">'
              + esc(json.dumps(f["evidence"], indent=2, sort_keys=True, default=str)) + "</pre></details>")
    fix = f'<div class="finding-fix"><b>Fix: </b>{esc_text(f["fix"])}</div>' if f.get("fix") else ""
    ranks = (f'<span class="badge ranks">{esc(format_ranks(f["ranks"]))}</span> '
             if show_ranks and f.get("ranks") else "")
    seen = seen_text(f)
    seen_html = f'<span class="steps">{esc(seen)}</span>' if seen else ""
    cause = None if folded else cause_text(f)
    cause_html = f'<div class="finding-cause">{esc(cause)}</div>' if cause else ""
    consequences = f.get("consequences") or []
    inner = ""
    if consequences:
        inner = ('<details class="consequences"><summary class="consequences-toggle">'
                 f'{esc(consequences_text(len(consequences)))}</summary><div class="consequences-list">'
                 + "".join(_finding_html(c, show_ranks, folded=True) for c in consequences) + "</div></details>")
    return (f'<div class="finding sev-border-{sev}"><div class="finding-head">'
            f'<span class="pill sev-{sev}">{esc_name(f["code"])}</span> '
            f'<span class="mono path">{esc_name(display_path(f["path"]))}</span> {ranks}{seen_html}</div>'
            f'<div class="finding-message">{esc_text(f["message"])}</div>{cause_html}{fix}{ev}{inner}</div>')


def _findings_html(items: list[dict[str, Any]], show_ranks: bool = False) -> str:
    """Root causes, each with its consequences folded under it."""
    if not items:
        return '<p class="message ok">No active findings.</p>'
    return "".join(_finding_html(f, show_ranks) for f in items)


def _ranks_html(rows: list[dict[str, Any]]) -> str:
    if len(rows) < 2:
        return ""
    head = "".join(f"<th>{esc(h)}</th>" for h in ("rank", "step", "step time (ms, median)", "overhead",
                                                  "samples stored", "samples dropped", "host", "status"))
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(v)}</td>" for v in (
            f"rank {r['rank']}", figures.fmt_num(r["step"]), figures.fmt_num(r["median_step_ms"]),
            "–" if r["overhead"] is None else f"{r['overhead'] * 100:.2f}%", figures.fmt_num(r["samples_stored"]),
            figures.fmt_num(r["samples_dropped"]), clip(r.get("hostname") or "–"), r["status_text"])) + "</tr>"
        for r in rows)
    return (f'<section class="panel" id="ranks"><h2>Ranks ({len(rows)})</h2><table class="table">'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></section>")


def _overview_html(ov: dict[str, Any]) -> str:
    params = ov.get("params") or {}
    rows = [
        ("Run", ov["run_name"]), ("Run id", ov.get("run_id")), ("Ranks", format_ranks(ov.get("ranks") or [0])),
        ("Model class", ov.get("model_class")), ("Status", ov.get("status")),
        ("Step", ov.get("step")), ("Samples stored", ov.get("samples_stored")),
        ("Samples dropped", ov.get("samples_dropped")), ("Probe errors", ov.get("probe_errors")),
        ("Probe overhead", None if ov.get("overhead") is None else f"{ov['overhead'] * 100:.2f}%"),
        ("Registered modules", ov["modules"][ModuleKind.REGISTERED]),
        ("Unregistered modules", ov["modules"][ModuleKind.UNREGISTERED] + ov["modules"][ModuleKind.RUNTIME]),
        *([("Modules removed during the run", ov["modules_removed"])] if ov.get("modules_removed") else []),
        ("Parameters", (params.get("total") or 0) + (params.get("unregistered") or 0)),
        ("Parameters registered (model.parameters())", params.get("total")),
        *([("Parameters unregistered (not in model.parameters())", params["unregistered"])]
          if params.get("unregistered") else []),
        ("Parameters held by the optimizer", params.get("in_optimizer")),
        *([("Failed store commits", ov["write_errors"]), ("Last store error", ov.get("last_error"))]
          if ov.get("write_errors") else []),
        ("Torch", ov.get("torch_version")), ("Device", ov.get("device")), ("Store", Path(ov["path"]).name),
    ]
    trs = "".join(f"<tr><th>{esc(k)}</th><td>{esc_name(figures.fmt_num(v) if not isinstance(v, str) else v)}</td></tr>"
                  for k, v in rows)
    sev = ov.get("root_causes") or ov["findings"]
    pills = "".join(f'<span class="pill sev-{s}">{sev[s]} {s}{"s" if sev[s] != 1 else ""}</span> '
                    for s in Severity) + '<span class="muted">root causes</span>'
    return f'<div class="report-overview"><table class="table kv">{trs}</table><div class="sev-row">{pills}</div></div>'


def _as_run(target: Store | RunDir | Run) -> Run:
    return target if isinstance(target, Run) else as_run_dir(target).run()


def build_report(target: Store | RunDir | Run, rank: int | None = None) -> str:
    """Return the whole report of a run (the newest of a run directory) as one HTML string: its
    findings merged over its ranks, the tree and charts of ``rank`` (default: its lowest)."""
    run = _as_run(target)
    rank = run.view_rank(rank)
    store = run.at(rank)
    ov = run.overview(rank)
    # the writer's state as the dashboard's header says it (a run whose process is gone "ended without close", a
    # snapshot "running when copied"), not the store's own word ("running" for as long as nobody closed it)
    states = run.health().states
    if rank in states:
        note = others_note(states, rank)
        ov["status"] = status_text(states[rank]) + (f" · {note}" if note else "")
    merged = run.findings_merged(active=True, rank=rank)
    roots = run.folded_findings(active=True, rank=rank)
    cap = findings_cap(run)
    cap_note = f'<p class="muted findings-cap">{esc(cap.text())}</p>' if cap else ""
    several = len(run.ranks()) > 1
    charts = [_fig_html(figures.loss_figure(store.loss_series(rank)), "chart-loss")]
    chart_mods = []
    seen = set()
    for f in merged:
        if f["module_id"] is not None and f["module_id"] not in seen:
            seen.add(f["module_id"])
            chart_mods.append(f["module_id"])
    if len(chart_mods) < MAX_CHART_MODULES:
        root = store.root(rank)
        if root:
            for m in store.children(rank, root["module_id"], MAX_CHART_MODULES)["items"]:
                if m["module_id"] not in seen:
                    chart_mods.append(m["module_id"])
                    seen.add(m["module_id"])
    module_sections = []
    for i, mid in enumerate(chart_mods[:MAX_CHART_MODULES]):
        m = store.module(rank, mid)
        if m is None:
            continue
        series = store.module_series(rank, mid)
        rev = f"r{i}"
        # a container that never ran (a ModuleList) has no samples: no empty panels for it
        panels = [(fig, name) for fig, name in (
            (figures.activation_figure(series, rev), "act"), (figures.fractions_figure(series, rev), "frac"),
            (figures.grad_figure(series, rev), "grad"), (figures.heatmap_figure(store.module_hist(rank, mid), rev),
                                                          "heat")) if fig["data"]]
        if not panels:
            continue
        gone = (f' <span class="badge kind-{REMOVED}" title="{esc(_removed_text(m))}">{REMOVED} at step '
                f'{esc(m["removed_step"])}</span>' if m.get("removed_step") is not None else "")
        module_sections.append(
            f'<section class="report-module"><h3 class="mono">{esc_name(display_path(m["path"]))} '
            f'<span class="tree-type">{esc_name(m["type"])}</span>{gone}</h3><div class="charts">'
            + "".join(_fig_html(fig, f"chart-{i}-{name}") for fig, name in panels)
            + "</div></section>")
    generated = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    heading = f"modscope report: {clip(ov['run_name'])}"
    store_name = Path(ov["path"]).name                   # the file's name: where it lies stays out of the report
    tree_rank = f" (rank {rank})" if several else ""
    ranks_section = _ranks_html(run.rank_rows()) if several else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(heading)}</title>
<style>{_css()}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body class="report">
<header class="header"><div class="brand"><span class="brand-a">mod</span><span class="brand-b">scope</span></div>
<div class="subtitle"><span class="mode mode-review">report</span><span class="run-path">{esc(store_name)}</span>
<span class="run-status">generated {esc(generated)}</span></div></header>
<main class="page">
<h1>{esc(heading)}</h1>
<section class="panel" id="overview"><h2>Overview</h2>{_overview_html(ov)}</section>
{ranks_section}
<section class="panel" id="loss">{charts[0]}</section>
<section class="panel" id="findings"><h2>Findings: {esc(count_text(root_counts(roots), len(merged) - len(roots)))}</h2>
{cap_note}{_findings_html(roots, several)}</section>
<section class="panel" id="tree"><h2>Module tree{tree_rank}</h2>{_tree_html(store, rank)}</section>
<section class="panel" id="modules"><h2>Module charts{tree_rank}</h2>{''.join(module_sections)}</section>
</main></body></html>
"""


def write_report(target: Store | RunDir | Run, out: str | Path, rank: int | None = 0) -> Path:
    """Write the report to a new file next to ``out`` and rename it into place: a link at ``out`` (planted in a
    folder others can write to) is replaced, never followed, and a failed write leaves no half report."""
    out = Path(out)
    text = build_report(target, rank)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)          # as an ordinary new file (mkstemp's is private)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
