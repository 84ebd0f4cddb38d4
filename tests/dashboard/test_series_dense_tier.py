"""The series read the dense tier too: a tensor's gradient and weight norms are the union of the full samples
(``param_stats``) and the dense tier (``param_series``), a full sample's own values winning where a step is in
both; the steps with dense series are counted apart from the full samples. The run is real: the MLP watched with a
full sample every 4th step, the dense tier on the steps between, as the watcher writes them."""

from __future__ import annotations

import math
import shutil
import sqlite3

import pytest
import tanh_mlp

from dashboard.read import layer_data as ld
from dashboard.read.series import METRICS, open_run, read_series


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return tanh_mlp.shared_run(tmp_path_factory, dense=True)


def test_dense_series_join_the_full_samples(mlp):
    df = read_series(mlp.run_dir, "grad_norm")
    got = {(r.step, r.path): r.value for r in df.itertuples()}
    assert {step for step, _ in got} == set(range(mlp.steps))              # every step: full or dense
    for key, value in got.items():
        assert value == pytest.approx(mlp.grad_norms[key], rel=1e-5), key   # the loop's own norms
    assert set(read_series(mlp.run_dir, "update_ratio").step) == set(range(0, mlp.steps, 4))   # full samples only
    store_ = open_run(mlp.run_dir).at(0)
    counts = store_.step_counts(0)
    assert (counts.full, counts.dense) == (50, 150)
    assert counts.text() == "50 full samples · 200 steps with dense series"
    spec = METRICS["grad_norm"]
    tree = ld.load_tree(store_, 0)
    rows = ld.layer_rows(tree, spec, ld.default_opened(tree, spec, set()), set())
    heat = ld.layer_heat(store_, 0, rows, spec)
    assert heat.steps == list(range(mlp.steps))
    layer0 = math.hypot(mlp.grad_norms[(1, "0.weight")], mlp.grad_norms[(1, "0.bias")])
    assert heat.values[0][1] == pytest.approx(layer0, rel=1e-5)            # layer 0 at a dense step: both tensors


def test_a_full_samples_own_values_win_over_the_dense_tiers(mlp, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(mlp.run_dir, run_dir)
    (store,) = run_dir.glob("modscope-*.sqlite")
    con = sqlite3.connect(store)
    (pid,) = con.execute("SELECT param_id FROM params WHERE path = '0.weight'").fetchone()
    con.execute("INSERT INTO param_series (rank, param_id, step, grad_norm, data_norm) VALUES (0, ?, 0, -1, -1)",
                (pid,))                                               # a full sample's step: param_stats wins
    con.commit()
    con.close()
    got = {(r.step, r.path): r.value for r in read_series(run_dir, "grad_norm").itertuples() if r.step == 0}
    assert got[(0, "0.weight")] == pytest.approx(mlp.grad_norms[(0, "0.weight")], rel=1e-5)
