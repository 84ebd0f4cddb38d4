"""The Dash application: the shell (header, navigation, polling, export) and the wiring of
the pages. ``create_app(config)`` builds a fresh app; nothing lives at module level."""

from __future__ import annotations

import hmac
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

import dash
from dash import Dash, Input, Output, State, dcc, html, no_update
from dash.exceptions import PreventUpdate
from flask import Response, request

from . import ids
from .data import Store, StoreError, StoreNotReady
from .pages import compare, findings, modules, overview
from .report import build_report

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TOKEN_COOKIE = "modscope_token"
TOKEN_HEADER = "X-Modscope-Token"


@dataclass
class AppConfig:
    """What the app shows. ``mode``: 'live' (follow a run, poll), 'review' (a snapshot, no
    polling) or 'compare' (two stores side by side)."""
    mode: str
    store: Store | None = None
    store_b: Store | None = None
    poll_ms: int = 1000
    token: str | None = None
    title: str = "modscope"
    labels: tuple = ("before", "after")
    extra: dict = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.mode == "live"


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def install_token_check(server, token: str) -> None:
    """Every request must carry the token: ``?token=`` (then remembered in a cookie), the
    cookie, or the X-Modscope-Token header. Otherwise 401."""
    expected = token.encode()

    def ok(value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(value.encode(), expected)

    @server.before_request
    def _check_token():
        if ok(request.cookies.get(TOKEN_COOKIE)) or ok(request.headers.get(TOKEN_HEADER)):
            return None
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer ") and ok(auth[7:]):
            return None
        if ok(request.args.get("token")):
            request.environ["modscope.set_cookie"] = True
            return None
        return Response("401 Unauthorized: modscope needs the token printed when it started "
                        "(open the URL with ?token=...).\n", status=401, mimetype="text/plain")

    @server.after_request
    def _remember_token(resp):
        if request.environ.get("modscope.set_cookie"):
            resp.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict")
        return resp


def _safe_filename(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name or "run").strip("_") or "run"


def _use_cartesian_plotly() -> None:
    """The pages draw scatter, bar and heatmap traces only. assets/plotly-cartesian-4.1.1.min.js
    (plotly.js's cartesian bundle, 1.5 MB, the version Dash pins) defines window.Plotly, which
    dcc.Graph uses when present; Dash's own eager copy of the full bundle (4.8 MB) would then only
    cost a ~0.8 s parse right after the page loads, blocking the first click. Drop it."""
    dcc._js_dist[:] = [d for d in dcc._js_dist if d.get("namespace") != "plotly"]


def create_app(config: AppConfig) -> Dash:
    app = Dash(
        __name__,
        title=config.title,
        assets_folder=str(ASSETS),
        suppress_callback_exceptions=True,
        update_title=None,
    )
    if config.token:
        install_token_check(app.server, config.token)
    _use_cartesian_plotly()

    app.layout = lambda: shell_layout(config)
    register_shell(app, config)
    overview.register(app, config)
    modules.register(app, config)
    findings.register(app, config)
    compare.register(app, config)
    return app


def initial_tick(config: AppConfig, rank: int = 0) -> dict:
    store = config.store
    if config.mode == "compare" or store is None:
        return {"ready": True, "n": 0}
    try:
        if not store.ready():
            return {"ready": False, "n": 0}
        v = store.version(rank)
    except StoreNotReady:
        return {"ready": False, "n": 0}
    except StoreError as exc:
        return {"ready": False, "n": 0, "error": str(exc)}
    return {"ready": True, "n": 0, **v}


def nav_links(config: AppConfig) -> list[tuple[str, str]]:
    if config.mode == "compare":
        return [("/", "Compare")]
    return [("/", "Overview"), ("/modules", "Modules"), ("/findings", "Findings")]


def shell_layout(config: AppConfig) -> html.Div:
    tick = initial_tick(config)
    ranks = [0]
    if config.store is not None and tick.get("ready") and config.mode != "compare":
        try:
            ranks = config.store.ranks()
        except StoreError:
            ranks = [0]
    if config.mode == "compare":
        subtitle = [html.Span("compare", className="mode mode-compare"),
                    html.Span(f"{config.labels[0]}: {config.store.path}", className="run-path"),
                    html.Span(f"{config.labels[1]}: {config.store_b.path}", className="run-path")]
    else:
        subtitle = [html.Span("live" if config.live else "snapshot",
                              className=f"mode mode-{'live' if config.live else 'review'}"),
                    html.Span(str(config.store.path), className="run-path", title=str(config.store.path)),
                    html.Span(id=ids.RUN_STATUS, className="run-status")]
    export = [] if config.mode == "compare" else [
        html.Button("⤓ Snapshot", id=ids.EXPORT_SNAPSHOT_BTN, n_clicks=0, className="btn",
                    title="Download a single-file snapshot of this run (open it with --snapshot)"),
        html.Button("⤓ HTML report", id=ids.EXPORT_REPORT_BTN, n_clicks=0, className="btn",
                    title="Download a standalone HTML report (works offline)"),
        dcc.Download(id=ids.DOWNLOAD_SNAPSHOT),
        dcc.Download(id=ids.DOWNLOAD_REPORT),
    ]
    header = html.Header([
        html.Div([html.Span("mod", className="brand-a"), html.Span("scope", className="brand-b")],
                 className="brand"),
        html.Nav([dcc.Link([label, html.Span(id=ids.NAV_COUNT, className="nav-count")] if href == "/findings"
                           else label, href=href, className="nav-link", id={"type": "nav", "href": href})
                  for href, label in nav_links(config)], id=ids.NAV, className="nav"),
        html.Div(subtitle, className="subtitle"),
        html.Div([
            dcc.Dropdown(id=ids.RANK, options=[{"label": f"rank {r}", "value": r} for r in ranks],
                         value=ranks[0], clearable=False, searchable=False, className="rank-select",
                         style={} if len(ranks) > 1 else {"display": "none"}),
            *export,
        ], className="header-actions"),
    ], id=ids.HEADER, className="header")
    return html.Div([
        dcc.Location(id=ids.URL, refresh=False),
        dcc.Interval(id=ids.INTERVAL, interval=config.poll_ms, disabled=not config.live),
        dcc.Store(id=ids.TICK, data=tick),
        dcc.Store(id=ids.SELECTED, data=None),
        dcc.Store(id=ids.EXPANDED, data=None),
        dcc.Store(id=ids.UI_CLICK, data=None),
        header,
        html.Div(id=ids.BANNER, className="banner", children=_banner(tick, config)),
        html.Main(id=ids.PAGE, className="page"),
    ], className="app")


def _banner(tick: dict, config: AppConfig):
    if tick.get("error"):
        return html.Div(tick["error"], className="banner-error")
    if not tick.get("ready"):
        return html.Div(f"Waiting for the first sample in {config.store.path} …",
                        className="banner-wait")
    return None


def register_shell(app: Dash, config: AppConfig) -> None:
    @app.callback(Output(ids.PAGE, "children"), Output({"type": "nav", "href": dash.ALL}, "className"),
                  Input(ids.URL, "pathname"))
    def route(pathname):
        pathname = pathname or "/"
        hrefs = [h for h, _ in nav_links(config)]
        classes = ["nav-link active" if h == pathname or (h == "/" and pathname not in hrefs)
                   else "nav-link" for h in hrefs]
        if config.mode == "compare":
            return compare.layout(config), classes
        if pathname.startswith("/modules"):
            return modules.layout(config), classes
        if pathname.startswith("/findings"):
            return findings.layout(config), classes
        return overview.layout(config), classes

    if config.live:
        @app.callback(Output(ids.TICK, "data"), Output(ids.BANNER, "children"),
                      Input(ids.INTERVAL, "n_intervals"), State(ids.TICK, "data"),
                      State(ids.RANK, "value"))
        def poll(_n, tick, rank):
            new = initial_tick(config, rank or 0)
            old = dict(tick or {})
            if {k: v for k, v in new.items() if k != "n"} == {k: v for k, v in old.items() if k != "n"}:
                raise PreventUpdate
            new["n"] = int(old.get("n", 0)) + 1
            return new, _banner(new, config)

    if config.mode != "compare":
        @app.callback(Output(ids.RUN_STATUS, "children"), Input(ids.TICK, "data"))
        def run_status(tick):
            if not tick or not tick.get("ready"):
                return "waiting"
            struct = tick.get("struct") or [None, None, None]
            status = (struct[2] or [None])[0]
            return f"step {tick.get('step')}" + (f" · {status}" if status else "")

        @app.callback(Output(ids.NAV_COUNT, "children"), Output(ids.NAV_COUNT, "className"),
                      Input(ids.TICK, "data"), Input(ids.RANK, "value"))
        def findings_count(tick, rank):
            """The number of active findings next to "Findings", coloured by the worst."""
            if not tick or not tick.get("ready"):
                return "", "nav-count"
            try:
                sev = config.store.overview(rank or 0)["findings"]
            except StoreError:
                raise PreventUpdate
            total = sum(sev.values())
            worst = next((s for s in ("error", "warning", "info") if sev.get(s)), None)
            return (str(total) if total else ""), f"nav-count sev-{worst}" if worst else "nav-count"

        @app.callback(Output(ids.DOWNLOAD_SNAPSHOT, "data"), Output(ids.BANNER, "children", allow_duplicate=True),
                      Input(ids.EXPORT_SNAPSHOT_BTN, "n_clicks"), prevent_initial_call=True)
        def download_snapshot(n):
            if not n:
                raise PreventUpdate
            try:
                data = config.store.snapshot_bytes()
                ov = config.store.overview()
            except StoreError as exc:
                return no_update, html.Div(f"Snapshot failed: {exc}", className="banner-error")
            name = f"{_safe_filename(ov.get('run_name'))}-step{ov.get('step')}.sqlite"
            return dcc.send_bytes(data, filename=name), no_update

        @app.callback(Output(ids.DOWNLOAD_REPORT, "data"), Output(ids.BANNER, "children", allow_duplicate=True),
                      Input(ids.EXPORT_REPORT_BTN, "n_clicks"), State(ids.RANK, "value"), prevent_initial_call=True)
        def download_report(n, rank):
            if not n:
                raise PreventUpdate
            try:
                text = build_report(config.store, rank or 0)
                ov = config.store.overview(rank or 0)
            except StoreError as exc:
                return no_update, html.Div(f"Report failed: {exc}", className="banner-error")
            return (dcc.send_string(text, filename=f"{_safe_filename(ov.get('run_name'))}-report.html"),
                    no_update)
