"""Overview: run identity, progress, sampling health, findings by severity, loss curve."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

from dash import Dash, Input, Output, Patch, State, ctx, dcc, html
from dash.exceptions import PreventUpdate

from probes.schema import ModuleKind, Severity, display_path

from .. import figures, ids
from ..components import card, message, severity_pill, table
from ..config import AppConfig
from ..poll import Tick, callback, plural, reads_store

TOP_FINDINGS = 6


def layout(config: AppConfig) -> html.Div:
    return html.Div([
        html.Div(id=ids.OV_CARDS, className="cards"),
        html.Div([
            html.Div([dcc.Graph(id=ids.OV_LOSS, config={"displaylogo": False, "displayModeBar": "hover"},
                                figure=figures.empty_figure("Loading…"))], className="panel grow"),
            html.Div([html.H3("Top findings"), html.Div(id=ids.OV_TOP_FINDINGS)],
                     className="panel side"),
        ], className="row"),
        html.Div(id=ids.OV_ERRORS),
        dcc.Store(id=ids.OV_LOSS_STATE, data=None),
    ], className="overview")


def _when(ts: float | None) -> str | None:
    if not ts:
        return None
    return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def overview_cards(ov: Mapping[str, Any]) -> list[html.Div]:
    sev = ov["findings"]
    mods = ov["modules"]
    params = ov.get("params") or {}
    overhead = ov.get("overhead")
    unreg = mods[ModuleKind.UNREGISTERED] + mods[ModuleKind.RUNTIME]
    dropped = ov["samples_dropped"]
    return [
        card("Run", ov["run_name"], f"{ov.get('model_class') or '?'} · {ov.get('status') or 'unknown'}"
             + (f" · rank {ov['rank']} of {ov['world_size']}" if (ov.get("world_size") or 1) > 1 else ""),
             "wide"),
        card("Step", figures.fmt_num(ov.get("step")), plural(ov["steps_recorded"], "step") + " recorded"
             + (f" · updated {_when(ov['updated_at'])}" if ov.get("updated_at") else "")),
        card("Samples stored", figures.fmt_num(ov["samples_stored"]),
             f"sampling {_sampling(ov.get('sampling'))}"),
        card("Samples dropped", figures.fmt_num(dropped),
             (f"{plural(ov['write_errors'], 'failed commit')}" if ov.get("write_errors") else "queue full")
             if dropped else "none", "bad" if dropped else ""),
        card("Probe errors", figures.fmt_num(ov["probe_errors"]), "caught inside hooks",
             "bad" if ov["probe_errors"] else ""),
        card("Probe overhead", "–" if overhead is None else f"{overhead * 100:.2f}%", "of training time"),
        card("Modules", f"{mods[ModuleKind.REGISTERED]:,}", f"{unreg:,} unregistered" if unreg else "all registered",
             "bad" if unreg else ""),
        card("Parameters", figures.fmt_count(params.get("total")),
             f"{figures.fmt_count(params.get('in_optimizer'))} in optimizer"
             + (f" · {figures.fmt_count(params.get('unregistered'))} unregistered"
                if params.get("unregistered") else "")),
        html.Div([
            html.Div("Findings", className="card-label"),
            html.Div([dcc.Link(severity_pill(s, plural(sev[s], s.value)), href="/findings", className="plain")
                      for s in Severity], className="card-value sev-row"),
        ], className="card wide"),
    ]


def _sampling(s: object) -> str:
    if isinstance(s, dict):
        if s.get("every"):
            return f"every {plural(s['every'], 'step')}"
        if s.get("overhead"):
            return f"budget {s['overhead'] * 100:g}%"
    return "–"


def top_findings(items: list[dict[str, Any]], total: int | None = None) -> list[Any]:
    if not items:
        return [message("No active findings.", "ok")]
    out: list[Any] = []
    for f in items[:TOP_FINDINGS]:
        out.append(html.Div([
            severity_pill(f["severity"], f["code"]),
            html.Div(display_path(f["path"]), className="mono path"),
        ], **ids.click_attrs(ids.ClickAction.OPEN, f["module_id"]),
            className=f"top-finding clickable sev-border-{f['severity']}", title="show this module"))
    total = len(items) if total is None else total
    if total > TOP_FINDINGS:
        out.append(dcc.Link(f"all {total:,} findings →", href="/findings", className="more"))
    return out


def probe_errors_block(errs: list[dict[str, Any]]) -> html.Div | None:
    if not errs:
        return None
    return html.Div([html.H3("Probe errors (caught, training unaffected)"), table(
        ["where", "error", "message", "count", "first step", "last step"],
        [[e["location"], e["error_type"], e["message"], e["count"], e["first_step"], e["last_step"]]
         for e in errs])], className="panel")


def register(app: Dash, config: AppConfig) -> None:
    store = config.store

    @callback(app, Output(ids.OV_CARDS, "children"), Output(ids.OV_TOP_FINDINGS, "children"),
                  Output(ids.OV_ERRORS, "children"),
                  Input(ids.TICK, "data"), Input(ids.RANK, "value"))
    @reads_store(store, waiting=lambda text: ([message(text, "wait")], [], None),
                 failed=lambda text: ([message(text, "bad")], [], None))
    def update_cards(tick: Tick, rank: int | None) -> tuple[Any, ...]:
        ov = store.overview(rank or 0)
        items = store.findings(rank or 0, active=True, limit=TOP_FINDINGS + 1)
        errs = store.probe_errors(rank or 0) if ov["probe_errors"] else []
        return overview_cards(ov), top_findings(items, sum(ov["findings"].values())), probe_errors_block(errs)

    @callback(app, Output(ids.OV_LOSS, "figure"), Output(ids.OV_LOSS_STATE, "data"),
                  Input(ids.TICK, "data"), Input(ids.RANK, "value"), State(ids.OV_LOSS_STATE, "data"))
    @reads_store(store, waiting=lambda text: (figures.empty_figure(text), None),
                 failed=lambda text: (figures.empty_figure(text), None))
    def update_loss(tick: Tick, rank: int | None, state: dict[str, Any] | None) -> tuple[Any, Any]:
        rank = rank or 0
        if (ctx.triggered_id == ids.TICK and state and state.get("rank") == rank and state.get("has_data")
                and state.get("last") is not None):
            new = store.loss_series(rank, since_step=state["last"])
            if not new["step"]:
                raise PreventUpdate
            patch = Patch()
            patch["data"][0]["x"].extend(new["step"])
            patch["data"][0]["y"].extend(new["loss"])
            return patch, {**state, "last": new["last"]}
        series = store.loss_series(rank)
        fig = figures.loss_figure(series, uirevision=f"loss-{rank}")
        return fig, {"rank": rank, "last": series["last"], "has_data": bool(series["step"])}
