"""The Layers page's data, without a browser: one row per layer (a block's subtree as one row until it is
opened), the real step numbers as columns, each row's value the norm of its tensors' (checked against the
training loop's), the update-to-data ratio as log10, and the page's callback drawing and extending it."""

from __future__ import annotations

import math

import pytest
import tanh_mlp
import torch
from dash import Patch, no_update
from dash.exceptions import PreventUpdate
from torch import nn

import probes
from dashboard.read import layer_data as ld
from dashboard.read.series import METRICS, open_run
from dashboard.read.store import Store
from dashboard.web.config import AppConfig
from dashboard.web.layer_figures import layer_heat_figure, layer_lines_figure
from dashboard.web.pages import layers as layers_page
from dashboard.web.poll import read_tick


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return tanh_mlp.shared_run(tmp_path_factory)


def view(run_dir, metric: str, opened=None, per_tensor=False):
    store = open_run(run_dir).at(0)
    spec = METRICS[metric]
    tree = ld.load_tree(store, 0)
    measured = ld.measured_modules(store, 0, spec)
    opened = ld.default_opened(tree, spec, measured) if opened is None else opened
    rows = ld.layer_rows(tree, spec, opened, measured, per_tensor=per_tensor)
    return store, tree, rows, ld.layer_heat(store, 0, rows, spec)


def test_one_row_per_layer_in_forward_order_and_a_column_per_step(mlp):
    _, _, rows, heat = view(mlp.run_dir, "grad_norm")
    assert [r.label for r in rows] == list(mlp.layer_paths) and {r.kind for r in rows} == {"layer"}
    assert heat.steps == list(range(0, mlp.steps, tanh_mlp.EVERY)) and len(heat.steps) >= 40
    for i, layer in enumerate(mlp.layer_paths):          # the layer's gradient: its weight's and bias's as one
        for j, step in enumerate(heat.steps):
            want = math.hypot(mlp.grad_norms[(step, f"{layer}.weight")], mlp.grad_norms[(step, f"{layer}.bias")])
            assert math.isclose(heat.values[i][j], want, rel_tol=1e-5)
    # activation statistics: every module that ran is a row (the Tanh layers too)
    _, _, act_rows, act = view(mlp.run_dir, "act_std")
    assert [r.path for r in act_rows] == [str(i) for i in range(11)]
    assert all(v is not None and v > 0 for row in act.values for v in row)
    # one row per tensor, when asked
    _, _, tensor_rows, _ = view(mlp.run_dir, "grad_norm", per_tensor=True)
    assert [r.path for r in tensor_rows] == [f"{layer}.{p}" for layer in mlp.layer_paths for p in ("weight", "bias")]


def test_a_collapsed_model_is_one_row_holding_every_tensor(mlp):
    _, _, rows, heat = view(mlp.run_dir, "grad_norm", opened=set())
    [row] = rows
    assert row.kind == "block" and row.label == "<root> (6 layers)" and len(row.param_ids) == 12
    step = heat.steps[7]
    want = math.sqrt(sum(mlp.grad_norms[(step, f"{layer}.{p}")] ** 2 for layer in mlp.layer_paths
                         for p in ("weight", "bias")))
    assert math.isclose(heat.values[0][7], want, rel_tol=1e-5)


def test_update_ratio_is_drawn_as_log10_with_the_guide(mlp):
    _, _, rows, heat = view(mlp.run_dir, "update_ratio")
    ratios = [v for row in heat.values for v in row if v is not None]
    assert ratios and all(0 < v < 1 for v in ratios)
    shown = heat.shown()
    assert math.isclose(shown[0][3], math.log10(heat.values[0][3]))
    fig = layer_heat_figure(rows, heat, "r")
    trace = fig["data"][0]
    assert trace["zmid"] == -3 and len(trace["y"]) == 6 and trace["x"] == heat.steps
    assert "step %{x}" in trace["hovertemplate"] and "%{y}" in trace["hovertemplate"]
    lines = layer_lines_figure(rows, heat, ld.default_picks(rows), "r")
    assert len(lines["data"]) == 6 and lines["layout"]["shapes"][0]["y0"] == -3     # log10 of the 1e-3 guide
    assert lines["data"][0]["y"][3] == shown[0][3] and lines["data"][0]["customdata"][3] == heat.values[0][3]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.attn(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_blocks_collapse_and_expand(tmp_path):
    """A model of blocks: too many layers for the rows, so each block is one row; blocks.3 opened is its
    layers; the default opens as deep as the rows allow."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(3):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    store = open_run(tmp_path).at(0)
    spec = METRICS["grad_norm"]
    tree = ld.load_tree(store, 0)
    opened = ld.default_opened(tree, spec, set(), max_rows=8)
    rows = ld.layer_rows(tree, spec, opened, set())
    assert [r.label for r in rows] == ["embed", *(f"blocks.{i} (3 layers)" for i in range(4)), "head"]
    block3 = rows[4].module_id
    choices = {c["label"] for c in ld.open_choices(tree, spec, opened, set())}
    assert {"blocks.3", "blocks"} <= choices
    rows = ld.layer_rows(tree, spec, opened | {block3}, set())
    assert [r.label for r in rows][4:] == ["blocks.3.attn", "blocks.3.mlp (2 layers)", "head"]
    assert len(ld.layer_rows(tree, spec, ld.default_opened(tree, spec, set()), set())) == 14   # every layer
    heat = ld.layer_heat(store, 0, rows, spec)
    assert heat.steps == [0, 1, 2] and all(v is not None for v in heat.values[4])


def test_the_page_callback_draws_then_waits_for_new_steps(mlp):
    config = AppConfig(mode="live", store=Store.open_run(mlp.run_dir))
    tick = read_tick(config)
    assert tick.finished
    out = layers_page.render_layers(config, tick, "grad_norm", "layers", None, None, None, {"tick.data"})
    trace = out.heat["data"][0]
    assert trace["y"] == list(mlp.layer_paths) and len(trace["x"]) >= 40
    assert [o["label"] for o in out.open_options] == ["<root>"] and len(out.opened) == 1     # the model, open
    assert out.picked == [f"m{r}" for r in out.state["modules"].values()][:6]
    assert "6 rows · 50 steps shown · 50 full samples" in out.info
    with pytest.raises(PreventUpdate):          # the same view, no new step: nothing to draw
        layers_page.render_layers(config, tick, "grad_norm", "layers", out.opened, out.picked, out.state,
                                  {"tick.data"})
    # new steps (here: the last two, as if they had just arrived) are appended in place, the zoom kept
    grown = layers_page.render_layers(config, tick, "grad_norm", "layers", out.opened, out.picked,
                                      {**out.state, "last": 188, "columns": 48}, {"tick.data"})
    assert isinstance(grown.heat, Patch) and isinstance(grown.lines, Patch) and grown.state["columns"] == 50
    assert grown.state["last"] == 196 and grown.open_options is no_update
    click = {"points": [{"x": 8, "y": "4", "curveNumber": 0}]}
    assert layers_page.clicked_module(click, out.state) == out.state["modules"]["4"]
