"""The Dash application: the shell (header, navigation, polling, export) and the wiring of
the pages. ``create_app(config)`` builds a fresh app; nothing lives at module level."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import dash
from dash import Dash, Input, Output, State, dcc, html, no_update
from dash.exceptions import PreventUpdate

from probes.schema import Severity

from . import ids, security
from .config import AppConfig, Mode
from .data import StoreError
from .pages import Page, page_at, pages_for
from .paths import assets_dir
from .poll import Tick, banner, callback, header_text, read_tick, reads_store
from .report import build_report

__all__ = ["AppConfig", "Mode", "create_app"]

ASSETS = assets_dir()
CARTESIAN_PLOTLY_PREFIX = "plotly-cartesian-"


def _safe_filename(name: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name or "run").strip("_") or "run"


def cartesian_plotly_asset() -> Path | None:
    """assets/plotly-cartesian-<version>.min.js: plotly.js's cartesian bundle (1.5 MB)."""
    return next(iter(sorted(ASSETS.glob(f"{CARTESIAN_PLOTLY_PREFIX}*.min.js"))), None)


def bundled_plotly_version(asset: Path) -> str | None:
    """The plotly.js version in the bundle's header comment (``plotly.js (cartesian - minified) v4.1.1``)."""
    with open(asset, encoding="utf-8", errors="replace") as fh:
        head = fh.read(400)
    m = re.search(r"plotly\.js \(cartesian[^)]*\) v(\d+\.\d+\.\d+)", head)
    return m.group(1) if m else None


def dash_plotly_version() -> str:
    """The plotly.js version Dash serves (the plotly package's bundle, plotly.offline)."""
    from plotly.offline import get_plotlyjs_version
    return str(get_plotlyjs_version())


def cartesian_plotly_usable() -> bool:
    """Whether assets/ holds the cartesian bundle of the plotly.js version Dash serves."""
    asset = cartesian_plotly_asset()
    return asset is not None and bundled_plotly_version(asset) == dash_plotly_version()


def _drop_dash_plotly() -> None:
    """The pages draw scatter, bar and heatmap traces only. The cartesian bundle in assets/ defines
    window.Plotly, which dcc.Graph uses when present; Dash's own eager copy of the full bundle
    (4.8 MB) would then only cost a ~0.8 s parse right after the page loads, blocking the first
    click: drop it from Dash's (private) script list. Only done when both are the same plotly.js
    version (``cartesian_plotly_usable``; tests/dashboard/test_dash_app.py checks that they are,
    and that the page then loads the one bundle)."""
    dcc._js_dist[:] = [d for d in dcc._js_dist
                       if not (d.get("namespace") == "plotly"
                               and str(d.get("relative_package_path", "")).endswith("plotly.min.js"))]


def create_app(config: AppConfig) -> Dash:
    cartesian = cartesian_plotly_usable()
    app = Dash(
        __name__,
        title=config.title,
        assets_folder=str(ASSETS),
        # a bundle of another plotly.js version than Dash's is not loaded (Dash's full bundle is)
        assets_ignore="" if cartesian else re.escape(CARTESIAN_PLOTLY_PREFIX) + ".*",
        suppress_callback_exceptions=True,
        update_title=None,
    )
    # Host/Origin checks always; the token where there is one (docs/security.md)
    security.install(app.server, host=config.bind_host, port=config.bind_port, token=config.token)
    if cartesian:
        _drop_dash_plotly()

    pages = pages_for(config.mode)
    app.layout = lambda: shell_layout(config, pages)
    register_shell(app, config, pages)
    for page in pages:
        page.register(app, config)
    return app


def header_ranks(config: AppConfig, tick: Tick) -> list[int]:
    if config.mode is Mode.COMPARE or not tick.ready:
        return [0]
    try:
        return config.store.ranks()
    except StoreError:
        return [0]


def nav(pages: tuple[Page, ...]) -> html.Nav:
    return html.Nav([dcc.Link([page.label, html.Span(id=ids.NAV_COUNT, className="nav-count")]
                              if page.counts_findings else page.label,
                              href=page.href, className="nav-link", id=ids.nav_link(page.href))
                     for page in pages], id=ids.NAV, className="nav")


def shell_layout(config: AppConfig, pages: tuple[Page, ...]) -> html.Div:
    tick = read_tick(config)
    ranks = header_ranks(config, tick)
    if config.mode is Mode.COMPARE:
        assert config.store_b is not None
        subtitle = [html.Span("compare", className="mode mode-compare"),
                    html.Span(f"{config.labels[0]}: {config.store.path}", className="run-path"),
                    html.Span(f"{config.labels[1]}: {config.store_b.path}", className="run-path")]
    else:
        where = str(config.store.where)
        subtitle = [html.Span("live" if config.live else "snapshot",
                              className=f"mode mode-{'live' if config.live else 'review'}"),
                    html.Span(where, className="run-path", title=where),
                    html.Span(header_text(tick), id=ids.RUN_STATUS, className="run-status")]
    export = [] if config.mode is Mode.COMPARE else [
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
        nav(pages),
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
        dcc.Store(id=ids.TICK, data=tick.to_data()),
        dcc.Store(id=ids.SELECTED, data=None),
        dcc.Store(id=ids.EXPANDED, data=None),
        dcc.Store(id=ids.UI_CLICK, data=None),
        header,
        html.Div(id=ids.BANNER, className="banner",
                 children=[] if config.mode is Mode.COMPARE else banner(tick, config.store)),
        html.Main(id=ids.PAGE, className="page"),
    ], className="app")


def findings_count(counts: dict[str, int]) -> tuple[str, str]:
    """The number of active findings next to "Findings", and its class (coloured by the worst)."""
    total = sum(counts.values())
    worst = next((s for s in Severity if counts.get(s)), None)
    return (str(total) if total else ""), f"nav-count sev-{worst.value}" if worst else "nav-count"


def register_shell(app: Dash, config: AppConfig, pages: tuple[Page, ...]) -> None:
    store = config.store

    @callback(app, Output(ids.PAGE, "children"), Output(ids.nav_link(dash.ALL), "className"),
                  Input(ids.URL, "pathname"))
    def route(pathname: str | None) -> tuple[Any, list[str]]:
        page = page_at(pages, pathname)
        return page.layout(config), ["nav-link active" if p is page else "nav-link" for p in pages]

    if config.mode is Mode.COMPARE:
        return

    if config.live:
        @callback(app, Output(ids.TICK, "data"), Output(ids.BANNER, "children"),
                      Input(ids.INTERVAL, "n_intervals"), State(ids.TICK, "data"),
                      State(ids.RANK, "value"))
        def poll(_n: int | None, tick: object, rank: int | None) -> tuple[Any, Any]:
            old, new = Tick.from_data(tick), read_tick(config, rank or 0)
            if new.same_content(old):
                raise PreventUpdate
            new = dataclasses.replace(new, n=old.n + 1)
            return new.to_data(), banner(new, store)

    @callback(app, Output(ids.RUN_STATUS, "children"), Input(ids.TICK, "data"))
    def run_status(tick: object) -> str:
        return header_text(Tick.from_data(tick))

    @callback(app, Output(ids.NAV_COUNT, "children"), Output(ids.NAV_COUNT, "className"),
                  Input(ids.TICK, "data"), Input(ids.RANK, "value"))
    @reads_store(store, waiting=lambda _text: ("", "nav-count"))
    def update_findings_count(tick: Tick, rank: int | None) -> tuple[str, str]:
        return findings_count(store.overview(rank or 0)["findings"])

    def failed_download(what: str) -> Any:
        return lambda text: (no_update, html.Div(f"{what} failed: {text}", className="banner-error"))

    @callback(app, Output(ids.DOWNLOAD_SNAPSHOT, "data"), Output(ids.BANNER, "children", allow_duplicate=True),
                  Input(ids.EXPORT_SNAPSHOT_BTN, "n_clicks"), prevent_initial_call=True)
    @reads_store(store, failed=failed_download("Snapshot"), tick_first=False)
    def download_snapshot(n: int | None) -> tuple[Any, Any]:
        if not n:
            raise PreventUpdate
        data = store.snapshot_bytes()
        ov = store.overview()
        name = f"{_safe_filename(ov.get('run_name'))}-step{ov.get('step')}.sqlite"
        return dcc.send_bytes(data, filename=name), no_update

    @callback(app, Output(ids.DOWNLOAD_REPORT, "data"), Output(ids.BANNER, "children", allow_duplicate=True),
                  Input(ids.EXPORT_REPORT_BTN, "n_clicks"), State(ids.RANK, "value"), prevent_initial_call=True)
    @reads_store(store, failed=failed_download("Report"), tick_first=False)
    def download_report(n: int | None, rank: int | None) -> tuple[Any, Any]:
        if not n:
            raise PreventUpdate
        text = build_report(store, rank or 0)
        ov = store.overview(rank or 0)
        return (dcc.send_string(text, filename=f"{_safe_filename(ov.get('run_name'))}-report.html"),
                no_update)
