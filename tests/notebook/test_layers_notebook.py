"""examples/layers.ipynb runs in a real kernel: it trains, reads the run with the pandas function and pivots it to
a layer x step table (one row per Linear layer, in the model's order), and plots it."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]


def test_layers_notebook_pivots_layers_against_steps(tmp_path, monkeypatch):
    nb_path = tmp_path / "layers.ipynb"
    shutil.copy(REPO / "examples" / "layers.ipynb", nb_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))          # the kernel imports probes and dashboard from the checkout
    nb = nbformat.read(nb_path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = {i: c.get("outputs", []) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    errors = [o for outs in outputs.values() for o in outs if o.get("output_type") == "error"]
    assert not errors, errors
    pivot = next(o for o in outputs[4] if o.get("output_type") == "execute_result")["data"]["text/plain"]
    first_block = pivot.split("\n\n")[0]              # a wide pivot (a column per step) prints in blocks of columns
    rows = [line.split()[0] for line in first_block.splitlines()[2:] if line.strip() and not line.startswith("[")]
    assert rows == ["0", "2", "4", "6", "8", "10"]                                      # the Linear layers, in order
    shown = [o for o in outputs[5] if o.get("output_type") in ("execute_result", "display_data")]
    assert shown and any(k.startswith(("application/vnd.plotly", "text/html")) for o in shown for k in o["data"]), \
        [list(o.get("data", {})) for o in outputs[5]]
    assert (tmp_path / "runs" / "layers-example").is_dir()
