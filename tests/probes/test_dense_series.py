"""The dense tier in real training loops, read back from the real store: every tensor's gradient and weight norm on
the steps between full samples (``param_series``), a full sample's own in ``param_stats``; the union is each
tensor's series."""
import functools
import math
import sqlite3

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes
from bench.models import TanhMLP
from probes.integrations import WatchOptions
from probes.store import session as session_mod


def series(store, column="grad_norm"):
    """{(path, step): value} of the dense tier and the full samples together, and the steps of each."""
    con = sqlite3.connect(store)
    try:
        paths = dict(con.execute("SELECT param_id, path FROM params"))
        dense = con.execute(f"SELECT param_id, step, {column} FROM param_series").fetchall()
        full = con.execute(f"SELECT param_id, step, {column} FROM param_stats").fetchall()
    finally:
        con.close()
    values = {(paths[p], s): v for p, s, v in dense + full}
    return values, {s for _, s, _ in dense}, {s for _, s, _ in full}


def reference_loop(model, opt, w, steps, batch, scaler=None):
    """Trains ``steps`` steps and returns, per step, each parameter's gradient norm and weight norm as the loop sees
    them right before ``optimizer.step()`` (after the scaler unscaled them)."""
    grads, weights = {}, {}
    for step in range(steps):
        x, y = batch()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        grads[step] = {n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None}
        weights[step] = {n: float(p.detach().norm()) for n, p in model.named_parameters()}
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if w is not None:
            w.step(loss)
    return grads, weights


def batches(din=32, dout=10, n=16):
    g = torch.Generator().manual_seed(0)
    return lambda: (torch.randn(n, din, generator=g), torch.randint(0, dout, (n,), generator=g))


def assert_matches(stored, reference):
    assert stored
    for (path, step), value in stored.items():
        assert value == pytest.approx(reference[step][path], rel=1e-5), (path, step)


@pytest.mark.parametrize("every", [None, 4])
def test_stored_norms_are_the_loops_own_at_every_step_they_cover(run_dir, every):
    """The dense tier's norms (param_series) and a full sample's (param_stats) are the norms of the gradients and
    weights the optimizer steps on, as the training loop computes them before optimizer.step()."""
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        grads, weights = reference_loop(model, opt, w, 40, batches())
    stored_grads, dense_steps, full_steps = series(w.store_path)
    assert_matches(stored_grads, grads)
    assert_matches(series(w.store_path, "data_norm")[0], weights)
    assert dense_steps and not dense_steps & full_steps      # a full sample keeps its values in param_stats
    if every:                       # with every=N the dense tier takes every step between full samples
        assert dense_steps | full_steps == set(range(40))
        assert full_steps == set(range(0, 40, 4))


def test_a_grad_scalers_gradients_are_stored_unscaled(run_dir):
    """Under a GradScaler the optimizer steps on the unscaled gradients: those are the dense tier's norms."""
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    with probes.watch(model, opt, run_dir=run_dir, every=5) as w:
        grads, _ = reference_loop(model, opt, w, 12, batches(), scaler=scaler)
    stored, dense_steps, _ = series(w.store_path)
    assert dense_steps
    assert_matches(stored, grads)


def test_without_an_optimizer_and_with_external_boundaries(run_dir):
    """w.step() ends the steps of a watcher without optimizer (the norms are taken then); an integration says
    where the gradients are final (begin_optimizer_step) and where the step ends."""
    model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10))
    batch = batches()
    expected = {}
    with probes.watch(model, run_dir=run_dir / "plain", every=3) as plain:
        for step in range(9):
            x, y = batch()
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            expected[step] = {n: float(p.grad.norm()) for n, p in model.named_parameters()}
            plain.step()
    stored, dense_steps, _ = series(plain.store_path)
    assert dense_steps == {1, 2, 4, 5, 7, 8}
    assert_matches(stored, expected)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with probes.watch(model, opt, run_dir=run_dir / "external", every=3, boundaries="external") as ext:
        for step in range(9):
            x, y = batch()
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            expected[step] = {n: float(p.grad.norm()) for n, p in model.named_parameters()}
            ext.begin_optimizer_step(0)
            opt.step()
            ext.end_step(loss)
    stored, dense_steps, _ = series(ext.store_path)
    assert dense_steps == {1, 2, 4, 5, 7, 8}
    assert_matches(stored, expected)


def test_a_tensor_without_gradient_is_stored_as_null(run_dir):
    """A parameter the step's backward never reached has no gradient norm that step (NULL), but its weight norm."""
    model = nn.ModuleDict({"used": nn.Linear(8, 4), "idle": nn.Linear(8, 4)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=10) as w:
        for _ in range(4):
            opt.zero_grad()
            model["used"](torch.randn(4, 8)).sum().backward()
            opt.step()
    grads, dense_steps, _ = series(w.store_path)
    data, _, _ = series(w.store_path, "data_norm")
    assert dense_steps == {1, 2, 3}
    assert all(grads[("idle.weight", s)] is None and data[("idle.weight", s)] > 0 for s in dense_steps)
    assert all(grads[("used.weight", s)] > 0 for s in dense_steps)


def test_the_mlp_run_has_dense_steps_between_its_announced_full_samples_under_the_default_budget(run_dir):
    """A 200-step run of a 6-layer tanh MLP (width 256, batch 128, SGD) under the default 1% budget: the dense tier
    takes steps the full samples do not, with every parameter each time, the loss is stored every step, and the full
    samples follow the schedule that next_sample announced. How many steps the tier covers depends on measured
    costs: the split for given costs is held by test_budget_split.py, the figure on this model by bench.dense_tier."""
    torch.manual_seed(0)
    model = TanhMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    announced = []
    with probes.watch(model, opt, run_dir=run_dir) as w:
        for _ in range(200):
            x, y = torch.randn(128, 256, generator=g), torch.randint(0, 10, (128,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            announced.append(w._policy.next_sample(w.step_count))
    stored, dense_steps, full_steps = series(w.store_path)
    assert dense_steps and not dense_steps & full_steps, (sorted(dense_steps), sorted(full_steps))
    assert {0, 1, 2} <= full_steps
    assert all(announced[s - 1] == s for s in full_steps if s)        # each full sample was the one announced
    con = sqlite3.connect(w.store_path)
    try:
        assert con.execute("SELECT COUNT(loss) FROM steps").fetchone()[0] == 200
        per_step = {n for n, in con.execute("SELECT COUNT(*) FROM param_series GROUP BY step")}
    finally:
        con.close()
    assert per_step == {12}                                 # every parameter at every dense step
    assert all(v is not None and math.isfinite(v) for v in stored.values())


def test_dense_false_turns_the_tier_off_and_bad_values_are_refused(run_dir):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=4, dense=False) as w:
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    _, dense_steps, full_steps = series(w.store_path)
    assert not dense_steps and full_steps == {0, 4, 8}
    for bad in (0, -2, 1.5, "off", None):
        with pytest.raises(ValueError, match=r"^dense must be True .*, got " + repr(bad).replace(".", r"\.")):
            probes.watch(model, opt, run_dir=run_dir, dense=bad)
    with pytest.raises(ValueError, match="dense must be"):
        WatchOptions(dense="off")


def test_dense_n_takes_every_nth_step(run_dir):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=10, dense=3) as w:
        for _ in range(20):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    _, dense_steps, full_steps = series(w.store_path)
    assert full_steps == {0, 10} and dense_steps == {3, 6, 9, 12, 15, 18}


def test_next_sample_is_written_while_training_and_cleared_at_close(run_dir):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = probes.watch(model, opt, run_dir=run_dir, every=5)
    try:
        for _ in range(7):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        w._writer.flush()
        con = sqlite3.connect(w.store_path)
        assert con.execute("SELECT next_sample FROM ranks").fetchone() == (10,)
        con.close()
    finally:
        w.close()
    con = sqlite3.connect(w.store_path)
    assert con.execute("SELECT next_sample, status FROM ranks").fetchone() == (None, "closed")
    con.close()


def test_long_runs_thin_the_dense_series(run_dir, monkeypatch):
    """param_series is thinned as the other per-step rows are: the recent dense steps whole, older ones to the first
    of each of about THIN_OLD buckets."""
    monkeypatch.setattr(session_mod, "THIN_RECENT", 20)
    monkeypatch.setattr(session_mod, "THIN_OLD", 10)
    monkeypatch.setattr(session_mod, "THIN_EVERY", 10)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.watch(model, opt, run_dir=run_dir, every=1000, dense=1) as w:
        for _ in range(400):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
    con = sqlite3.connect(w.store_path)
    steps = [s for s, in con.execute("SELECT DISTINCT step FROM param_series ORDER BY step")]
    per_step = {n for n, in con.execute("SELECT COUNT(*) FROM param_series GROUP BY step")}
    con.close()
    assert len(steps) <= 20 + 10 + 10 + 2                  # recent window + thinned history (+ one pass of slack)
    assert steps[-20:] == list(range(380, 400))           # the recent window is whole
    assert steps[0] == 1                                   # the oldest history stays represented
    assert per_step == {2}                                 # a kept step keeps every tensor


@pytest.mark.parametrize("make_optimizer", [lambda params: torch.optim.SGD(params, lr=0.05),
                                            lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=3)],
                         ids=["sgd", "lbfgs"])
def test_a_closure_optimizers_norms_are_those_of_its_first_evaluation(run_dir, make_optimizer):
    """``optimizer.step(closure)``: the gradients are final after the closure's first evaluation, inside step(), not
    at its pre-hook (the previous step's gradients then): the dense tier's norms are the first evaluation's."""
    model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10))
    opt = make_optimizer(model.parameters())
    batch = batches()
    grads, weights = {}, {}

    def closure(step, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step not in grads:                     # LBFGS evaluates it again in its line search
            grads[step] = {n: float(p.grad.norm()) for n, p in model.named_parameters()}
            weights[step] = {n: float(p.detach().norm()) for n, p in model.named_parameters()}
        return loss

    with probes.watch(model, opt, run_dir=run_dir, every=4) as w:
        for step in range(12):
            x, y = batch()
            w.step(opt.step(functools.partial(closure, step, x, y)))
    stored, dense_steps, _ = series(w.store_path)
    assert dense_steps == set(range(12)) - {0, 4, 8}
    assert_matches(stored, grads)
    assert_matches(series(w.store_path, "data_norm")[0], weights)


@pytest.fixture
def accelerator_reads(monkeypatch):
    """The accelerator's path on CPU tensors (see test_host_reads.py), with a counter of the probes' host reads made
    outside the reading of a host copy (a full sample's, or one the dense tier started for its own values)."""
    from test_host_reads import HostReads

    from probes import watcher
    from probes.capture import dense, host_values
    from probes.model import tensors
    monkeypatch.setattr(tensors, "FREE_READ_DEVICES", frozenset())
    monkeypatch.setattr(host_values, "DEFERRED_COPY_DEVICES", {"cpu", "cuda"})
    counter = HostReads()
    copies = []                                   # (the step its copy started at, the step it is read at)

    def reading(original, record=None):
        def read(self, *args):
            if record is not None:
                record(self, args)
            counter.reading += 1
            try:
                return original(self, *args)
            finally:
                counter.reading -= 1
        return read
    monkeypatch.setattr(watcher.Watcher, "_read_sample", reading(watcher.Watcher._read_sample))
    monkeypatch.setattr(dense.DenseSeries, "_read", reading(
        dense.DenseSeries._read, lambda self, args: copies.append(args[0].started)))
    monkeypatch.setattr(dense, "DENSE_FLUSH", 3)           # copies of its own too, not only full samples'
    counter.copies = copies
    return counter


def test_a_dense_step_reads_nothing_on_the_host(run_dir, accelerator_reads):
    """On an accelerator the dense tier's norms stay on the device: no host read at a dense step; they are read with
    a full sample's host copy or a copy of their own, and all are stored."""
    model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with probes.watch(model, opt, run_dir=run_dir, every=8) as w:
        with accelerator_reads:
            grads, _ = reference_loop(model, opt, w, 20, batches())
    assert dict(accelerator_reads.reads) == {}
    assert accelerator_reads.copies                          # the dense tier's own copies were read too
    stored, dense_steps, full_steps = series(w.store_path)
    assert dense_steps == set(range(20)) - {0, 8, 16} and full_steps == {0, 8, 16}
    assert_matches(stored, grads)
