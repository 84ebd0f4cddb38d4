"""The Overview's loss chart, opened at a run's first step and extended by every live poll, ends as the chart
loaded fresh at the end: a linear step axis with automatic ticks once the steps span more than a few, no markers
once there are many points, a log axis where the loss spans decades (``figures.loss_look``, the pure builders of
``dashboard.web.pages.overview``). No browser: the patches are applied here as Dash applies them."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from dash.exceptions import PreventUpdate

from dashboard.web import figures
from dashboard.web.pages.overview import draw_loss, extend_loss

VIEW = ["r1", 0]


def apply(fig: dict[str, Any], patch: Any) -> dict[str, Any]:
    """A Dash ``Patch`` of "Extend" operations applied to a figure (what the browser does with it)."""
    fig = copy.deepcopy(fig)
    for op in patch.to_plotly_json()["operations"]:
        assert op["operation"] == "Extend", op
        target: Any = fig
        for key in op["location"]:
            target = target[key]
        target.extend(op["params"]["value"])
    return fig


def series(steps: range | list[int], loss: Any) -> dict[str, Any]:
    steps = list(steps)
    return {"step": steps, "loss": [loss(s) for s in steps], "last": steps[-1] if steps else None}


def follow(steps: list[int], loss: Any, polls: list[int]) -> tuple[dict[str, Any], int]:
    """The chart drawn with the steps up to ``polls[0]``, then extended poll by poll up to each of the others:
    the figure shown at the end and how often it was drawn afresh."""
    shown = [s for s in steps if s <= polls[0]]
    fig, state = draw_loss(series(shown, loss), VIEW)
    fresh = 1
    for upto in polls[1:]:
        new = series([s for s in steps if state["last"] < s <= upto], loss)
        if not new["step"]:
            continue
        extended = extend_loss(state, new)
        if extended is None:                    # the layout changes: drawn afresh from the whole series
            fig, state = draw_loss(series([s for s in steps if s <= upto], loss), VIEW)
            fresh += 1
        else:
            patch, state = extended
            fig = apply(fig, patch)
    return fig, fresh


def decaying(step: int) -> float:
    return 2.0 * math.exp(-step / 80) + 0.05


@pytest.mark.parametrize("first", [0, 2, 7])
def test_a_chart_opened_at_the_start_ends_as_the_chart_loaded_at_the_end(first):
    steps = list(range(320))
    fig, fresh = follow(steps, decaying, [first, *range(first + 3, 320, 3), 319])
    end = figures.loss_figure(series(steps, decaying), uirevision="loss-r1-0")
    assert fig == end
    assert "dtick" not in fig["layout"]["xaxis"] and fig["layout"]["xaxis"]["tickformat"] == "d"
    assert fig["data"][0]["mode"] == "lines" and len(fig["data"][0]["x"]) == 320
    assert fresh <= 3                           # drawn afresh only where the look changed, extended otherwise


def test_a_loss_that_comes_to_span_decades_gets_its_log_axis_live():
    steps = list(range(200))

    def falling(step: int) -> float:
        return 10.0 ** (-step / 50)             # 1 … 1e-4
    fig, _ = follow(steps, falling, [0, *range(60, 200, 20), 199])
    assert fig == figures.loss_figure(series(steps, falling), uirevision="loss-r1-0")
    assert fig["layout"]["yaxis"]["type"] == "log"


def test_the_first_steps_have_one_tick_each_and_markers():
    fig, state = draw_loss(series(range(3), decaying), VIEW)
    assert fig["layout"]["xaxis"]["dtick"] == 1 and fig["data"][0]["mode"] == "lines+markers"
    patch, state = extend_loss(state, series(range(3, 6), decaying))       # still a short span: extended
    assert len(apply(fig, patch)["data"][0]["x"]) == 6 and state["last"] == 5
    assert extend_loss(state, series(range(6, 12), decaying)) is None      # past it: drawn afresh
    with pytest.raises(PreventUpdate):
        extend_loss(state, series([], decaying))


def test_the_shape_of_the_parts_is_the_shape_of_the_whole():
    loss = [3.0, None, float("nan"), 0.5, 40.0, None, 0.2]
    whole = figures.series_shape(list(range(7)), loss)
    for cut in range(8):
        left = figures.series_shape(list(range(cut)), loss[:cut])
        assert figures.series_shape(list(range(cut, 7)), loss[cut:], left) == whole
    assert whole == {"first": 0, "last": 6, "points": 7, "low": 0.2, "high": 40.0, "not_positive": True}
    assert not figures.loss_look(whole)["log"]  # a NaN: no log axis (as loss_figure decides it)
