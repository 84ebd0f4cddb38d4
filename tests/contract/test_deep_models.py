"""A real ``nn.Module`` nested 500 deep (each level holds the next: what PyTorch's own recursive walks still take)
is watched, its tree read and drawn, and reported as HTML: every tree walk of modscope's is iterative, so none of
it depends on Python's recursion limit (the report is made here under a limit far below the model's depth)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes
from dashboard.read.run import RunDir
from dashboard.read.store import Store
from dashboard.web.pages import modules as modules_page

REPO = Path(__file__).resolve().parents[2]
DEPTH = 500


class Level(nn.Module):
    """One level: a layer and the next level; the deepest also holds a layer in a plain list (the bug modscope
    finds, 500 levels down). The forward walks the chain in a loop (a recursive forward would hit the recursion
    limit inside PyTorch itself)."""

    def __init__(self, inner: Level | None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = inner
        self.held = [nn.Linear(4, 4)] if inner is None else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        level: Level | None = self
        while level is not None:
            x = torch.tanh(level.fc(x))
            for layer in level.held:
                x = layer(x)
            level = level.inner
        return x


def deep_model() -> Level:
    model = Level(None)
    for _ in range(DEPTH - 1):                     # built bottom-up: no recursion here either
        model = Level(model)
    return model


@pytest.fixture(scope="module")
def deep_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("deep") / "run"
    model = deep_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert w.probe_errors == {}
        found = w.findings()
    deepest = "inner." * (DEPTH - 1) + "held[0]"
    assert any(f.code == "unregistered-module" and f.path == deepest for f in found)
    return run_dir


def test_the_tree_of_a_500_deep_model_is_read_and_drawn(deep_run):
    store = Store.open_run(deep_run)
    deepest = store.module_by_path(0, "inner." * (DEPTH - 1) + "held[0]")
    assert deepest is not None and deepest["depth"] == DEPTH
    ancestors = store.ancestors(0, deepest["module_id"])
    assert len(ancestors) == DEPTH and ancestors[0] == store.root(0)["module_id"]
    inside = store.subtree_finding_counts(0)
    assert inside[store.root(0)["module_id"]].get("error", 0) >= 1          # counted all the way up
    expanded = modules_page.expand_to(store, 0, deepest["module_id"], None, [])["ids"]
    tree, _ = modules_page.build_tree(store, 0, expanded, deepest["module_id"])
    (row,) = [r for r in tree["rows"] if r["selected"]]
    assert row["id"] == deepest["module_id"] and row["level"] == DEPTH + 1
    assert row["indent"] <= modules_page.tree_row(store.root(0), expanded=True, selected=False, findings=[],
                                                   inside=None)["indent"] + 60      # drawn within the pane


def test_the_html_report_of_a_500_deep_model(deep_run, tmp_path):
    out = tmp_path / "report.html"
    code = ("import sys; sys.setrecursionlimit(300); from dashboard.cli import main; "
            "sys.exit(main(['export', '--run', sys.argv[1], '-o', sys.argv[2]]))")
    r = subprocess.run([sys.executable, "-c", code, str(deep_run), str(out)], cwd=str(REPO), capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    report = out.read_text()
    tree = report.split('<ul class="report-tree">', 1)[1]
    assert "held[0]" in tree and "listed under their ancestor at that level, by path" in tree
    # nesting stays shallow enough for a browser's parser (it flattens markup nested ~512 elements deep)
    depth = deepest = 0
    for tag in re.finditer(r"<(/?)ul\b", tree):
        depth += -1 if tag.group(1) else 1
        deepest = max(deepest, depth)
    assert deepest < 100


def test_findings_and_runs_read_under_a_low_recursion_limit(deep_run):
    code = ("import sys; sys.setrecursionlimit(300); from dashboard.cli import main; "
            "sys.exit(main(['findings', '--run', sys.argv[1], '--json']))")
    r = subprocess.run([sys.executable, "-c", code, str(deep_run)], cwd=str(REPO), capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
    assert r.returncode == 0 and "inner.inner" in r.stdout, r.stderr
    assert RunDir.open(deep_run).runs()
