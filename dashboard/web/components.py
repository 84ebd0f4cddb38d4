"""Small presentational building blocks shared by the pages (pure functions returning
Dash components or plain data). Text is always passed as component children, which Dash
renders as text, never as HTML."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dash import html

from probes.schema import FindingCode, ModuleKind, Severity, code_label, display_path

from ..read.crossrank import format_ranks
from ..read.shown_text import FULL_MAX, LABEL_MAX, TEXT_MAX, clip, title
from . import ids
from .figures import fmt_count, fmt_num

KEY_MAX = 400             # characters of a finding's code and path in the keys of its <details> (details_key)
PATH_MAX = 300            # characters of a finding's path on its card (all of them, to TITLE_MAX, in its tooltip)
SEVERITY_ICONS = MappingProxyType({Severity.ERROR: "●", Severity.WARNING: "▲", Severity.INFO: "■"})

KIND_TITLES: MappingProxyType[str, str] = MappingProxyType({
    ModuleKind.UNREGISTERED: "not in model.modules(): reachable through Python attributes only",
    ModuleKind.RUNTIME: "executed in forward but not reachable through attributes",
})


def severity_of(value: object) -> Severity:
    """The severity a value names; info for anything this version does not know (a newer writer)."""
    try:
        return Severity(str(value))
    except ValueError:
        return Severity.INFO


# -- badges: the one rule for the tree, the module detail, compare and the report ---------------------
@dataclass(frozen=True)
class BadgeSpec:
    code: str
    label: str
    severity: Severity

    def to_data(self) -> dict[str, str]:
        """The plain data the tree's script draws (assets/modscope.js)."""
        return {"code": self.code, "label": self.label, "sev": self.severity.value}


def badge_specs(findings: Iterable[Mapping[str, Any]], kind: str = ModuleKind.REGISTERED) -> list[BadgeSpec]:
    """One badge per finding code, in the order given (worst first, as the store returns them). A
    module drawn as unregistered or runtime gets no 'unregistered' badge: its kind badge says it."""
    seen: set[str] = set() if kind == ModuleKind.REGISTERED else {FindingCode.UNREGISTERED_MODULE.value}
    out = []
    for f in findings:
        code = str(f["code"])
        if code in seen:
            continue
        seen.add(code)
        out.append(BadgeSpec(clip(code), clip(code_label(code)), severity_of(f["severity"])))
    return out


def badge(spec: BadgeSpec) -> html.Span:
    return html.Span(spec.label, className=f"badge sev-{spec.severity.value}",
                     title=f"{spec.code} ({spec.severity.value})")


def finding_badges(findings: Iterable[Mapping[str, Any]], kind: str = ModuleKind.REGISTERED) -> list[html.Span]:
    return [badge(spec) for spec in badge_specs(findings, kind)]


def kind_badge(kind: str | None) -> html.Span | None:
    if kind is None or kind == ModuleKind.REGISTERED:
        return None
    return html.Span(clip(kind), className=f"badge kind-{clip(kind, 40)}", title=KIND_TITLES.get(kind, ""))


def severity_pill(severity: object, text: str | None = None) -> html.Span:
    sev = severity_of(severity)
    return html.Span([SEVERITY_ICONS[sev], " ", clip(text or sev.value)], className=f"pill sev-{sev.value}",
                     title=title(text))


def params_text(m: Mapping[str, Any]) -> str:
    total, trainable, in_opt = m.get("params_total", 0), m.get("params_trainable", 0), \
        m.get("params_in_optimizer", 0)
    if not total:
        return ""
    s = f"{fmt_count(total)} params"
    if trainable != total:
        s += f" · {fmt_count(trainable)} trainable"
    if in_opt != trainable:
        s += f" · {fmt_count(in_opt)} in optimizer"
    return s


def card(label: str, value: Any, sub: Any = None, cls: str = "") -> html.Div:
    return html.Div([html.Div(label, className="card-label"),
                     html.Div(value, className="card-value"),
                     html.Div(sub, className="card-sub") if sub else None],
                    className=f"card {cls}".strip())


def details_key(part: str, f: Mapping[str, Any]) -> str:
    """What names a finding's ``<details>`` (``part``: "evidence" or "consequences") or control ("open",
    "top": ``data-focus-key``, where assets/modscope.js puts the focus back) over redraws: the part, the
    finding's code and its path (a long one as its start and a digest of it: a key is sent with every card)."""
    code, path = (str(f.get(k) or "") for k in ("code", "path"))
    if len(code) + len(path) > KEY_MAX:
        digest = hashlib.sha1(f"{code}\0{path}".encode("utf-8", "surrogatepass")).hexdigest()[:16]
        code, path = code[:KEY_MAX // 4], f"{path[:KEY_MAX // 2]}#{digest}"
    return json.dumps([part, code, path], separators=(",", ":"))


def toggled(opened: object, toggle: object) -> list[str]:
    """The keys of the ``<details>`` to draw open: those the browser last reported open (``toggle``:
    {"keys", "t"}, the whole set, written by assets/modscope.js into the store named by the container's
    :func:`ids.toggle_attrs` after each of the user's toggles), else ``opened`` (a page's store of them)."""
    if isinstance(toggle, dict) and isinstance(toggle.get("keys"), list):
        return [k for k in toggle["keys"] if isinstance(k, str)]
    return [k for k in opened if isinstance(k, str)] if isinstance(opened, list) else []


def details(children: list[Any], cls: str, key: str | None, opened: Collection[str] | None) -> html.Details:
    """An ``<details>``; with ``opened`` (the keys the user opened), one that stays as the user left it
    when it is drawn again: open when ``key`` is in ``opened``, and marked for assets/modscope.js, which
    reports the keys of the open ones (``data-open-key``; ``data-open`` says the state it was drawn in)
    into the store its container names (``ids.toggle_attrs``) after each toggle; :func:`toggled` reads it."""
    if opened is None or key is None:
        return html.Details(children, className=cls)
    is_open = key in opened
    return html.Details(children, className=cls, open=is_open,
                        **{"data-open-key": key, "data-open": "true" if is_open else "false"})


def evidence_block(evidence: Any, *, key: str | None = None, opened: Collection[str] | None = None
                   ) -> html.Details | None:
    if not evidence:
        return None
    text = json.dumps(evidence, indent=2, sort_keys=True, default=str) if not isinstance(evidence, str) \
        else evidence
    if len(text) > FULL_MAX:
        text = f"{text[:FULL_MAX]}\n… (the first {FULL_MAX:,} of {len(text):,} characters)"
    return details([html.Summary("evidence"), html.Pre(text, className="evidence")], "evidence-box", key, opened)


def name_span(text: object, cls: str = "", limit: int = LABEL_MAX) -> html.Span:
    """A name as a Span: cut to ``limit``, the whole value (to ``TITLE_MAX``) in its tooltip."""
    return html.Span(clip(text, limit), className=cls or None, title=title(text, limit))


def long_text(text: object, cls: str = "", limit: int = TEXT_MAX) -> html.Div:
    """A message as a Div: cut to ``limit``; a longer one with a "show all N characters" toggle holding the value
    (its first ``FULL_MAX`` characters, said so, when longer)."""
    s = "" if text is None else str(text)
    if len(s) <= limit:
        return html.Div(s, className=cls or None)
    more = f"show all {len(s):,} characters" if len(s) <= FULL_MAX else \
        f"show the first {FULL_MAX:,} of {len(s):,} characters"
    return html.Div([*([clip(s, limit)] if limit else []), html.Details([html.Summary(more, className="show-all"),
                                                   html.Pre(s[:FULL_MAX], className="full-text")])],
                    className=cls or None)


def table(headers: list[str], rows: list[list[Any]], cls: str = "") -> html.Table:
    return html.Table([html.Thead(html.Tr([html.Th(h) for h in headers])),
                       html.Tbody([html.Tr([_td(c) for c in r]) for r in rows])],
                      className=f"table {cls}".strip())


def _td(c: Any) -> html.Td:
    if isinstance(c, html.Td):
        return c
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        return html.Td(fmt_num(c), className="num")
    if c is None:
        return html.Td("–", className="muted")
    if isinstance(c, str):
        return html.Td(clip(c), title=title(c))
    return html.Td(c)


def message(text: str, cls: str = "muted") -> html.Div:
    return html.Div(text, className=f"message {cls}")


def seen_text(f: Mapping[str, Any]) -> str | None:
    """How often and when a finding was seen: 'seen 12 times, steps 3–40', 'seen once, step 7'."""
    first, last, count = f.get("first_step"), f.get("last_step"), f.get("count")
    times = None if count is None else ("seen once" if int(count) == 1 else f"seen {int(count):,} times")
    if first is None:
        return times
    span = f"step {first}" if last is None or last == first else f"steps {first}–{last}"
    return f"{times}, {span}" if times else span


def cause_text(f: Mapping[str, Any]) -> str | None:
    """'caused by unregistered-module at encoder.blocks[0]' for a consequence."""
    if not f.get("cause_code"):
        return None
    return f"caused by {clip(f['cause_code'])} at {clip(display_path(str(f.get('cause_path') or '')), TEXT_MAX)}"


def consequences_text(n: int) -> str:
    return f"{n} consequence{'' if n == 1 else 's'}"


def removed_badge(f: Mapping[str, Any]) -> html.Span | None:
    """A finding about a module no longer part of the model (``module_removed_step``): "module removed at step N",
    not "resolved" (the module left the model at that step: nothing was fixed)."""
    step = f.get("module_removed_step")
    if step is None:
        return None
    return html.Span(f"module removed at step {step}", className="badge kind-removed",
                     title=f"its module was removed at step {step}: no longer part of the model")


def finding_card(f: Mapping[str, Any], *, show_ranks: bool = False, opens_module: bool = False,
                 folded: bool = False, opened: Collection[str] | None = None, **attrs: Any) -> html.Div:
    """One finding: severity and code, path, the ranks it occurs on (``show_ranks``), how often and
    when it was seen, message, fix, evidence, and (a root cause) its consequences folded under it: "4
    consequences", opened on demand. ``attrs`` go to the outer Div; its class marks severity and
    resolved ones. A consequence shown on its own (its cause is not listed) names its cause. With
    ``opened`` (keys of :func:`details_key`) the evidence and the consequences are drawn as the user
    left them.

    With ``opens_module`` the finding (and each of its consequences) selects its module and opens the
    Modules page: its path is a button that does it (the control the keyboard and assistive technology
    reach, named "<code> at <path>: show this module"), and for the mouse a click anywhere else on the
    card does it too. The card itself is no control: it holds the evidence and consequences toggles,
    which must stay toggles of their own (interactive content inside a button is invalid ARIA)."""
    sev = severity_of(f["severity"])
    full_path = display_path(f["path"])
    path = clip(full_path, PATH_MAX)              # whole in its tooltip
    mid = f.get("module_id")
    module = int(mid) if opens_module and mid is not None else None      # the module a click opens
    opens = module is not None
    own: dict[str, Any] = {}
    if module is not None:
        own = {**ids.click_attrs(ids.ClickAction.OPEN, module), "title": f"show module {clip(full_path, 2 * PATH_MAX)}"}
    elif opens_module:      # no module to open: a click on it does nothing (nor opens the card around it)
        own = ids.click_attrs(ids.ClickAction.OPEN, -1)
    own.update(attrs)
    cls = f"finding sev-border-{sev.value}" + (" clickable" if opens else "") \
        + ("" if f.get("active", 1) else " inactive")
    if "className" in own:
        cls = f"{own.pop('className')} {cls}"
    ranks = f.get("ranks") or []
    consequences = list(f.get("consequences") or [])
    cause = None if folded else cause_text(f)
    return html.Div([
        html.Div([severity_pill(sev, f["code"]),
                  html.Button(path, className="mono path finding-open", **{"data-focus-key": details_key("open", f)},
                              **ids.button_attrs(ids.ClickAction.OPEN, module,
                                                 f"{clip(f['code'])} at {path}: show this module"))
                  if module is not None else html.Span(path, className="mono path", title=title(full_path, PATH_MAX)),
                  removed_badge(f) or (html.Span("resolved", className="badge resolved")
                                        if not f.get("active", 1) else None),
                  html.Span(format_ranks(ranks), className="badge ranks", title="ranks it occurs on")
                  if show_ranks and ranks else None,
                  html.Span(seen_text(f), className="steps") if seen_text(f) else None], className="finding-head"),
        long_text(f["message"], "finding-message"),
        html.Div(cause, className="finding-cause") if cause else None,
        html.Div([html.B("Fix: "), clip(f["fix"], TEXT_MAX)], className="finding-fix", title=title(f["fix"], TEXT_MAX))
        if f.get("fix") else None,
        evidence_block(f.get("evidence"), key=details_key("evidence", f), opened=opened),
        details([html.Summary(consequences_text(len(consequences)), className="consequences-toggle"),
                 html.Div([finding_card(c, show_ranks=show_ranks, opens_module=opens_module, folded=True,
                                        opened=opened)
                           for c in consequences], className="consequences-list")],
                "consequences", details_key("consequences", f), opened) if consequences else None,
    ], className=cls, **own)


def yes_no(v: object) -> str:
    return "–" if v is None else ("yes" if v else "no")


def int_or_zero(v: object) -> int:
    return v if isinstance(v, int) else 0


def count_or_unknown(v: object) -> str:
    """A count as the detail says it: "1,234", or "unknown" (NULL, or a value of the wrong type in the store)."""
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else "unknown"
