"""Overview: run identity, progress, sampling health, findings by severity, loss curve."""

from __future__ import annotations

import datetime as _dt

from dash import Input, Output, Patch, State, ctx, dcc, html
from dash.exceptions import PreventUpdate

from .. import figures, ids
from ..components import card, message, severity_pill, table
from ..data import StoreError, StoreNotReady

TOP_FINDINGS = 6


def layout(config) -> html.Div:
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


def _when(ts) -> str | None:
    if not ts:
        return None
    return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def overview_cards(ov: dict) -> list:
    sev = ov["findings"]
    mods = ov["modules"]
    params = ov.get("params") or {}
    overhead = ov.get("overhead")
    unreg = mods["unregistered"] + mods["runtime"]
    return [
        card("Run", ov["run_name"], f"{ov.get('model_class') or '?'} · {ov.get('status') or 'unknown'}"
             + (f" · rank {ov['rank']} of {ov['world_size']}" if (ov.get("world_size") or 1) > 1 else ""),
             "wide"),
        card("Step", figures.fmt_num(ov.get("step")), f"{ov['steps_recorded']:,} step{'s' if ov['steps_recorded'] != 1 else ''} recorded"
             + (f" · updated {_when(ov['updated_at'])}" if ov.get("updated_at") else "")),
        card("Samples stored", figures.fmt_num(ov["samples_stored"]),
             f"sampling {_sampling(ov.get('sampling'))}"),
        card("Samples dropped", figures.fmt_num(ov["samples_dropped"]), "queue full" if ov["samples_dropped"]
             else "none", "bad" if ov["samples_dropped"] else ""),
        card("Probe errors", figures.fmt_num(ov["probe_errors"]), "caught inside hooks",
             "bad" if ov["probe_errors"] else ""),
        card("Probe overhead", "–" if overhead is None else f"{overhead * 100:.2f}%", "of training time"),
        card("Modules", f"{mods['registered']:,}", f"{unreg:,} unregistered" if unreg else "all registered",
             "bad" if unreg else ""),
        card("Parameters", figures.fmt_count(params.get("total")),
             f"{figures.fmt_count(params.get('in_optimizer'))} in optimizer"
             + (f" · {figures.fmt_count(params.get('unregistered'))} unregistered"
                if params.get("unregistered") else "")),
        html.Div([
            html.Div("Findings", className="card-label"),
            html.Div([dcc.Link(severity_pill(s, f"{sev[s]} {s}{'s' if sev[s] != 1 else ''}"),
                               href="/findings", className="plain") for s in ("error", "warning", "info")],
                     className="card-value sev-row"),
        ], className="card wide"),
    ]


def _sampling(s) -> str:
    if isinstance(s, dict):
        if s.get("every"):
            return f"every {s['every']} step{'s' if s['every'] != 1 else ''}"
        if s.get("overhead"):
            return f"budget {s['overhead'] * 100:g}%"
    return "–"


def top_findings(items: list[dict], total: int | None = None) -> list:
    if not items:
        return [message("No active findings.", "ok")]
    out = []
    for i, f in enumerate(items[:TOP_FINDINGS]):
        out.append(html.Div([
            severity_pill(f["severity"], f["code"]),
            html.Div(f["path"] or "(root)", className="mono path"),
        ], **ids.click_attrs("open", f["module_id"]), className=f"top-finding clickable sev-border-{f['severity']}",
            title="show this module"))
    total = len(items) if total is None else total
    if total > TOP_FINDINGS:
        out.append(dcc.Link(f"all {total:,} findings →", href="/findings", className="more"))
    return out


def register(app, config) -> None:
    if config.mode == "compare":
        return

    @app.callback(Output(ids.OV_CARDS, "children"), Output(ids.OV_TOP_FINDINGS, "children"),
                  Output(ids.OV_ERRORS, "children"),
                  Input(ids.TICK, "data"), Input(ids.RANK, "value"))
    def update_cards(tick, rank):
        if not tick or not tick.get("ready"):
            return [message(f"Waiting for the first sample in {config.store.path} …", "wait")], [], None
        try:
            ov = config.store.overview(rank or 0)
            items = config.store.findings(rank or 0, active=True, limit=TOP_FINDINGS + 1)
            errs = config.store.probe_errors(rank or 0) if ov["probe_errors"] else []
        except StoreNotReady:
            raise PreventUpdate
        except StoreError as exc:
            return [message(str(exc), "bad")], [], None
        err_block = None
        if errs:
            err_block = html.Div([html.H3("Probe errors (caught, training unaffected)"), table(
                ["where", "error", "message", "count", "first step", "last step"],
                [[e["location"], e["error_type"], e["message"], e["count"], e["first_step"], e["last_step"]]
                 for e in errs])], className="panel")
        return overview_cards(ov), top_findings(items, sum(ov["findings"].values())), err_block

    @app.callback(Output(ids.OV_LOSS, "figure"), Output(ids.OV_LOSS_STATE, "data"),
                  Input(ids.TICK, "data"), Input(ids.RANK, "value"), State(ids.OV_LOSS_STATE, "data"))
    def update_loss(tick, rank, state):
        rank = rank or 0
        if not tick or not tick.get("ready"):
            return figures.empty_figure("Waiting for the first sample…"), None
        try:
            incremental = (ctx.triggered_id == ids.TICK and state and state.get("rank") == rank
                           and state.get("has_data") and state.get("last") is not None)
            if incremental:
                new = config.store.loss_series(rank, since_step=state["last"])
                if not new["step"]:
                    raise PreventUpdate
                patch = Patch()
                patch["data"][0]["x"].extend(new["step"])
                patch["data"][0]["y"].extend(new["loss"])
                return patch, {**state, "last": new["last"]}
            series = config.store.loss_series(rank)
        except StoreNotReady:
            raise PreventUpdate
        except StoreError as exc:
            return figures.empty_figure(str(exc)), None
        fig = figures.loss_figure(series, uirevision=f"loss-{rank}")
        return fig, {"rank": rank, "last": series["last"], "has_data": bool(series["step"])}
