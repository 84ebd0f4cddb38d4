"""bench.stored_stats: what a change of the probes stores, against a git revision's probes (a smoke run of the
command, and the comparison on rows that differ)."""
import subprocess
import sys
from pathlib import Path

from bench.stored_stats import TABLES, first_difference

ROOT = Path(__file__).resolve().parents[2]


def test_the_tree_stores_what_its_own_revision_stores():
    """On a clean checkout the tree is HEAD: two runs in two processes store the same rows, to the bit."""
    proc = subprocess.run([sys.executable, "-m", "bench.stored_stats", "--against", "HEAD"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.startswith("identical to HEAD: 9 models, ") and "module_stats rows" in proc.stdout


def test_the_first_difference_names_the_model_the_table_and_the_rows():
    rows = {table: [[1, 0, 0.5], [2, 0, 0.25]] for table in TABLES}
    assert first_difference({"mlp": rows}, {"mlp": rows}) is None
    changed = {**rows, "param_stats": [[1, 0, 0.5], [2, 0, 0.125]]}
    assert first_difference({"mlp": rows}, {"mlp": changed}) == (
        "mlp.param_stats: 2 rows against 2; row 1: [2, 0, 0.25] against [2, 0, 0.125]")
    shorter = {**rows, "findings": [[1, 0, 0.5]]}
    assert first_difference({"mlp": rows}, {"mlp": shorter}) == (
        "mlp.findings: 2 rows against 1; row 1: [2, 0, 0.25] against None")
    assert first_difference({"mlp": rows}, {}) == "mlp: stored by one side only"
    # a planned change of one table (--skip findings) leaves the others compared
    assert first_difference({"mlp": rows}, {"mlp": shorter}, [t for t in TABLES if t != "findings"]) is None
    assert first_difference({"mlp": rows}, {"mlp": changed}, [t for t in TABLES if t != "findings"]) is not None
