"""``modscope series``: a run's metric over time as a tidy CSV (``step,rank,path,metric,value``), the same table
as the pandas function ``dashboard.read.series.read_series``; checked against the norms the training loop took."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import pandas as pd
import pytest
import tanh_mlp

from dashboard.read.series import METRICS, MetricError, read_series

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def modscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "app.py"), "series", *args], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return tanh_mlp.shared_run(tmp_path_factory)


def test_csv_gradient_norms_equal_the_training_loops(mlp, tmp_path):
    out = tmp_path / "grad.csv"
    r = modscope("--run", str(mlp.run_dir), "--metric", "grad_norm", "-o", str(out))
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "step,rank,path,metric,value"
    df = pd.read_csv(out)
    steps = sorted(set(df["step"]))
    assert len(steps) >= 40 and steps == list(range(0, mlp.steps, tanh_mlp.EVERY))
    assert set(df["path"]) == {f"{layer}.{p}" for layer in mlp.layer_paths for p in ("weight", "bias")}
    assert len(df) == len(steps) * 2 * len(mlp.layer_paths)              # one row per step, rank and path
    assert set(df["rank"]) == {0} and set(df["metric"]) == {"grad_norm"}
    for row in df.itertuples():
        assert math.isclose(row.value, mlp.grad_norms[(row.step, row.path)], rel_tol=1e-5), row


def test_the_pandas_function_returns_the_csv_table(mlp):
    for metric in ("grad_norm", "update_ratio", "act_mean", "loss"):
        r = modscope("--run", str(mlp.run_dir), "--metric", metric)          # to stdout
        assert r.returncode == 0, r.stderr
        csv = pd.read_csv(io.StringIO(r.stdout), keep_default_na=False, dtype={"path": "str"})
        df = read_series(mlp.run_dir, metric)
        assert list(df.columns) == ["step", "rank", "path", "metric", "value"]
        pd.testing.assert_frame_equal(df, csv, check_dtype=False, rtol=0, atol=0)
        assert len(df) > 0
    loss = read_series(mlp.run_dir, "loss")
    assert list(loss["step"]) == list(range(mlp.steps)) and set(loss["path"]) == {""}
    act = read_series(mlp.run_dir, "act_mean")
    assert {"0", "1", "10"} <= set(act["path"])                          # modules: a Linear, a Tanh, the last
    one_step = read_series(mlp.run_dir, "grad_norm").pivot_table(index="path", columns="step", values="value")
    assert one_step.shape == (12, mlp.steps // tanh_mlp.EVERY)            # tensor x step, as a notebook pivots it


def test_an_unknown_metric_exits_2_with_one_line_naming_the_metrics(mlp):
    r = modscope("--run", str(mlp.run_dir), "--metric", "grad_nrom")
    assert r.returncode == 2 and r.stdout == ""
    [line] = r.stderr.splitlines()
    assert "'grad_nrom'" in line and all(name in line for name in METRICS)
    with pytest.raises(MetricError, match="grad_nrom"):
        read_series(mlp.run_dir, "grad_nrom")
    r = modscope("--run", str(mlp.run_dir), "--metric", "loss", "--rank", "3")
    assert r.returncode == 2 and r.stderr.strip() == "modscope: error: --rank 3: no such rank in this run; " \
                                                       "expected one of 0"
    r = modscope("--run", str(mlp.run_dir / "nothing"), "--metric", "loss")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "no such file or directory" in r.stderr
    store = next(mlp.run_dir.glob("modscope-*.sqlite"))
    r = modscope("--run", str(mlp.run_dir), "--metric", "loss", "-o", str(store))
    assert r.returncode == 2 and "expected a new file" in r.stderr and store.stat().st_size > 0
