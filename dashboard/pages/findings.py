"""Findings: every finding sorted by severity, with message, evidence and fix.
Clicking one selects its module and opens the Modules page."""

from __future__ import annotations

from dash import Input, Output, dcc, html
from dash.exceptions import PreventUpdate

from .. import ids
from ..components import finding_card, message, severity_pill
from ..data import SEVERITIES, StoreError, StoreNotReady


def layout(config) -> html.Div:
    return html.Div([
        html.Div([
            dcc.Checklist(id=ids.FINDINGS_SEVERITY, options=[{"label": s, "value": s} for s in SEVERITIES],
                          value=list(SEVERITIES), inline=True, className="sev-check"),
            dcc.Checklist(id=ids.FINDINGS_SHOW_RESOLVED, options=[{"label": "show resolved", "value": "yes"}],
                          value=[], inline=True),
        ], className="findings-tools"),
        html.Div(id=ids.FINDINGS_LIST, className="findings-list"),
    ], className="panel findings-page")


MAX_SHOWN = 300   # cards drawn at once (each is a handful of components)


def finding_list(items: list[dict], severities: list[str]) -> list:
    shown = [f for f in items if f["severity"] in severities or f["severity"] not in SEVERITIES]
    if not shown:
        return [message("No findings. ✓" if not items else "No finding matches the filter.", "ok")]
    out = []
    counts = {s: sum(1 for f in shown if f["severity"] == s) for s in SEVERITIES}
    out.append(html.Div([severity_pill(s, f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}")
                         for s in SEVERITIES if counts[s]], className="sev-row findings-summary"))
    for i, f in enumerate(shown[:MAX_SHOWN]):
        mid = f["module_id"] if f["module_id"] is not None else -1
        out.append(finding_card(f, title="click to show this module", className="clickable",
                                **ids.click_attrs("open", mid)))
    if len(shown) > MAX_SHOWN:
        out.append(message(f"first {MAX_SHOWN} of {len(shown):,} findings shown: narrow by severity, or "
                           "filter the module tree by finding"))
    return out


def register(app, config) -> None:
    if config.mode == "compare":
        return
    store = config.store

    @app.callback(Output(ids.FINDINGS_LIST, "children"), Input(ids.TICK, "data"),
                  Input(ids.FINDINGS_SEVERITY, "value"), Input(ids.FINDINGS_SHOW_RESOLVED, "value"),
                  Input(ids.RANK, "value"))
    def render(tick, severities, resolved, rank):
        if not tick or not tick.get("ready"):
            return [message(f"Waiting for the first sample in {store.path} …", "wait")]
        try:
            items = store.findings(rank or 0, active=None if resolved else True)
            for f in items:
                if f["module_id"] is None:
                    m = store.module_for_path(rank or 0, f["path"])
                    f["module_id"] = m["module_id"] if m else None
        except StoreNotReady:
            raise PreventUpdate
        except StoreError as exc:
            return [message(str(exc), "bad")]
        return finding_list(items, severities or [])
