"""On an accelerator every host read of a device value is a sync that stalls the training loop: a sampled step
must read nothing before its one host copy (issue 14, point 4), and that copy is read at a later step boundary.

The accelerator's path runs here on CPU tensors: the tests empty ``tensors.FREE_READ_DEVICES`` (the device types
whose reads cost no sync) and put the CPU into ``host_values.DEFERRED_COPY_DEVICES``, so every decision the probes take
for a CUDA tensor is taken for these. A torch function mode counts the host reads the probes make (``item``,
``tolist``, ``float()``, ``nonzero``...) outside the reading of a copy; on a GPU, ``python -m bench.overhead
--device cuda --sync-count`` counts the real syncs.
"""
from __future__ import annotations

import collections
import os
import sqlite3
import sys

import pytest
import torch
import torch.nn.functional as F
import zoo
from helpers import codes
from torch.overrides import TorchFunctionMode

import probes
from bench import stored_stats
from probes import watcher
from probes.capture import dense, host_values
from probes.model import tensors

PROBES_DIR = os.path.dirname(probes.__file__) + os.sep
# what reads a tensor's values on the host (on a GPU: waits for the device)
HOST_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
    torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__array__,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique,
    torch.unique, torch.Tensor.equal, torch.equal, torch.allclose, torch.Tensor.__repr__, torch.Tensor.__format__,
})


class HostReads(TorchFunctionMode):
    """Counts, by (function, the probes' function that called it), the host reads made from ``probes/`` while
    no sample is being read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[tuple[str, str]] = collections.Counter()
        self.reading = 0               # inside Watcher._read_sample: the copy is read there, on the host
        self.samples: list[tuple[int, int]] = []     # (a sample's step, the step in progress when it was read)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and not self.reading:
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.startswith(PROBES_DIR):
                    self.reads[(func.__name__, f"{os.path.basename(frame.f_code.co_filename)}:"
                                               f"{frame.f_code.co_name}")] += 1
                    break
                frame = frame.f_back
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    """A HostReads counter, and the samples read: (the sample's step, the step in progress when it was read). The
    dense tier's reading of a copy of its own (started at a step boundary, read once it has landed) is a copy's
    reading too."""
    counter = HostReads()
    read_sample = watcher.Watcher._read_sample
    read_dense = dense.DenseSeries._read

    def reading(self, step, *args):
        counter.samples.append((step, self._probe.step))
        counter.reading += 1
        try:
            return read_sample(self, step, *args)
        finally:
            counter.reading -= 1

    def reading_dense(self, *args):
        counter.reading += 1
        try:
            return read_dense(self, *args)
        finally:
            counter.reading -= 1
    monkeypatch.setattr(watcher.Watcher, "_read_sample", reading)
    monkeypatch.setattr(dense.DenseSeries, "_read", reading_dense)
    return counter


@pytest.fixture
def accelerator_path(monkeypatch):
    monkeypatch.setattr(tensors, "FREE_READ_DEVICES", frozenset())
    monkeypatch.setattr(host_values, "DEFERRED_COPY_DEVICES", {"cpu", "cuda"})


def _train(name, factory, batch, watch, steps, host_reads, accumulate=False):
    """Trains ``steps`` steps (every second one without zero_grad with ``accumulate``), counting host reads."""
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with watch(model, opt) as w:
        with host_reads:
            for step in range(steps):
                x, y = batch(g)
                out = model(x)
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
                if not accumulate or step % 2 == 0:
                    opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)
        assert not w.probe_errors, (name, w.probe_errors)
    return w


CASES = {name: (factory, batch) for name, factory, batch in stored_stats.cases()}
CASES["plain-list"] = (zoo.XORClassifier, stored_stats._vectors(2, 2))   # tensors no optimizer holds


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_sampled_step_reads_nothing_before_its_copy(tmp_path, accelerator_path, host_reads, name):
    """Every step sampled, gradients accumulated every other step: the hooks, the optimizer hooks and the end of
    each step read nothing on the host; each sample is read once, at a later step boundary (or at close)."""
    factory, batch = CASES[name]
    w = _train(name, factory, batch, lambda m, o: probes.watch(m, o, run_dir=tmp_path, every=1), 6, host_reads,
               accumulate=True)
    assert dict(host_reads.reads) == {}
    assert [s for s, _ in host_reads.samples] == list(range(6))
    assert all(read_at > step for step, read_at in host_reads.samples)     # deferred: never in its own step
    con = sqlite3.connect(w.store_path)                  # and what was read is stored
    try:
        assert {r for r, in con.execute("SELECT DISTINCT step FROM module_stats")} == set(range(6))
    finally:
        con.close()


def test_unsampled_steps_read_nothing_either(tmp_path, accelerator_path, host_reads):
    factory, batch = CASES["cnn"]
    _train("cnn", factory, batch, lambda m, o: probes.watch(m, o, run_dir=tmp_path, every=3), 9, host_reads)
    assert dict(host_reads.reads) == {}
    assert [s for s, _ in host_reads.samples] == [0, 3, 6]                # one step in three


def test_the_count_sees_the_reads_the_cpu_path_makes(tmp_path, host_reads):
    """The counter is not blind: on the CPU's own path the hooks read a scalar per large output (a finite E[x^2]
    means no NaN/Inf to count) and the update check reads which sampled changes were zero."""
    factory, batch = CASES["cnn"]
    _train("cnn", factory, batch, lambda m, o: probes.watch(m, o, run_dir=tmp_path, every=1), 3, host_reads)
    assert host_reads.reads[("item", "measure.py:call_chunk")] > 0
    assert host_reads.reads[("nonzero", "optimizer_step.py:measure_updates")] == 3


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_a_learning_rate_held_as_a_tensor_is_read_with_the_copy(tmp_path, request, host_reads, path):
    """Fused optimizers take the learning rate as a tensor, on the device: it is fetched with the step's values
    (no read in the optimizer hook, nor when the model is indexed) and stored with each sampled step, and a group
    whose lr is 0 is still named as the reason it does not update."""
    if path == "accelerator":
        request.getfixturevalue("accelerator_path")
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=1)
    opt = torch.optim.Adam([{"params": model.net[0].parameters(), "lr": torch.tensor(1e-2)},
                            {"params": model.net[2].parameters(), "lr": torch.tensor(0.0)}])
    g = torch.Generator().manual_seed(0)
    with host_reads, probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(4):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        found = [f for f in w.findings() if f.code == "not-updating"]
    assert codes(found) == {("not-updating", "net.2.weight"), ("not-updating", "net.2.bias")}
    assert all(f.evidence["lr"] == 0.0 and f.evidence["param_group"] == 1 for f in found)
    con = sqlite3.connect(w.store_path)
    try:
        stored = {(path, round(lr, 6)) for path, lr in
                  con.execute("SELECT p.path, s.lr FROM param_stats s JOIN params p USING (rank, param_id)")}
    finally:
        con.close()
    assert stored == {("net.0.weight", 0.01), ("net.0.bias", 0.01), ("net.2.weight", 0.0), ("net.2.bias", 0.0)}
    if path == "accelerator":
        assert dict(host_reads.reads) == {}
