"""Compare: two runs or snapshots side by side - the "before / after the fix" table.

Summary (module and parameter counts, checkpoint keys, findings), findings that
appeared or were resolved, checkpoint keys added or removed, and per-module statistics
then (a) and now (b), matched by normalised path (``blocks[0]`` ~ ``blocks.0``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dash import Dash, Input, Output, dcc, html

from probes.schema import display_path

from ...read.run import compare_runs
from ...read.shown_text import clip
from .. import figures, ids
from ..components import finding_badges, kind_badge, message, severity_pill, table
from ..config import AppConfig
from ..poll import callback, reads_store

MAX_ROWS = 500
MAX_KEYS_SHOWN = 300


def layout(config: AppConfig) -> html.Div:
    a, b = config.labels
    return html.Div([
        html.Div(id=ids.CMP_SUMMARY, className="panel"),
        html.Div([html.Div(id=ids.CMP_FINDINGS, className="panel grow"),
                  html.Div(id=ids.CMP_KEYS, className="panel grow")], className="row"),
        html.Div([
            html.Div([html.H3(f"Modules: {a} → {b}"),
                      dcc.Checklist(id=ids.CMP_CHANGED_ONLY, options=[{"label": "changed only", "value": "yes"}],
                                    value=["yes"], inline=True)], className="panel-head"),
            html.Div(id=ids.CMP_MODULES),
        ], className="panel"),
    ], className="compare")


def distinct_texts(a: Any, b: Any, changed: bool = True) -> tuple[str, str]:
    """The two values of a summary row as text; two values that differ are shown with as many digits as it takes
    to tell them apart (a final loss of 1.3874 and 1.3901 read "1.39" and "1.39", highlighted as changed)."""
    def text(x: Any, digits: int) -> str:
        return clip(x) if isinstance(x, str) else figures.fmt_num(x, digits)
    ta, tb = text(a, 3), text(b, 3)
    if changed and ta == tb and isinstance(a, float) and isinstance(b, float):
        for digits in range(4, 13):
            ta, tb = text(a, digits), text(b, digits)
            if ta != tb:
                break
    return ta, tb


def summary_table(cmp: dict[str, Any], labels: Sequence[str]) -> html.Div:
    rows = []
    for r in cmp["summary"]:
        ta, tb = distinct_texts(r["a"], r["b"], bool(r["changed"]))
        rows.append([r["metric"], html.Td(ta, className="num"),
                     html.Td(tb, className="num" + (" changed" if r["changed"] else ""))])
    return html.Div([
        html.H3("Summary"),
        html.Div([html.Div([html.B(f"{labels[0]}: "), html.Span(cmp["a"]["path"], className="mono")]),
                  html.Div([html.B(f"{labels[1]}: "), html.Span(cmp["b"]["path"], className="mono")])],
                 className="cmp-paths"),
        table(["", labels[0], labels[1]], rows, "cmp-summary-table"),
    ])


def findings_block(cmp: dict[str, Any], labels: Sequence[str]) -> list[Any]:
    def items(fs: list[dict[str, Any]], cls: str) -> list[Any]:
        if not fs:
            return [message("none")]
        return [html.Div([severity_pill(f["severity"], f["code"]), html.Span(clip(display_path(f["path"])),
                                                                             className="mono path")],
                         className=f"cmp-finding {cls}") for f in fs[:MAX_ROWS]]
    return [
        html.H3("Findings"),
        html.H4(f"Resolved in {labels[1]} ({len(cmp['findings_resolved'])})", className="good"),
        html.Div(items(cmp["findings_resolved"], "resolved"), id=ids.CMP_RESOLVED),
        html.H4(f"Appeared in {labels[1]} ({len(cmp['findings_appeared'])})", className="bad"),
        html.Div(items(cmp["findings_appeared"], "appeared"), id=ids.CMP_APPEARED),
        html.H4(f"Still present ({len(cmp['findings_persisting'])})"),
        html.Div(items(cmp["findings_persisting"], "persisting")),
    ]


def keys_block(cmp: dict[str, Any], labels: Sequence[str]) -> list[Any]:
    def keylist(keys: list[str], sign: str, cls: str) -> list[Any]:
        if not keys:
            return [message("none")]
        shown = [html.Div(f"{sign} {clip(k)}", className=f"mono key {cls}") for k in keys[:MAX_KEYS_SHOWN]]
        if len(keys) > MAX_KEYS_SHOWN:
            shown.append(message(f"… {len(keys) - MAX_KEYS_SHOWN:,} more"))
        return shown
    return [
        html.H3("Checkpoint keys (state_dict)"),
        html.Div(f"{cmp['keys_common']:,} keys in both", className="muted"),
        html.H4(f"Added in {labels[1]} ({len(cmp['keys_added'])})", className="good"),
        html.Div(keylist(cmp["keys_added"], "+", "added"), id=ids.CMP_KEYS_ADDED),
        html.H4(f"Removed in {labels[1]} ({len(cmp['keys_removed'])})", className="bad"),
        html.Div(keylist(cmp["keys_removed"], "−", "removed"), id=ids.CMP_KEYS_REMOVED),
    ]


def _codes(codes: list[dict[str, Any]]) -> Any:
    return finding_badges(codes) if codes else "–"


def _pair(a: Any, b: Any, fmt: Callable[[Any], str] = figures.fmt_num) -> html.Td:
    """One "then → now" cell, highlighted when the value changed."""
    fa = "–" if a is None else fmt(a)
    fb = "–" if b is None else fmt(b)
    if fa == fb:
        return html.Td(fb, className="num")
    return html.Td([html.Span(fa, className="then"), " → ", html.Span(fb, className="now")],
                   className="num changed")


def _kind_pair(a: str | None, b: str | None) -> html.Td:
    if a == b:
        return html.Td(kind_badge(b) or b)
    return html.Td([kind_badge(a) or (a or "–"), " → ", kind_badge(b) or (b or "–")], className="changed")


def modules_table(cmp: dict[str, Any], changed_only: bool, labels: Sequence[str]) -> html.Div:
    mods = [m for m in cmp["modules"] if m["changed"] or not changed_only]
    a, b = labels
    rows = []
    for m in mods[:MAX_ROWS]:
        path = m["path_b"] if m["path_b"] is not None else m["path_a"]
        moved = m["path_a"] is not None and m["path_b"] is not None and m["path_a"] != m["path_b"]
        rows.append([
            html.Td([html.Span(clip(display_path(path)), className="mono"),
                     html.Div(f"was {clip(m['path_a'])}", className="muted mono") if moved else None,
                     html.Div(f"only in {a}" if m["path_b"] is None else f"only in {b}", className="muted")
                     if m["path_a"] is None or m["path_b"] is None else None]),
            m["type"], _kind_pair(m["kind_a"], m["kind_b"]),
            _pair(m["params_a"], m["params_b"]), _pair(m["in_opt_a"], m["in_opt_b"]),
            _pair(m["mean_a"], m["mean_b"]), _pair(m["std_a"], m["std_b"]),
            _pair(m["dead_frac_a"], m["dead_frac_b"]),
            html.Td(_codes(m["codes_a"])), html.Td(_codes(m["codes_b"])),
        ])
    note = None
    if len(mods) > MAX_ROWS:
        note = message(f"first {MAX_ROWS} of {len(mods):,} rows shown")
    if not rows:
        return html.Div(message("No module changed." if changed_only else "No modules."))
    return html.Div([table(["module", "type", "kind", "parameters", "in optimizer", "mean", "std",
                            "dead fraction", f"findings {a}", f"findings {b}"],
                           rows, "cmp-modules-table"), note], className="table-scroll")


def register(app: Dash, config: AppConfig) -> None:
    source_a, source_b = config.source, config.source_b
    assert source_b is not None     # AppConfig checks it in compare mode

    @callback(app, Output(ids.CMP_SUMMARY, "children"), Output(ids.CMP_FINDINGS, "children"),
                  Output(ids.CMP_KEYS, "children"), Output(ids.CMP_MODULES, "children"),
                  Input(ids.CMP_CHANGED_ONLY, "value"))
    @reads_store(source_a, failed=lambda text: (message(text, "bad"), None, None, None), tick_first=False)
    def render(changed_only: list[str] | None) -> tuple[Any, ...]:
        """The newest run of each side (each one's findings merged over its ranks)."""
        cmp = compare_runs(source_a.run(), source_b.run())
        return (summary_table(cmp, config.labels), findings_block(cmp, config.labels),
                keys_block(cmp, config.labels), modules_table(cmp, bool(changed_only), config.labels))
