"""A watcher in a real Jupyter kernel (ipykernel, driven by nbclient), modscope from the checkout: a cell
that fails inside a sampled step (an exception in the loss, Ctrl-C / "interrupt kernel") leaves Python's
garbage collector running for the next cells, training continues in a new cell, and close() leaves no
hook, thread or file behind."""

from __future__ import annotations

import os
from pathlib import Path

from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]

SETUP = '''
import gc, os, threading
import torch, torch.nn as nn, torch.nn.functional as F
from torch.nn.modules import module as M
import probes
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X, y = torch.randn(32, 8), torch.randint(0, 2, (32,))

def state():
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    return (gc.isenabled(), hooks, len(M._global_forward_hooks) + len(M._global_forward_pre_hooks),
            sorted(t.name for t in threading.enumerate() if t.name.startswith("modscope")),
            len(os.listdir("/proc/self/fd")))

before = state()
print("before", before)
'''
TRAIN = '''
w = probes.watch(model, opt, run_dir="nb-run", every=1)
for _ in range(3):
    loss = F.cross_entropy(model(X), y)
    opt.zero_grad(); loss.backward(); opt.step(); w.step(loss)
'''
FAIL = '''
out = model(X)                                  # the forward of a sampled step ran
raise ValueError("a bug in my new loss")
'''
AFTER = 'print("gc after the failed cell", gc.isenabled())'
CONTINUE = '''
for _ in range(3):
    loss = F.cross_entropy(model(X), y)
    opt.zero_grad(); loss.backward(); opt.step(); w.step(loss)
print("steps", w.step_count, "probe errors", w.probe_errors)
'''
CLOSE = '''
w.close()
print("closed", state() == before, state())
'''


def test_a_failed_cell_inside_a_sampled_step_leaves_the_gc_running(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    nb = new_notebook(cells=[new_code_cell(c) for c in (SETUP, TRAIN, FAIL, AFTER, CONTINUE, CLOSE)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
    text = ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream") for c in nb.cells]
    errors = [[o.ename for o in c.outputs if o.output_type == "error"] for c in nb.cells]
    assert errors == [[], [], ["ValueError"], [], [], []], text
    assert "gc after the failed cell True" in text[3]       # it stayed paused until the next optimizer step
    assert "steps 6 probe errors {}" in text[4]
    assert "closed True" in text[5], text[5]


MODEL = '''
import threading
import torch, torch.nn as nn, torch.nn.functional as F
import probes
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
'''
WATCH = '''
w = probes.watch(model, opt, run_dir="nb-run")
for _ in range(3):
    loss = F.cross_entropy(model(X), y)
    opt.zero_grad(); loss.backward(); opt.step(); w.step(loss)
print("writers", sum(t.name == "modscope-store-writer" for t in threading.enumerate()))
'''
LOOP = '''
ws = [probes.watch(nn.Linear(2, 2), run_dir="nb-run") for _ in range(2)]     # one run of a cell, two watchers
print("open", [not x.closed for x in ws])
'''


def test_running_the_model_cell_and_the_training_cell_again_closes_the_first_watcher(tmp_path, monkeypatch):
    """"Run All" again: a new model, watched by the same cell's code: the watcher that cell opened before is
    closed, with a warning that names its run (it stayed open, its writer thread and its store "running",
    until the kernel exited). Two watchers one run of a cell opens both stay open."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    nb = new_notebook(cells=[new_code_cell(c) for c in (MODEL, WATCH, MODEL, WATCH, LOOP, "w.close()")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
    out = ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream" and o.name == "stdout")
           for c in nb.cells]
    err = ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream" and o.name == "stderr")
           for c in nb.cells]
    assert out[1].strip() == "writers 1" and err[1] == ""
    assert out[3].strip() == "writers 1", (out, err)
    assert "UserWarning: modscope: this cell ran probes.watch() again: the watcher it opened before (run '" in err[3]
    assert 'w = probes.watch(model, opt, run_dir="nb-run")' in err[3]       # the warning points at the cell's line
    assert out[4].strip() == "open [True, True]" and err[4] == ""
