"""The series read the dense tier too: a tensor's gradient and weight norms are the union of the full samples
(``param_stats``) and the dense tier (``param_series``), a full sample's own values winning where a step is in
both; the steps with dense series are counted apart from the full samples. (Rows added to a real run's store,
as the dense tier's writer adds them, until the writer writes them itself.)"""

from __future__ import annotations

import shutil
import sqlite3

import pytest
import tanh_mlp

from dashboard.read import layer_data as ld
from dashboard.read.series import METRICS, open_run, read_series


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return tanh_mlp.shared_run(tmp_path_factory)


def test_dense_series_join_the_full_samples(mlp, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(mlp.run_dir, run_dir)
    (store,) = run_dir.glob("modscope-*.sqlite")
    con = sqlite3.connect(store)
    ids = dict(con.execute("SELECT path, param_id FROM params"))
    dense = {(s, p): float(1000 + s) for s in (1, 2, 3) for p in ("0.weight", "0.bias")}
    con.executemany("INSERT INTO param_series (rank, param_id, step, grad_norm, data_norm) VALUES (0, ?, ?, ?, 1.0)",
                    [(ids[p], s, v) for (s, p), v in dense.items()])
    con.execute("INSERT INTO param_series (rank, param_id, step, grad_norm, data_norm) VALUES (0, ?, 0, -1, -1)",
                (ids["0.weight"],))                                   # a full sample's step: param_stats wins
    con.commit()
    con.close()
    df = read_series(run_dir, "grad_norm")
    got = {(r.step, r.path): r.value for r in df.itertuples() if r.step < 4}
    assert {k: v for k, v in got.items() if k[0] in (1, 2, 3)} == dense
    assert got[(0, "0.weight")] == pytest.approx(mlp.grad_norms[(0, "0.weight")], rel=1e-5)
    assert len(read_series(run_dir, "update_ratio").query("step in (1, 2, 3)")) == 0     # full samples only
    store_ = open_run(run_dir).at(0)
    counts = store_.step_counts(0)
    assert (counts.full, counts.dense) == (50, 3)
    assert counts.text() == "50 full samples · 53 steps with dense series"
    spec = METRICS["grad_norm"]
    tree = ld.load_tree(store_, 0)
    rows = ld.layer_rows(tree, spec, ld.default_opened(tree, spec, set()), set())
    heat = ld.layer_heat(store_, 0, rows, spec)
    assert heat.steps[:5] == [0, 1, 2, 3, 4] and len(heat.steps) == 53
    assert heat.values[0][1] == pytest.approx(1001 * 2 ** 0.5)              # layer 0: weight and bias together
    assert heat.values[1][1] is None                                       # no dense value for layer 2 there
