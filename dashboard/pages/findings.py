"""Findings: every finding sorted by severity, with message, evidence and fix.
Clicking one selects its module and opens the Modules page."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dash import Dash, Input, Output, dcc, html

from probes.schema import Severity

from .. import ids
from ..components import finding_card, message, severity_of, severity_pill
from ..config import AppConfig
from ..poll import Tick, callback, plural, reads_store

MAX_SHOWN = 300   # cards drawn at once (each is a handful of components)


def layout(config: AppConfig) -> html.Div:
    return html.Div([
        html.Div([
            dcc.Checklist(id=ids.FINDINGS_SEVERITY, options=[{"label": s.value, "value": s.value} for s in Severity],
                          value=[s.value for s in Severity], inline=True, className="sev-check"),
            dcc.Checklist(id=ids.FINDINGS_SHOW_RESOLVED, options=[{"label": "show resolved", "value": "yes"}],
                          value=[], inline=True),
        ], className="findings-tools"),
        html.Div(id=ids.FINDINGS_LIST, className="findings-list"),
    ], className="panel findings-page")


def finding_list(items: list[dict[str, Any]], severities: Sequence[str]) -> list[Any]:
    """The cards of ``items`` whose severity is checked (one this version does not know counts as
    info), with a count per severity."""
    shown = [f for f in items if severity_of(f["severity"]).value in severities]
    if not shown:
        return [message("No findings. ✓" if not items else "No finding matches the filter.", "ok")]
    counts = {s: sum(1 for f in shown if severity_of(f["severity"]) is s) for s in Severity}
    out: list[Any] = [html.Div([severity_pill(s, plural(counts[s], s.value)) for s in Severity if counts[s]],
                               className="sev-row findings-summary")]
    for f in shown[:MAX_SHOWN]:
        mid = f["module_id"] if f["module_id"] is not None else -1
        out.append(finding_card(f, title="click to show this module", className="clickable",
                                **ids.click_attrs(ids.ClickAction.OPEN, mid)))
    if len(shown) > MAX_SHOWN:
        out.append(message(f"first {MAX_SHOWN} of {len(shown):,} findings shown: narrow by severity, or "
                           "filter the module tree by finding"))
    return out


def register(app: Dash, config: AppConfig) -> None:
    store = config.store

    @callback(app, Output(ids.FINDINGS_LIST, "children"), Input(ids.TICK, "data"),
                  Input(ids.FINDINGS_SEVERITY, "value"), Input(ids.FINDINGS_SHOW_RESOLVED, "value"),
                  Input(ids.RANK, "value"))
    @reads_store(store, waiting=lambda text: [message(text, "wait")], failed=lambda text: [message(text, "bad")])
    def render(tick: Tick, severities: list[str] | None, resolved: list[str] | None, rank: int | None) -> list[Any]:
        items = store.findings(rank or 0, active=None if resolved else True)
        for f in items:
            if f["module_id"] is None:
                m = store.module_for_path(rank or 0, f["path"])
                f["module_id"] = m["module_id"] if m else None
        return finding_list(items, severities or [])
