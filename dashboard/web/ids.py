"""Every component id of the dashboard, in one place.

Pattern-matching ids are dicts built by the helpers at the bottom.
"""

from __future__ import annotations

from probes.schema import StrEnum

# shell
URL = "url"
HEADER = "header"
NAV = "nav"
NAV_COUNT = "nav-findings-count"
PAGE = "page"
BANNER = "banner"
INTERVAL = "poll-interval"
TICK = "tick"                  # dashboard.web.poll.Tick.to_data(): replaced when the store (or the view) changed
SELECTED = "selected-module"   # {"run", "rank", "module_id"}: the view it was made in, and the module
EXPANDED = "expanded-nodes"    # {"view": [run, rank], "ids": [module ids]}
RUN = "run-select"             # a run key, or dashboard.read.run.NEWEST (follow the newest run)
RANK = "rank-select"
RUN_NAME = "run-name"          # the run's name in the header (its directory's path: the title)
RUN_STATUS = "run-status"
MODE_BADGE = "mode-badge"      # "live" (a run that trains), "finished", "snapshot"

# export
EXPORT_SNAPSHOT_BTN = "export-snapshot-btn"
EXPORT_REPORT_BTN = "export-report-btn"
DOWNLOAD_SNAPSHOT = "download-snapshot"   # {"url", "filename"}: a snapshot to fetch (dashboard.downloads)
DOWNLOAD_REPORT = "download-report"

# overview page
OV_CARDS = "ov-cards"
OV_LOSS = "ov-loss"
OV_LOSS_STATE = "ov-loss-state"
OV_TOP_FINDINGS = "ov-top-findings"
OV_ERRORS = "ov-probe-errors"
OV_RANKS = "ov-ranks"          # the per-rank table (a run of several ranks)

# modules page (tree + detail)
TREE = "tree"
TREE_SEARCH = "tree-search"
TREE_FILTER = "tree-filter"
TREE_INFO = "tree-info"
TREE_STATE = "tree-state"
TREE_DATA = "tree-data"     # rows of the visible tree (plain data, drawn by assets/modscope.js)
DETAIL = "detail"
DETAIL_HEADER = "detail-header"
DETAIL_FINDINGS = "detail-findings"
DETAIL_ACT = "detail-activation"
DETAIL_HEAT = "detail-heat"
DETAIL_HEAT_STATE = "detail-heat-state"  # {"key", "has_data"}: the module whose heat map is drawn
DETAIL_PARAMS = "detail-params"
DETAIL_RANKS = "detail-ranks"  # local gradient norms per rank, side by side
DETAIL_STATE = "detail-state"  # {"module_id", "last"} for incremental updates
DETAIL_OPEN = "detail-open"    # keys of the <details> opened in the detail (components.details_key), kept over redraws
DETAIL_TOGGLE = "detail-toggle"  # {"key", "open", "t"}: a <details> the user opened or closed
                                 # (written by assets/modscope.js)

# findings page
FINDINGS_LIST = "findings-list"
FINDINGS_SEVERITY = "findings-severity"
FINDINGS_SHOW_RESOLVED = "findings-show-resolved"
FINDINGS_OPEN = "findings-open"        # keys of the opened <details> (components.details_key), kept over redraws
FINDINGS_TOGGLE = "findings-toggle"    # {"keys", "t"}: the <details> open after the user's last toggle
                                       # (written by assets/modscope.js; kept in the tab's sessionStorage:
                                       # what was opened is drawn open again when the user comes back)

# layers page (how each layer trains over time)
LAYERS_METRIC = "layers-metric"
LAYERS_ROWS = "layers-rows"            # "layers" (modules and blocks) or "tensors" (one row per tensor)
LAYERS_OPEN = "layers-open"            # module ids of the open blocks (their children are rows)
LAYERS_PICK = "layers-pick"            # row keys the line chart draws
LAYERS_INFO = "layers-info"
LAYERS_HEAT = "layers-heat"
LAYERS_LINES = "layers-lines"
LAYERS_STATE = "layers-state"          # what is drawn: {"view", "rows", "last", "columns", "user_opened"}

# module detail: each parameter's history
DETAIL_PARAM_HISTORY = "detail-param-history"
DETAIL_PARAM_HISTORY_STATE = "detail-param-history-state"

# compare page
CMP_SUMMARY = "cmp-summary"
CMP_FINDINGS = "cmp-findings"
CMP_KEYS = "cmp-keys"
CMP_MODULES = "cmp-modules"
CMP_CHANGED_ONLY = "cmp-changed-only"
CMP_RESOLVED = "cmp-resolved"
CMP_APPEARED = "cmp-appeared"
CMP_KEYS_ADDED = "cmp-keys-added"
CMP_KEYS_REMOVED = "cmp-keys-removed"

# Clicks on tree rows and findings: rows carry data-action / data-mid attributes and
# assets/modscope.js writes {"action", "id", "t"} into this store (one listener for the
# whole page instead of one pattern-matching callback input per row, which made
# rendering large trees slow).
UI_CLICK = "ui-click"


class ClickAction(StrEnum):
    TOGGLE = "toggle"      # expand or collapse a tree node
    SELECT = "select"      # select a module (tree row)
    OPEN = "open"          # select a module and open the Modules page (a finding)


def click_attrs(action: ClickAction, module_id: int | None) -> dict[str, str]:
    """Attributes that make a click anywhere in a component do ``action`` (read by assets/modscope.js):
    for the mouse only. Such a component is no control (no role, not focusable: it may hold toggles of
    its own, and interactive content inside a button is invalid); the keyboard and assistive
    technology reach the action through a control of its own, :func:`button_attrs`."""
    return {"data-action": action.value, "data-mid": "" if module_id is None else str(module_id)}


def button_attrs(action: ClickAction, module_id: int | None, label: str) -> dict[str, str]:
    """Attributes of a native ``html.Button`` that does ``action``: its click goes the same way as
    :func:`click_attrs`' (assets/modscope.js); the browser makes it focusable and clicks it on Enter or
    Space. ``label``: its accessible name (it names the visible text too)."""
    return {**click_attrs(action, module_id), "type": "button", "aria-label": label}


def toggle_attrs(store: str) -> dict[str, str]:
    """Attributes of a container whose ``<details>`` (those drawn by components.details with a key)
    report the user's toggles into ``store`` (a ``dcc.Store``; read by assets/modscope.js)."""
    return {"data-toggle-store": store}


def nav_link(href: str) -> dict[str, str]:
    """The id of the navigation link to ``href``."""
    return {"type": "nav", "href": href}
