"""Findings: every finding of the run once (merged over its ranks, with the ranks it occurs on and the
findings only the comparison of ranks shows), root causes first with their consequences folded under
them, sorted by severity, with message, evidence, fix, and how often and when each was seen.
Each finding's path is a button that selects its module and opens the Modules page (a click anywhere
else on the card does too; the evidence and the consequences are toggles of their own).

While a run trains the list is drawn again on every poll (each finding's count and last step move
on): the evidence and the consequences the user opened are kept in ``dcc.Store(ids.FINDINGS_OPEN)``
(assets/modscope.js reports each toggle into ``ids.FINDINGS_TOGGLE``, the store the list names) and
drawn open again (``components.toggled``; the Modules page keeps its module's detail the same way).
``ids.FINDINGS_TOGGLE`` lives in the tab's sessionStorage: the page is built anew each time the user
comes back to it (Findings, Modules, Findings), and its restored value, an input of the list, draws
open what was open (nothing is kept on the server). The severity and "show resolved" filters are kept there
too (Dash's persistence)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from dash import Dash, Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from probes.schema import Severity, count_text

from ...read.caps import FindingsCap, findings_cap
from .. import ids
from ..components import finding_card, message, severity_of, severity_pill, toggled
from ..config import AppConfig
from ..poll import Tick, callback, plural, reads_store, view_of

MAX_SHOWN = 300   # root-cause cards drawn at once (each is a handful of components)
# the severity and "show resolved" filters are kept in the tab's sessionStorage, as what is opened is: after another
# page and back, a resolved finding whose evidence the user opened is still shown, and open
KEPT: dict[str, Any] = {"persistence": True, "persistence_type": "session"}


def layout(config: AppConfig) -> html.Div:
    return html.Div([
        html.Div([
            dcc.Checklist(id=ids.FINDINGS_SEVERITY, options=[{"label": s.value, "value": s.value} for s in Severity],
                          value=[s.value for s in Severity], inline=True, className="sev-check", **KEPT),
            dcc.Checklist(id=ids.FINDINGS_SHOW_RESOLVED, options=[{"label": "show resolved", "value": "yes"}],
                          value=[], inline=True, **KEPT),
        ], className="findings-tools"),
        html.Div(id=ids.FINDINGS_LIST, className="findings-list", **ids.toggle_attrs(ids.FINDINGS_TOGGLE)),
        dcc.Store(id=ids.FINDINGS_OPEN, data=[]),
        dcc.Store(id=ids.FINDINGS_TOGGLE, data=None, storage_type="session"),
    ], className="panel findings-page")


def finding_list(items: list[dict[str, Any]], severities: Sequence[str], *, show_ranks: bool = False,
                 opened: Collection[str] | None = None, cap: FindingsCap | None = None) -> list[Any]:
    """The cards of the root causes in ``items`` (folded: each with its ``consequences``) whose
    severity is checked (one this version does not know counts as info), with a count per severity
    and, over the ranks of a distributed run, the ranks each occurs on. With ``opened``, the evidence
    and consequences whose keys it holds are drawn open (and report their toggles). ``cap``: the findings
    the read left out, said first."""
    capped = [message(cap.text(), "muted findings-cap")] if cap is not None else []
    shown = [f for f in items if severity_of(f["severity"]).value in severities]
    if not shown:
        return [*capped, message("No findings. ✓" if not items else "No finding matches the filter.", "ok")]
    counts = {s: sum(1 for f in shown if severity_of(f["severity"]) is s) for s in Severity}
    folded = sum(len(f.get("consequences") or []) for f in shown)
    # the one count (schema.count_text), as the Overview, the report and the command line say it
    out: list[Any] = [*capped]
    out.append(html.Div([*(severity_pill(s, plural(counts[s], s.value)) for s in Severity if counts[s]),
                         html.Span(count_text({str(s): n for s, n in counts.items()}, folded),
                                   className="muted findings-count")],
                        className="sev-row findings-summary"))
    for f in shown[:MAX_SHOWN]:
        out.append(finding_card(f, show_ranks=show_ranks, opens_module=True, opened=opened))
    if len(shown) > MAX_SHOWN:
        out.append(message(f"first {MAX_SHOWN} of {len(shown):,} root causes shown: narrow by severity, or "
                           "filter the module tree by finding"))
    return out


def register(app: Dash, config: AppConfig) -> None:
    @callback(app, Output(ids.FINDINGS_LIST, "children"), Output(ids.FINDINGS_OPEN, "data"),
                  Input(ids.TICK, "data"), Input(ids.FINDINGS_SEVERITY, "value"),
                  Input(ids.FINDINGS_SHOW_RESOLVED, "value"), Input(ids.FINDINGS_TOGGLE, "data"),
                  State(ids.FINDINGS_OPEN, "data"))
    @reads_store(config.source, waiting=lambda text: ([message(text, "wait")], no_update),
                 failed=lambda text: ([message(text, "bad")], no_update))
    def render(tick: Tick, severities: list[str] | None, resolved: list[str] | None, toggle: object,
               opened: object) -> tuple[list[Any], Any]:
        """The list, drawn with what the user opened. A toggle is drawn too, not only kept: a redraw
        that a poll started before it would otherwise close it again (Dash drops that redraw's answer
        once this call is made). The last toggle is applied on every call (again, it changes nothing)."""
        keys = toggled(opened, toggle)
        if (isinstance(toggle, dict) and set(ctx.triggered_prop_ids) == {f"{ids.FINDINGS_TOGGLE}.data"}
                and set(keys) == set(toggled(opened, None))):
            raise PreventUpdate
        run, rank = view_of(config, tick)
        active = None if resolved else True
        items = run.folded_findings(active=active, rank=rank)
        return (finding_list(items, severities or [], show_ranks=len(tick.ranks) > 1, opened=set(keys),
                             cap=findings_cap(run, active)),
                keys if keys != opened else no_update)
