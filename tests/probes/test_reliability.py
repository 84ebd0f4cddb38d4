"""Watching never crashes, hangs, leaks or changes the numerics of training."""
import gc
import sqlite3
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune
import zoo
from helpers import train

import probes
from probes.capture import host_values, measure


def hook_dicts(module):
    return [module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
            module._backward_pre_hooks, getattr(module, "_forward_hooks_with_kwargs", {}),
            module._state_dict_hooks, module._load_state_dict_pre_hooks]


def gpt_batch():
    g = torch.Generator().manual_seed(1)
    return lambda: (torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))


def gpt_loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def test_close_removes_every_hook_and_holds_no_reference(run_dir):
    model = zoo.XORClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = {name: set(vars(m)) for name, m in model.named_modules()}
    w = probes.watch(model, opt, run_dir=run_dir, every=1)
    X, y = zoo.xor_data(64)
    train(model, opt, w, 3, lambda: (X, y))
    w.close()
    w.close()                                           # idempotent
    from torch.nn.modules import module as m
    assert not m._global_forward_hooks and not m._global_forward_pre_hooks
    for mod in list(model.modules()) + list(model.encoder.blocks):
        assert all(len(d) == 0 for d in hook_dicts(mod))
    for p in list(model.parameters()) + [p for b in model.encoder.blocks for p in b.parameters()]:
        # None, not an emptied dict: an empty dict still makes autograd call into Python on every backward
        assert p._backward_hooks is None
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert {name: set(vars(m)) for name, m in model.named_modules()} == before   # nothing added
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    assert model_ref() is None and opt_ref() is None, "the closed watcher still references the model"


def test_a_sampled_step_leaves_no_hook_for_the_unsampled_ones(run_dir):
    model = zoo.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=3) as w:
        train(model, opt, w, 2, lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))))   # steps 0 (sampled), 1
        assert all(p._backward_hooks is None for p in model.parameters())
        assert all(len(d) == 0 for m in model.modules() if m is not model for d in hook_dicts(m))


def test_the_users_own_gradient_hooks_keep_working_around_sampled_steps(run_dir):
    """modscope gives a parameter without hooks a hook dict of its own for a sampled step. A hook the user had
    before, and one the user adds to that very dict in the middle of the step, both run on every step and
    stay after the step and after close; modscope's own hook is gone after each sampled step."""
    model = zoo.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first, second, third = list(model.parameters())[:3]
    fired: list[tuple[str, int]] = []
    step = [0]
    kept = first.register_hook(lambda g: fired.append(("before", step[0])))
    added = None
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=2) as w:
        for step[0] in range(3):                   # steps 0 and 2 sampled
            out = model(torch.randn(4, 32, generator=g))
            if step[0] == 0:                       # modscope's hooks are attached by now
                assert isinstance(second._backward_hooks, dict) and len(second._backward_hooks) == 1
                added = second.register_hook(lambda g: fired.append(("during", step[0])))
            loss = F.cross_entropy(out, torch.randint(0, 10, (4,), generator=g))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            assert list(first._backward_hooks) == [kept.id] and list(second._backward_hooks) == [added.id]
            assert third._backward_hooks is None
        assert w.probe_errors == {}
    assert sorted(fired) == sorted([("before", s) for s in range(3)] + [("during", s) for s in range(3)])
    assert list(first._backward_hooks) == [kept.id] and list(second._backward_hooks) == [added.id]
    added.remove()
    kept.remove()
    assert not second._backward_hooks and not first._backward_hooks
    con = sqlite3.connect(w.store_path)
    stored = con.execute("SELECT COUNT(*) FROM param_stats WHERE grad_norm IS NOT NULL AND step = 0").fetchone()[0]
    con.close()
    assert stored == len(list(model.parameters()))


def test_closed_watcher_ignores_further_training(run_dir):
    model = zoo.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = probes.watch(model, opt, run_dir=run_dir, every=1)
    w.close()
    train(model, opt, w, 2, lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))))
    assert w.closed and w.step_count == 0


@pytest.mark.parametrize("make,batch,loss_fn", [
    (zoo.ResNetSmall, lambda: (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))), F.cross_entropy),
    (zoo.GPT, gpt_batch(), gpt_loss),
    (zoo.XORClassifier, lambda: zoo.xor_data(128), F.cross_entropy),
])
@pytest.mark.parametrize("every", [1, None])
def test_losses_bit_identical_with_and_without_watch(make, batch, loss_fn, every, run_dir):
    torch.manual_seed(0)
    data = [batch() for _ in range(6)]

    def run(watched):
        torch.manual_seed(123)
        model = make()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        it = iter(data)
        w = probes.watch(model, opt, run_dir=run_dir / str(watched), every=every) if watched else None
        try:
            losses = train(model, opt, w, len(data), lambda: next(it), loss_fn)
        finally:
            if w:
                w.close()
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]
    bare_l, bare_p = run(False)
    watched_l, watched_p = run(True)
    assert torch.equal(bare_l, watched_l)
    assert all(torch.equal(a, b) for a, b in zip(bare_p, watched_p, strict=False))


def test_exception_inside_a_hook_is_caught_counted_and_stored(run_dir, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(measure, "call_chunk", boom)       # large outputs
    monkeypatch.setattr(measure.StepMeasurements, "add_small", boom)    # small outputs (add_kept goes through it)
    model = zoo.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        losses = train(model, opt, w, 3, lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))))
        errs = w.probe_errors
    assert len(losses) == 3
    assert errs[("forward-hook", "RuntimeError")]["count"] >= 3 * 8
    con = sqlite3.connect(w.store_path)
    row = con.execute("SELECT location, error_type, message, count FROM probe_errors").fetchone()
    assert row[:3] == ("forward-hook", "RuntimeError", "injected failure") and row[3] >= 24
    assert con.execute("SELECT probe_errors FROM ranks").fetchone()[0] >= 24


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(model="not a model"), TypeError, "got str: 'not a model'"),
    (dict(optimizer="adam"), TypeError, "optimizer"),
    (dict(optimizer=[None]), TypeError, "optimizer[0]"),
    (dict(every=0), ValueError, "every must be None or an int from 1 to 1,000,000 (sample every N-th step), got 0"),
    (dict(every=True), ValueError, "got True"),
    (dict(overhead=2.0), ValueError, "got 2.0"),
    (dict(run_dir=42), TypeError, "got int"),
    (dict(window=0), ValueError, "got 0"),
])
def test_bad_arguments_raise_at_once_naming_the_value(kwargs, exc, needle, run_dir):
    args = dict(model=zoo.MLP(), optimizer=None, run_dir=run_dir)
    args.update(kwargs)
    model = args.pop("model")
    opt = args.pop("optimizer")
    with pytest.raises(exc) as info:
        probes.watch(model, opt, **args)
    assert needle in str(info.value)


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        probes.watch(zoo.MLP(), run_dir=f)


def test_store_from_a_newer_schema_is_refused(tmp_path, monkeypatch):
    from probes.schema import store_filename
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("MODSCOPE_RUN_ID", "newer")        # a run id given explicitly meets its old store
    con = sqlite3.connect(run / store_filename("newer", 0))
    con.execute("PRAGMA user_version=99")
    con.close()
    with pytest.raises(RuntimeError, match=r"schema version 99"):
        probes.watch(zoo.MLP(), run_dir=run)
    assert not list(run.glob("*.lock"))                   # the refused writer let go of its lock


def test_corrupt_store_is_refused(tmp_path, monkeypatch):
    from probes.schema import store_filename
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("MODSCOPE_RUN_ID", "corrupt")
    (run / store_filename("corrupt", 0)).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(RuntimeError, match="not a modscope store"):
        probes.watch(zoo.MLP(), run_dir=run)


def test_odd_models_do_not_crash_the_audit_or_the_watcher(run_dir):
    lazy = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    assert probes.audit(lazy) is not None
    param = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    class Symmetric(nn.Module):
        def forward(self, X):
            return X.triu() + X.triu(1).transpose(-1, -2)
    parametrize.register_parametrization(param[0], "weight", Symmetric())
    pruned = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    prune.l1_unstructured(pruned[0], "weight", amount=0.5)
    with torch.device("meta"):
        meta = zoo.MLP()
    for name, model in {"lazy": lazy, "param": param, "pruned": pruned, "meta": meta}.items():
        errors = [f for f in probes.audit(model) if f.severity == "error"]
        assert errors == [], (name, errors)
    for name, model in {"lazy": lazy, "param": param, "pruned": pruned}.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with probes.watch(model, opt, run_dir=run_dir / name, every=1) as w:
            train(model, opt, w, 3, lambda: (torch.randn(4, 4), torch.randint(0, 2, (4,))))
            assert not w.probe_errors, (name, w.probe_errors)
            assert [f for f in w.findings() if f.severity == "error"] == [], name


def test_ten_thousand_modules(run_dir):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3400)])
    assert len(list(model.modules())) > 10_000
    assert [f for f in probes.audit(model) if f.severity == "error"] == []
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 2, lambda: (torch.randn(2, 2), torch.randn(2, 2)), F.mse_loss)
        assert not w.probe_errors
    con = sqlite3.connect(w.store_path)
    assert con.execute("SELECT COUNT(*) FROM modules").fetchone()[0] == len(list(model.modules()))


def test_outputs_of_every_shape_and_inplace_ops(run_dir):
    model = zoo.DictOutput()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(3):
            out = model(torch.randn(4, 8))
            loss = out["a"].sum() + out["pair"][0].relu_().sum()      # in-place on an output
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert not w.probe_errors
    con = sqlite3.connect(w.store_path)
    measured = {r[0] for r in con.execute(
        "SELECT m.path FROM module_stats s JOIN modules m USING(rank, module_id)")}
    assert {"", "a", "b"} <= measured and "none" not in measured and "ints" not in measured


def test_gan_with_two_optimizers(run_dir):
    G, D = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), nn.Sequential(nn.Linear(4, 1))
    gan = nn.ModuleDict({"G": G, "D": D})
    opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    with probes.watch(gan, [opt_g, opt_d], run_dir=run_dir, every=1) as w:
        for _ in range(4):
            fake = G(torch.randn(8, 4))
            d_loss = F.softplus(D(fake.detach())).mean() + F.softplus(-D(torch.randn(8, 4))).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = F.softplus(-D(fake)).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
        assert w.step_count == 4
        assert [f for f in w.findings() if f.severity == "error"] == []
        assert not w.probe_errors


def test_without_optimizer_steps_come_from_w_step(run_dir):
    model = zoo.MLP()
    with probes.watch(model, run_dir=run_dir, every=2) as w:
        for _ in range(5):
            loss = model(torch.randn(4, 32)).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
            w.step(loss)
    con = sqlite3.connect(w.store_path)
    rows = con.execute("SELECT step, sampled, loss IS NOT NULL FROM steps ORDER BY step").fetchall()
    assert rows == [(0, 1, 1), (1, 0, 1), (2, 1, 1), (3, 0, 1), (4, 1, 1)]


def test_snapshot_is_a_consistent_single_file(run_dir, tmp_path):
    model = zoo.XORClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 5, lambda: zoo.xor_data(64))
        snap = w.snapshot(tmp_path / "review" / "snap.sqlite")
    assert snap.exists() and not (tmp_path / "review" / "snap.sqlite-wal").exists()
    con = sqlite3.connect(f"file:{snap}?immutable=1", uri=True)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert con.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 5
    assert con.execute("PRAGMA user_version").fetchone()[0] == probes.SCHEMA_VERSION
    assert con.execute("SELECT COUNT(*) FROM findings WHERE active=1 AND severity='error'").fetchone()[0] >= 3
    with open(snap, "rb") as f:
        assert f.read(16) == b"SQLite format 3\x00"          # never a pickle


def test_default_budget_samples_only_some_steps(run_dir):
    model = zoo.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    with probes.watch(model, opt, run_dir=run_dir) as w:
        train(model, opt, w, 60, lambda: (x, y))
    con = sqlite3.connect(w.store_path)
    n, sampled = con.execute("SELECT COUNT(*), SUM(sampled) FROM steps").fetchone()
    assert n == 60
    assert 1 <= sampled < 60 / 2
    assert con.execute("SELECT MIN(step) FROM steps WHERE sampled=1").fetchone()[0] == 0
    assert con.execute("SELECT overhead FROM ranks").fetchone()[0] is not None


def test_full_queue_drops_samples_and_counts_them(run_dir, monkeypatch):
    from probes.store import writer as store
    model = zoo.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = probes.watch(model, opt, run_dir=run_dir, every=1)
    slow = threading_event = __import__("threading").Event()
    original = store.StoreWriter._commit

    def stalled(self, conn, batch):
        slow.wait(10)
        return original(self, conn, batch)
    monkeypatch.setattr(store.StoreWriter, "_commit", stalled)
    w._writer._queue.maxsize = 2
    train(model, opt, w, 20, lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))))
    assert w.samples_dropped > 0                      # training did not wait for the disk
    threading_event.set()
    w.close()
    con = sqlite3.connect(w.store_path)
    assert con.execute("SELECT samples_dropped FROM ranks").fetchone()[0] == w.samples_dropped


def test_failure_while_finishing_a_sample_still_ends_the_step(run_dir, monkeypatch):
    model = zoo.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=2) as w:
        from probes.capture import decode
        monkeypatch.setattr(decode, "module_columns", lambda *a: 1 / 0)
        train(model, opt, w, 4, lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))))
        assert w.step_count == 4
        assert w.probe_errors[("finish-sample", "ZeroDivisionError")]["count"] == 2
        from torch.nn.modules import module as m
        assert not m._global_forward_hooks          # unsampled step 3: no hooks left behind


def test_compiled_model(run_dir):
    model = zoo.MLP()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(compiled, opt, run_dir=run_dir, every=1) as w:
        train(compiled, opt, w, 3, lambda: (torch.randn(8, 32), torch.randint(0, 10, (8,))))
        assert not w.probe_errors
    con = sqlite3.connect(w.store_path)
    measured = {r[0] for r in con.execute(
        "SELECT DISTINCT m.path FROM module_stats s JOIN modules m USING(rank, module_id)")}
    assert "net.0" in measured and not any("_orig_mod" in p for p in measured)   # the user's paths


def _stored_stats(store):
    con = sqlite3.connect(store)
    try:
        mods = con.execute("SELECT module_id, step, calls, numel, mean, std, absmax, zero_frac, dead_frac, "
                           "nonfinite, out_grad_norm, hist FROM module_stats ORDER BY module_id, step").fetchall()
        params = con.execute("SELECT param_id, step, grad_norm, data_norm, update_norm FROM param_stats "
                             "ORDER BY param_id, step").fetchall()
        losses = con.execute("SELECT step, loss FROM steps WHERE loss IS NOT NULL ORDER BY step").fetchall()
    finally:
        con.close()
    return mods, params, losses


def test_deferred_host_copy_stores_what_the_immediate_copy_stores(tmp_path, monkeypatch):
    """On accelerators a sampled step's host copy is started non-blocking and read at a later
    step boundary (or by snapshot(), findings() or close()). Forced onto the CPU here, the
    deferred path stores exactly what the immediate one does, the last sample included."""
    def run(deferred):
        if deferred:
            monkeypatch.setattr(host_values, "DEFERRED_COPY_DEVICES", {"cpu", "cuda"})
        torch.manual_seed(0)
        model = zoo.DeadReLU(dead_units=12)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        with probes.watch(model, opt, run_dir=tmp_path / str(deferred), every=2) as w:
            train(model, opt, w, 9, lambda: (torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)))
            if deferred:
                assert w._unread is not None          # step 8 was sampled: its copy is still unread
            store = w.store_path
        assert w._unread is None                      # close() read it before closing the store
        codes = sorted((f.code, f.path) for f in w.findings())
        monkeypatch.undo()
        return _stored_stats(store), codes
    (mods, params, losses), codes = run(False)
    (dmods, dparams, dlosses), dcodes = run(True)
    assert mods and params and max(r[1] for r in mods) == 8
    assert (dmods, dparams, dlosses, dcodes) == (mods, params, losses, codes)
    assert ("dead-units", "act") in codes


def test_external_boundaries_follow_the_integration_not_the_optimizer(run_dir):
    """A framework that runs forward and backward inside optimizer.step(closure) (Lightning) and steps
    once per several micro-batches: the integration says when gradients are final and when a step ends."""
    model = zoo.XORClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = zoo.xor_data(64)
    with probes.watch(model, opt, run_dir=run_dir, every=1, boundaries="external") as w:
        for _ in range(4):
            def closure():
                opt.zero_grad()
                for _ in range(2):                              # two micro-batches
                    loss = F.cross_entropy(model(X), y) / 2
                    loss.backward()
                w.begin_optimizer_step(0)                      # gradients final: what Lightning's hook says
                return loss
            loss = opt.step(closure)
            w.end_step(loss)
        assert w.step_count == 4
        found = {(f.code, f.path) for f in w.findings()}
    assert ("not-updating", "encoder.blocks[0].weight") in found
    # two micro-batches per step accumulate on purpose: only the never-zeroed plain-list blocks accumulate
    assert {p for c, p in found if c == "grad-accumulating"} <= {f"encoder.blocks[{i}].{n}" for i in range(3)
                                                                  for n in ("weight", "bias")}
    con = sqlite3.connect(w.store_path)
    assert con.execute("SELECT COUNT(*), SUM(sampled) FROM steps").fetchone() == (4, 4)
    grads = con.execute("SELECT s.grad_norm FROM param_stats s JOIN params p USING (rank, param_id) "
                        "WHERE p.path = 'stem.weight' ORDER BY s.step").fetchall()
    assert len(grads) == 4 and all(g > 0 for (g,) in grads)      # measured after backward, not before


def test_boundaries_must_be_known(run_dir):
    with pytest.raises(ValueError, match=r"boundaries must be one of .* got 'closure'"):
        probes.watch(zoo.MLP(), run_dir=run_dir, boundaries="closure")


class Fill(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return torch.full_like(x, self.value)


class ReusedMemory(nn.Module):
    """Two modules whose outputs are fresh tensors of one shape, the first freed before the second is made:
    the second usually lands at the first one's address (and has its id and version)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Fill(1.0), Fill(2.0)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        a = self.first(x).sum()
        b = self.second(x).sum()
        return self.fc(x) + (a + b) * 0


def test_an_output_at_a_freed_outputs_address_is_measured_on_its_own(run_dir):
    model = ReusedMemory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 3, lambda: (torch.randn(16, 8), torch.randint(0, 2, (16,))))
    con = sqlite3.connect(w.store_path)
    means = dict(con.execute("SELECT m.path, AVG(s.mean) FROM module_stats s JOIN modules m USING (rank, module_id) "
                             "WHERE m.path IN ('first', 'second') GROUP BY m.path").fetchall())
    assert means == {"first": 1.0, "second": 2.0}


class LaterInPlace(nn.Module):
    """`always` has its output rectified in place by the next module on every step; `sometimes` only when
    `mutate` is set (a path the first sampled step never saw)."""

    def __init__(self):
        super().__init__()
        self.always = nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)
        self.sometimes = nn.Linear(8, 8)
        self.mutate = False

    def forward(self, x):
        h = self.sometimes(self.relu(self.always(x)))
        if self.mutate:
            h.mul_(-1.0).relu_()
        return h


def test_outputs_changed_in_place_later_are_measured_as_returned_or_not_at_all(run_dir):
    """Small outputs are referenced rather than copied where that is safe: the statistic is the output
    as the module returned it, or (a change no sampled step showed before) missing, never the changed
    values."""
    model = LaterInPlace()
    returned = {"always": [], "sometimes": []}
    for name, outs in returned.items():
        getattr(model, name).register_forward_hook(lambda m, i, o, outs=outs: outs.append(o.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(6):
            model.mutate = step in (3, 4)
            loss = model(torch.randn(16, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert not w.probe_errors
    con = sqlite3.connect(w.store_path)
    for name, outs in returned.items():
        rows = dict(con.execute("SELECT s.step, s.mean FROM module_stats s JOIN modules m USING (rank, module_id) "
                                "WHERE m.path = ?", (name,)).fetchall())
        # the in-place change of `sometimes` at step 3 was not foreseen: that step has no row; from then
        # on its outputs are copied
        expected_steps = [0, 1, 2, 4, 5] if name == "sometimes" else list(range(6))
        assert sorted(rows) == expected_steps, name
        for step in expected_steps:
            assert rows[step] == pytest.approx(outs[step].mean().item(), rel=1e-5, abs=1e-7), (name, step)
        assert all(o.min() < 0 for o in outs)        # as returned: not yet rectified


def test_a_parameter_given_data_of_another_shape_keeps_being_measured(run_dir):
    """The optimizer step's norms reuse a plan of the parameters' shapes, made once per model index; assigning
    ``p.data`` a tensor of another shape keeps the parameter (the index is not rebuilt), so the plan must be
    made again rather than stack mismatched shapes and lose the statistics of every later step."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))    # enough small tensors to stack
            self.scale = nn.Parameter(torch.ones(16))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x * self.scale[:16]

    torch.manual_seed(0)
    model = Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = lambda: (torch.randn(8, 16), torch.randint(0, 16, (8,)))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 2, batch)
        model.scale.data = torch.ones(32)
        train(model, opt, w, 2, batch)
        assert not w.probe_errors
    con = sqlite3.connect(w.store_path)
    norms = dict(con.execute("SELECT s.step, s.data_norm FROM param_stats s JOIN params p USING(rank, param_id) "
                             "WHERE p.path = 'scale' ORDER BY s.step"))
    con.close()
    assert set(norms) == {0, 1, 2, 3}
    assert norms[3] == pytest.approx(model.scale.detach().norm().item(), rel=1e-4)
