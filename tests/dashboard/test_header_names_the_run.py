"""The header names the run shown (the name given to ``watch(run_name=...)``, else the run directory's name),
never the path to it on the serving machine: that is only the name's tooltip (``title``). No browser."""

from __future__ import annotations

from typing import Any

from bench import synth_store
from dashboard.read.store import Store
from dashboard.web import server
from dashboard.web.config import AppConfig, Mode
from dashboard.web.pages import pages_for
from dashboard.web.poll import read_tick, run_name
from probes import schema


def header_of(config: AppConfig) -> Any:
    layout = server.shell_layout(config, pages_for(config.mode))
    return next(c for c in layout.children if getattr(c, "id", None) == "header")


def shown_text(component: Any) -> list[str]:
    """Every string the component and its children show (not their attributes)."""
    children = getattr(component, "children", component)
    if isinstance(children, str):
        return [children]
    if isinstance(children, (list, tuple)):
        return [t for c in children for t in shown_text(c)]
    return [] if children is None or children is component else shown_text(children)


def named(header: Any, css: str) -> list[Any]:
    out, todo = [], [header]
    while todo:
        c = todo.pop()
        if getattr(c, "className", None) == css:
            out.append(c)
        kids = getattr(c, "children", None)
        todo.extend(kids if isinstance(kids, (list, tuple)) else [kids] if hasattr(kids, "children") else [])
    return out


def test_the_header_names_the_run_not_its_path(tmp_path):
    run_dir = tmp_path / "home" / "alice" / "exp-7"
    config = AppConfig(mode="live", store=Store.open_run(run_dir))
    # before the first sample: the directory's name
    [name] = named(header_of(config), "run-name")
    assert (name.id, name.children, name.title) == ("run-name", "exp-7", str(run_dir))
    assert not any(str(tmp_path) in t for t in shown_text(header_of(config)))
    # once written: the name the run was given (the header's callback follows the tick)
    synth_store.demo(run_dir / schema.store_filename("r1", 0), steps=3, run_name="xor baseline")
    tick = read_tick(config)
    assert tick.name == "xor baseline" and run_name(tick, config.source) == "xor baseline"
    header = header_of(config)
    [name] = named(header, "run-name")
    assert (name.children, name.title) == ("xor baseline", str(run_dir))
    assert not any(str(tmp_path) in t or "alice" in t for t in shown_text(header))


def test_a_long_run_name_is_cut(tmp_path):
    run_dir = tmp_path / "run"
    synth_store.demo(run_dir / schema.store_filename("r1", 0), steps=1, run_name="n" * 20_000)
    tick = read_tick(AppConfig(mode="live", store=Store.open_run(run_dir)))
    assert 0 < len(tick.name) < 1_000 and tick.name.startswith("nnn")


def test_compare_names_both_runs(tmp_path):
    a, b = tmp_path / "alice" / "before", tmp_path / "alice" / "after"
    synth_store.demo(a / "modscope.sqlite", steps=2)
    synth_store.demo(b / "modscope.sqlite", steps=2, fixed=True)
    config = AppConfig(mode=Mode.COMPARE, store=Store.open_snapshot(a / "modscope.sqlite"),
                       store_b=Store.open_snapshot(b / "modscope.sqlite"))
    header = header_of(config)
    names = named(header, "run-name")
    assert sorted((n.children, n.title) for n in names) == sorted(
        [("before: demo", str(config.source.where)), ("after: demo-fixed", str(config.source_b.where))])
    assert not any("alice" in t for t in shown_text(header))
