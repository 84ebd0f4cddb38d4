"""The HTML report's charts: step axes that label whole steps, and no empty panels for a container that never
ran (a ModuleList holds blocks; it is never called, so it has no samples of its own)."""

from __future__ import annotations

import re

import torch
from torch import nn

import probes
from dashboard.read.series import open_run
from dashboard.web import figures
from dashboard.web.report import build_report


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_report_draws_whole_steps_and_no_empty_panels(tmp_path):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(3):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    html = build_report(open_run(tmp_path))
    sections = re.findall(r'<section class="report-module"><h3 class="mono">([^ <]+) ', html)
    assert "embed" in sections and "head" in sections and "blocks" not in sections     # the ModuleList: no samples
    assert "No activation samples" not in html and "No activation histograms" not in html
    # three steps: ticks at 0, 1, 2 (never 0.5), on every step axis
    for fig in (figures.loss_figure({"step": [0, 1, 2], "loss": [1.0, 0.9, 0.8]}),
                figures.heatmap_figure({"step": [0, 1, 2], "counts": [[1, 2]] * 3, "edges": [0.0]}, "r"),
                figures.activation_figure({"step": [0, 1, 2], "mean": [0, 0, 0], "std": [1, 1, 1]}, "r"),
                figures.detail_series_figure({"step": [0, 1, 2], "mean": [0] * 3, "std": [1] * 3}, "r")):
        assert fig["layout"]["xaxis"]["tickformat"] == "d" and fig["layout"]["xaxis"]["dtick"] == 1
    assert html.count('"tickformat":"d"') >= 1 + 3 * len(sections)
