"""One module per page: ``layout(config)`` builds the page, ``register(app, config)`` its callbacks.

``pages_for(mode)`` is the one list of pages: the navigation, the routing and the registration
of callbacks all read it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dash import Dash

from ..config import AppConfig, Mode
from . import compare, findings, layers, modules, overview


@dataclass(frozen=True)
class Page:
    href: str
    label: str
    layout: Callable[[AppConfig], Any]
    register: Callable[[Dash, AppConfig], None]
    counts_findings: bool = False      # its navigation link carries the number of active findings


def pages_for(mode: Mode) -> tuple[Page, ...]:
    """The pages of ``mode``, in navigation order; the first is the home page ("/")."""
    if mode is Mode.COMPARE:
        return (Page("/", "Compare", compare.layout, compare.register),)
    return (Page("/", "Overview", overview.layout, overview.register),
            Page("/modules", "Modules", modules.layout, modules.register),
            Page("/layers", "Layers", layers.layout, layers.register),
            Page("/findings", "Findings", findings.layout, findings.register, counts_findings=True))


def page_at(pages: tuple[Page, ...], pathname: str | None) -> Page:
    """The page a URL path shows (``/modules`` and below it: Modules); the home page for others."""
    path = pathname or "/"
    for page in pages[1:]:
        if path == page.href or path.startswith(page.href + "/"):
            return page
    return pages[0]
