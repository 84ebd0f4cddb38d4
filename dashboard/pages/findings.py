"""Findings: every finding of the run once (merged over its ranks, with the ranks it occurs on and the
findings only the comparison of ranks shows), root causes first with their consequences folded under
them, sorted by severity, with message, evidence, fix, and how often and when each was seen.
Clicking one selects its module and opens the Modules page."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dash import Dash, Input, Output, dcc, html

from probes.schema import Severity

from .. import ids
from ..components import finding_card, message, severity_of, severity_pill
from ..config import AppConfig
from ..poll import Tick, callback, plural, reads_store, view_of

MAX_SHOWN = 300   # root-cause cards drawn at once (each is a handful of components)


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


def open_attrs(f: Mapping[str, Any]) -> dict[str, Any]:
    """A card's click opens its module (on the rank shown)."""
    mid = f.get("module_id")
    return {"title": "click to show this module", "className": "clickable",
            **ids.click_attrs(ids.ClickAction.OPEN, mid if mid is not None else -1)}


def finding_list(items: list[dict[str, Any]], severities: Sequence[str], *, show_ranks: bool = False) -> list[Any]:
    """The cards of the root causes in ``items`` (folded: each with its ``consequences``) whose
    severity is checked (one this version does not know counts as info), with a count per severity
    and, over the ranks of a distributed run, the ranks each occurs on."""
    shown = [f for f in items if severity_of(f["severity"]).value in severities]
    if not shown:
        return [message("No findings. ✓" if not items else "No finding matches the filter.", "ok")]
    counts = {s: sum(1 for f in shown if severity_of(f["severity"]) is s) for s in Severity}
    folded = sum(len(f.get("consequences") or []) for f in shown)
    out: list[Any] = [html.Div([*(severity_pill(s, plural(counts[s], s.value)) for s in Severity if counts[s]),
                                html.Span(f"root causes, {plural(folded, 'consequence')} folded under them",
                                          className="muted") if folded else None],
                               className="sev-row findings-summary")]
    for f in shown[:MAX_SHOWN]:
        out.append(finding_card(f, show_ranks=show_ranks, attrs_of=open_attrs))
    if len(shown) > MAX_SHOWN:
        out.append(message(f"first {MAX_SHOWN} of {len(shown):,} root causes shown: narrow by severity, or "
                           "filter the module tree by finding"))
    return out


def register(app: Dash, config: AppConfig) -> None:
    @callback(app, Output(ids.FINDINGS_LIST, "children"), Input(ids.TICK, "data"),
                  Input(ids.FINDINGS_SEVERITY, "value"), Input(ids.FINDINGS_SHOW_RESOLVED, "value"))
    @reads_store(config.source, waiting=lambda text: [message(text, "wait")],
                 failed=lambda text: [message(text, "bad")])
    def render(tick: Tick, severities: list[str] | None, resolved: list[str] | None) -> list[Any]:
        run, rank = view_of(config, tick)
        items = run.folded_findings(active=None if resolved else True, rank=rank)
        return finding_list(items, severities or [], show_ranks=len(tick.ranks) > 1)
