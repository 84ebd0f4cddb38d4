"""Small presentational building blocks shared by the pages (pure functions returning
Dash components). Text is always passed as component children, which Dash renders as
text, never as HTML."""

from __future__ import annotations

from types import MappingProxyType

import json

from dash import html

from .figures import fmt_count, fmt_num

# Short labels for the badges drawn on tree nodes.
CODE_LABELS = MappingProxyType({
    "unregistered-module": "unregistered",
    "unregistered-tensor": "unregistered tensor",
    "not-in-optimizer": "not in optimizer",
    "stale-optimizer-param": "stale optimizer param",
    "frozen-parameter": "frozen",
    "dead-layer": "dead",
    "dead-units": "dead units",
    "saturated": "saturated",
    "not-updating": "not updating",
    "grad-accumulating": "grad accumulating",
    "training-mode-mismatch": "mode mismatch",
    "train-mode-under-no-grad": "train mode under no_grad",
    "non-finite": "NaN/Inf",
    "forward-bypassed": "forward bypassed",
    "shared-parameter": "shared",
})

SEVERITY_ICONS = MappingProxyType({"error": "●", "warning": "▲", "info": "■"})


def code_label(code: str) -> str:
    return CODE_LABELS.get(code, code)


def badge(code: str, severity: str) -> html.Span:
    sev = severity if severity in SEVERITY_ICONS else "info"
    return html.Span(code_label(code), className=f"badge sev-{sev}", title=f"{code} ({sev})")


def finding_badges(findings: list[dict], kind: str = "registered") -> list:
    """One badge per finding code (the kind badge already says "unregistered")."""
    seen, out = set(), []
    if kind != "registered":
        seen.add("unregistered-module")
    for f in findings:
        if f["code"] in seen:
            continue
        seen.add(f["code"])
        out.append(badge(f["code"], f["severity"]))
    return out


def kind_badge(kind: str):
    if kind == "registered":
        return None
    return html.Span(kind, className=f"badge kind-{kind}",
                     title="not in model.modules(): reachable through Python attributes only"
                     if kind == "unregistered" else "executed in forward but not reachable")


def severity_pill(severity: str, text: str | None = None) -> html.Span:
    sev = severity if severity in SEVERITY_ICONS else "info"
    return html.Span([SEVERITY_ICONS[sev], " ", text or sev], className=f"pill sev-{sev}")


def params_text(m: dict) -> str:
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


def card(label: str, value, sub=None, cls: str = "") -> html.Div:
    return html.Div([html.Div(label, className="card-label"),
                     html.Div(value, className="card-value"),
                     html.Div(sub, className="card-sub") if sub else None],
                    className=f"card {cls}".strip())


def evidence_block(evidence) -> html.Details | None:
    if not evidence:
        return None
    text = json.dumps(evidence, indent=2, sort_keys=True, default=str) if not isinstance(evidence, str) \
        else evidence
    return html.Details([html.Summary("evidence"), html.Pre(text, className="evidence")])


def table(headers: list[str], rows: list[list], cls: str = "") -> html.Table:
    return html.Table([html.Thead(html.Tr([html.Th(h) for h in headers])),
                       html.Tbody([html.Tr([_td(c) for c in r]) for r in rows])],
                      className=f"table {cls}".strip())


def _td(c):
    if isinstance(c, html.Td):
        return c
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        return html.Td(fmt_num(c), className="num")
    if c is None:
        return html.Td("–", className="muted")
    return html.Td(c)


def message(text: str, cls: str = "muted") -> html.Div:
    return html.Div(text, className=f"message {cls}")


def finding_card(f: dict, **attrs) -> html.Div:
    """One finding: severity and code, path, steps seen, message, fix and evidence. ``attrs`` go
    to the outer Div (e.g. click attributes); its class marks severity and resolved ones."""
    cls = f"finding sev-border-{f['severity']}" + ("" if f.get("active", 1) else " inactive")
    if "className" in attrs:
        cls = f"{attrs.pop('className')} {cls}"
    return html.Div([
        html.Div([severity_pill(f["severity"], f["code"]),
                  html.Span(f["path"] or "(root)", className="mono path"),
                  html.Span("resolved", className="badge resolved") if not f.get("active", 1) else None,
                  html.Span(f"steps {f.get('first_step')}–{f.get('last_step')}", className="steps")
                  if f.get("first_step") is not None else None], className="finding-head"),
        html.Div(f["message"], className="finding-message"),
        html.Div([html.B("Fix: "), f["fix"]], className="finding-fix") if f.get("fix") else None,
        evidence_block(f.get("evidence")),
    ], className=cls, **attrs)
