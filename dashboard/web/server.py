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

from ..paths import assets_dir
from ..read.run import NEWEST, RunDir, fold_causes, root_counts
from ..read.shown_text import clip, file_part
from ..read.store import StoreError
from . import ids, security
from .config import AppConfig, Mode
from .downloads import FOLLOW_JS, Downloads
from .pages import Page, page_at, pages_for
from .poll import (
    Tick,
    banner,
    callback,
    header_text,
    mode_badge,
    place_name,
    poll_timing,
    rank_options,
    read_tick,
    reads_store,
    run_name,
    run_options,
    shown_if,
    view_of,
)
from .report import build_report

__all__ = ["AppConfig", "Mode", "create_app"]

ASSETS = assets_dir()
CARTESIAN_PLOTLY_PREFIX = "plotly-cartesian-"


def _safe_filename(name: object) -> str:
    return file_part(name)          # letters, digits, '.', '_', '-'; cut (a 20,000-character run name)


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
    security.install(app.server, host=config.served.host, port=config.served.port, token=config.served.token)
    if cartesian:
        _drop_dash_plotly()

    pages = pages_for(config.mode)
    app.layout = lambda: shell_layout(config, pages)
    register_shell(app, config, pages)
    for page in pages:
        page.register(app, config)
    return app


def header_runs(config: AppConfig) -> list[dict[str, str]]:
    """The run selector's options (every run of the directory, newest first)."""
    if config.mode is Mode.COMPARE:
        return []
    try:
        return run_options(config.source.runs())
    except StoreError:
        return run_options([])


def compared_name(source: RunDir) -> str:
    """The name of a compared run (its newest), as the header names a followed one (:func:`poll.run_name`)."""
    try:
        name = source.run().meta().get("run_name")
    except StoreError:
        name = None
    return clip(str(name)) if name else place_name(source)


def nav(pages: tuple[Page, ...], count: tuple[str, str] = ("", "nav-count")) -> html.Nav:
    """The navigation; the page that counts findings carries ``count`` (text, class: :func:`findings_count`)."""
    return html.Nav([dcc.Link([page.label, html.Span(count[0], id=ids.NAV_COUNT, className=count[1])]
                              if page.counts_findings else page.label,
                              href=page.href, className="nav-link", id=ids.nav_link(page.href))
                     for page in pages], id=ids.NAV, className="nav")


def shell_layout(config: AppConfig, pages: tuple[Page, ...]) -> html.Div:
    tick = read_tick(config)
    disabled, interval = poll_timing(config.live, tick, True, config.poll_ms)
    ranks = list(tick.ranks) or [0]
    runs = header_runs(config)
    if config.mode is Mode.COMPARE:
        assert config.source_b is not None
        subtitle = [html.Span("compare", className="mode mode-compare"),
                    *(html.Span(f"{label}: {compared_name(source)}", className="run-name", title=str(source.where))
                      for label, source in zip(config.labels, (config.source, config.source_b), strict=True))]
    else:
        badge, badge_class = mode_badge(config.live, tick)
        subtitle = [html.Span(badge, id=ids.MODE_BADGE, className=badge_class),
                    html.Span(run_name(tick, config.source), id=ids.RUN_NAME, className="run-name",
                              title=str(config.source.where)),
                    html.Span(header_text(tick), id=ids.RUN_STATUS, className="run-status")]
    export = [] if config.mode is Mode.COMPARE else [
        html.Button("⤓ Snapshot", id=ids.EXPORT_SNAPSHOT_BTN, n_clicks=0, className="btn",
                    title="Download a single-file snapshot of this run (open it with --snapshot)"),
        html.Button("⤓ HTML report", id=ids.EXPORT_REPORT_BTN, n_clicks=0, className="btn",
                    title="Download a standalone HTML report (works offline)"),
        dcc.Store(id=ids.DOWNLOAD_SNAPSHOT, data=None),     # followed by the page (downloads.FOLLOW_JS)
        dcc.Download(id=ids.DOWNLOAD_REPORT),
    ]
    header = html.Header([
        html.Div([html.Span("mod", className="brand-a"), html.Span("scope", className="brand-b")],
                 className="brand"),
        nav(pages, initial_findings_count(config, tick) if any(p.counts_findings for p in pages)
            else ("", "nav-count")),
        html.Div(subtitle, className="subtitle"),
        html.Div([
            dcc.Dropdown(id=ids.RUN, options=runs, value=NEWEST, clearable=False, searchable=False,
                         className="run-select", style=shown_if(len(runs) > 2),
                         optionHeight=44, maxHeight=400),
            dcc.Dropdown(id=ids.RANK, options=rank_options(ranks), value=tick.rank, clearable=False,
                         searchable=False, className="rank-select", style=shown_if(len(ranks) > 1)),
            *export,
        ], className="header-actions"),
    ], id=ids.HEADER, className="header")
    return html.Div([
        dcc.Location(id=ids.URL, refresh=False),
        dcc.Interval(id=ids.INTERVAL, interval=interval, disabled=disabled),
        dcc.Store(id=ids.TICK, data=tick.to_data()),
        dcc.Store(id=ids.SELECTED, data=None),
        dcc.Store(id=ids.EXPANDED, data=None),
        dcc.Store(id=ids.UI_CLICK, data=None),
        header,
        html.Div(id=ids.BANNER, className="banner",
                 children=[] if config.mode is Mode.COMPARE else banner(tick, config.source)),
        html.Main(id=ids.PAGE, className="page"),
    ], className="app")


def findings_count(counts: dict[str, int]) -> tuple[str, str]:
    """The number of active root causes next to "Findings", and its class (coloured by the worst)."""
    total = sum(counts.values())
    worst = next((s for s in Severity if counts.get(s)), None)
    return (str(total) if total else ""), f"nav-count sev-{worst.value}" if worst else "nav-count"


def active_findings_count(config: AppConfig, tick: Tick) -> tuple[str, str]:
    """The count next to "Findings" for the run and rank ``tick`` shows (its active root causes)."""
    run, rank = view_of(config, tick)
    return findings_count(root_counts(fold_causes(run.findings_merged(active=True, rank=rank))))


def initial_findings_count(config: AppConfig, tick: Tick) -> tuple[str, str]:
    """The count the page is loaded with. The shell's callbacks only follow changes of the tick: where
    nothing changes (a closed run, a snapshot) the count drawn here is the one shown."""
    if not tick.ready:
        return "", "nav-count"
    try:
        return active_findings_count(config, tick)
    except StoreError:
        return "", "nav-count"


def register_shell(app: Dash, config: AppConfig, pages: tuple[Page, ...]) -> None:
    source = config.source

    @callback(app, Output(ids.PAGE, "children"), Output(ids.nav_link(dash.ALL), "className"),
                  Input(ids.URL, "pathname"))
    def route(pathname: str | None) -> tuple[Any, list[str]]:
        page = page_at(pages, pathname)
        return page.layout(config), ["nav-link active" if p is page else "nav-link" for p in pages]

    if config.mode is Mode.COMPARE:
        return

    @callback(app, Output(ids.TICK, "data"), Output(ids.BANNER, "children"),
                  Output(ids.RUN, "options"), Output(ids.RUN, "style"),
                  Output(ids.RANK, "options"), Output(ids.RANK, "value"), Output(ids.RANK, "style"),
                  Output(ids.INTERVAL, "disabled"), Output(ids.INTERVAL, "interval"),
                  Input(ids.INTERVAL, "n_intervals"), Input(ids.RUN, "value"), Input(ids.RANK, "value"),
                  State(ids.TICK, "data"))
    def poll(_n: int | None, run: str | None, rank: int | None, tick: object) -> tuple[Any, ...]:
        """The poll (live mode, every interval) and the view (which run, which rank: both modes).
        The run selector lists the directory's runs (shown when there are several); while it says
        "newest", a new run in the directory is shown as soon as it appears. Once the run shown finished
        its pages stop polling it (``poll_timing``)."""
        old, new = Tick.from_data(tick), read_tick(config, run, rank)
        if new.same_content(old):
            raise PreventUpdate
        new = dataclasses.replace(new, n=old.n + 1)
        runs_changed = (new.runs, new.status, new.note, new.run) != (old.runs, old.status, old.note, old.run)
        options = header_runs(config) if runs_changed else no_update
        ranks = list(new.ranks) or [0]
        return (new.to_data(), banner(new, source),
                options, shown_if(len(new.runs) > 1) if runs_changed else no_update,
                rank_options(ranks) if new.ranks != old.ranks else no_update,
                new.rank if rank != new.rank else no_update, shown_if(len(ranks) > 1),
                *poll_timing(config.live, new, run in (None, NEWEST), config.poll_ms))

    @callback(app, Output(ids.RUN_STATUS, "children"), Output(ids.MODE_BADGE, "children"),
              Output(ids.MODE_BADGE, "className"), Output(ids.RUN_NAME, "children"), Input(ids.TICK, "data"))
    def run_status(tick: object) -> tuple[str, str, str, str]:
        shown = Tick.from_data(tick)
        return (header_text(shown), *mode_badge(config.live, shown), run_name(shown, source))

    @callback(app, Output(ids.NAV_COUNT, "children"), Output(ids.NAV_COUNT, "className"),
                  Input(ids.TICK, "data"), prevent_initial_call=True)
    @reads_store(source, waiting=lambda _text: ("", "nav-count"))
    def update_findings_count(tick: Tick) -> tuple[str, str]:
        """A new tick's count (the page loads with :func:`initial_findings_count`: at load time this
        callback waits for the poll, which changes nothing in a closed run or a snapshot)."""
        return active_findings_count(config, tick)

    def failed_download(what: str) -> Any:
        return lambda text: (no_update, html.Div(f"{what} failed: {text}", className="banner-error"))

    downloads = Downloads()
    downloads.install(app.server)

    @callback(app, Output(ids.DOWNLOAD_SNAPSHOT, "data"), Output(ids.BANNER, "children", allow_duplicate=True),
                  Input(ids.EXPORT_SNAPSHOT_BTN, "n_clicks"), State(ids.TICK, "data"), prevent_initial_call=True)
    @reads_store(source, failed=failed_download("Snapshot"), tick_first=False)
    def download_snapshot(n: int | None, tick: object) -> tuple[Any, Any]:
        """Every rank of the run shown, as one file (probes.schema.snapshot of its rank files), written to disk
        and fetched by the page from a one-time URL (dashboard.downloads: never held in memory); its name says the
        step the copy holds, not the live store's."""
        if not n:
            raise PreventUpdate
        run, rank = view_of(config, Tick.from_data(tick))
        ov = run.at(rank).overview(rank)
        link = downloads.snapshot(run, rank, ov.get("run_name"))
        return {"url": link.url, "filename": link.filename}, no_update

    app.clientside_callback(FOLLOW_JS, Output(ids.DOWNLOAD_SNAPSHOT, "clear_data"),
                            Input(ids.DOWNLOAD_SNAPSHOT, "data"), prevent_initial_call=True)

    @callback(app, Output(ids.DOWNLOAD_REPORT, "data"), Output(ids.BANNER, "children", allow_duplicate=True),
                  Input(ids.EXPORT_REPORT_BTN, "n_clicks"), State(ids.TICK, "data"), prevent_initial_call=True)
    @reads_store(source, failed=failed_download("Report"), tick_first=False)
    def download_report(n: int | None, tick: object) -> tuple[Any, Any]:
        if not n:
            raise PreventUpdate
        run, rank = view_of(config, Tick.from_data(tick))
        text = build_report(run, rank)
        ov = run.at(rank).overview(rank)
        return (dcc.send_string(text, filename=f"{_safe_filename(ov.get('run_name'))}-report.html"),
                no_update)
