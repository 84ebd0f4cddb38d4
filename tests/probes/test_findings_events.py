"""Findings that last and stay right: events, always-on sentinels, causes, fewer false alarms.

The event findings are checked with every step sampled and with every=5, the event falling on an
unsampled step."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo
from helpers import stored, train

import probes


def batches(n=32, din=8, classes=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, din, generator=g), torch.randint(0, classes, (n,), generator=g)
    return lambda: (x, y)


def by_code(w, code):
    return [f for f in w.findings() if f.code == code]


# ------------------------------------------------------------------------- 1. events last until the fix
@pytest.mark.parametrize("every", [1, 5])
def test_validation_in_train_mode_stays_until_validation_is_done_right(run_dir, every):
    model = zoo.BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        train(model, opt, w, 3, batches())             # steps 0-2
        with torch.no_grad():
            model(torch.randn(16, 8))                  # validation in train mode, in step 3 (unsampled at every=5)
        train(model, opt, w, 8, batches())             # the rest of the epoch: steps 3-10
        (f,) = by_code(w, "train-mode-under-no-grad")
        assert (f.first_step, f.count) == (3, 1) and "bn" in f.evidence["modules"]
        with torch.no_grad():
            model(torch.randn(16, 8))                  # the same mistake again, in step 11
        train(model, opt, w, 2, batches())
        (f,) = by_code(w, "train-mode-under-no-grad")
        assert (f.first_step, f.step, f.count) == (3, 11, 2)
        model.eval()                                   # the fix: eval() + no_grad(), then train()
        with torch.no_grad():
            model(torch.randn(16, 8))
        model.train()
        train(model, opt, w, 2, batches())
        assert not by_code(w, "train-mode-under-no-grad")
    assert stored(w, "SELECT active, first_step, count FROM findings WHERE code='train-mode-under-no-grad'") == [
        (0, 3, 2)]


def test_validation_after_the_last_optimizer_step_is_evaluated(run_dir):
    model = zoo.BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=5) as w:
        train(model, opt, w, 4, batches())
        with torch.no_grad():
            model(torch.randn(16, 8))                  # after the last step: no step boundary will follow
        assert [f.step for f in by_code(w, "train-mode-under-no-grad")] == [4]     # findings() sees it
    assert stored(w, "SELECT active, first_step FROM findings WHERE code='train-mode-under-no-grad'") == [(1, 4)]


class DivideByZeroAt(nn.Module):
    """A custom layer that divides by zero from a given call on."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        return x / (0.0 if self.calls > self.at else 1.0)


class NaNNet(nn.Module):
    def __init__(self, at: int):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.risky = DivideByZeroAt(at)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.risky(self.fc1(x))))


def test_non_finite_origin_stays_where_it_began(run_dir):
    model = NaNNet(at=3)                               # the first NaN/Inf appears in step 3, in `risky`
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 8, batches())             # from step 4 on, NaN weights poison fc1 first
        (f,) = by_code(w, "non-finite")
    assert (f.path, f.first_step, f.step) == ("risky", 3, 7)
    assert f.evidence["kind"] == "activation" and f.count == 5
    assert "fc1" in f.evidence["later"]                # later steps are evidence, not a new origin


def test_non_finite_first_seen_on_an_unsampled_step_is_not_blamed_on_a_poisoned_layer(run_dir):
    model = NaNNet(at=3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=5) as w:
        train(model, opt, w, 8, batches())             # step 3 is not sampled; step 5 is, with fc1 poisoned
        (f,) = by_code(w, "non-finite")
    assert (f.path, f.first_step, f.evidence["kind"]) == ("", 3, "loss")
    assert "fc1" in f.evidence["later"]


# ------------------------------------------------------------------------- 3. checkpointing is not validation
class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.BatchNorm1d(16))
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.head(checkpoint(self.block, x, use_reentrant=True))


@pytest.mark.parametrize("every", [1, 5])
def test_activation_checkpointing_is_not_validation(run_dir, every):
    model = Checkpointed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8, requires_grad=True)         # reentrant checkpointing needs an input that requires grad
    y = torch.randint(0, 2, (16,))
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        train(model, opt, w, 6, lambda: (x, y))
        assert w.findings() == [], [str(f) for f in w.findings()]


# ------------------------------------------------------------------------- 4. a learning rate of 0
def test_a_param_group_with_lr_zero_is_not_updating(run_dir):
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=1)
    opt = torch.optim.Adam([{"params": model.net[0].parameters(), "lr": 1e-2},
                            {"params": model.net[2].parameters(), "lr": 0.0}])
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, batches())
        found = {f.path: f for f in by_code(w, "not-updating")}
    assert set(found) == {"net.2.weight", "net.2.bias"}
    f = found["net.2.weight"]
    assert "param group 1 has lr=0" in f.message and f.evidence["lr"] == 0.0 and f.evidence["param_group"] == 1


def test_a_warmup_from_lr_zero_is_not_a_finding(run_dir):
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))    # lr 0 at step 0 only
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(6):
            x, y = batches()()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            w.step(loss)
        assert w.findings() == []


class BagOfIds(nn.Module):
    """A large embedding table (recommendation models, large vocabularies): each step's ids reach a few hundred of
    its 100,000 rows, which the evenly spaced update sample seldom meets."""

    def __init__(self, rows=100_000, dim=32):
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids):
        return self.head(self.table(ids).mean(1))


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "sparse-adam"])
def test_a_large_table_updated_in_a_few_rows_is_updating(run_dir, optimizer):
    torch.manual_seed(0)
    model = BagOfIds()
    if optimizer == "sparse-adam":
        model.table.sparse = True
        opts = [torch.optim.SparseAdam(model.table.parameters(), lr=1e-3),
                torch.optim.Adam(model.head.parameters(), lr=1e-3)]
    else:
        opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
               else torch.optim.Adam(model.parameters(), lr=1e-3))
        opts = [opt]
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opts, run_dir=run_dir, every=1) as w:
        for _ in range(6):
            ids, y = torch.randint(0, 100_000, (32, 8), generator=g), torch.randint(0, 2, (32,), generator=g)
            loss = F.cross_entropy(model(ids), y)
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o in opts:
                o.step()
            w.step(loss)
        assert by_code(w, "not-updating") == [] and not w.probe_errors
    updates = stored(w, "SELECT s.update_norm FROM param_stats s JOIN params p USING (rank, param_id) "
                        "WHERE p.path = 'table.weight' ORDER BY s.step")
    assert len(updates) == 6 and all(u > 0 for u, in updates)


def test_a_large_table_with_lr_zero_is_not_updating(run_dir):
    """The rows the gradient reaches did not change either: the table is reported."""
    torch.manual_seed(0)
    model = BagOfIds()
    opt = torch.optim.SGD([{"params": model.table.parameters(), "lr": 0.0},
                           {"params": model.head.parameters(), "lr": 0.1}])
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            ids, y = torch.randint(0, 100_000, (32, 8), generator=g), torch.randint(0, 2, (32,), generator=g)
            loss = F.cross_entropy(model(ids), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert [f.path for f in by_code(w, "not-updating")] == ["table.weight"]


# ------------------------------------------------------------------------- 6. one bug, one card
def test_consequences_name_their_cause(run_dir):
    model = zoo.XORClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    X, y = zoo.xor_data(64)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 6, lambda: (X, y))
        found = w.findings()
    roots = [f for f in found if f.cause is None and f.code == "unregistered-module"]
    assert [f.path for f in roots] == ["encoder.blocks"]            # the plain list: one root cause
    consequences = [f for f in found if f.cause is not None]
    assert len(consequences) == 12                     # 6 not-updating + 6 grad-accumulating
    for f in consequences:
        assert f.code in ("not-updating", "grad-accumulating")
        assert f.cause == ("unregistered-module", "encoder.blocks")
    rows = stored(w, "SELECT code, path, cause_code, cause_path FROM findings WHERE active=1 "
                     "AND path='encoder.blocks[1].weight' ORDER BY code")
    assert rows == [("grad-accumulating", "encoder.blocks[1].weight", "unregistered-module", "encoder.blocks"),
                    ("not-updating", "encoder.blocks[1].weight", "unregistered-module", "encoder.blocks")]


def test_a_head_replaced_after_the_optimizer_is_one_bug():
    model = zoo.AdapterModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.head = nn.Linear(32, 4)
    stale = [f for f in probes.audit(model, opt) if f.code == "stale-optimizer-param"]
    assert stale and all(f.cause is None for f in stale)   # the static audit reports; the watcher folds
    from probes.findings.causes import assign_causes
    folded = [f for f in assign_causes(probes.audit(model, opt)) if f.code == "stale-optimizer-param"]
    assert {f.cause for f in folded} == {("not-in-optimizer", "head.weight"), ("not-in-optimizer", "head.bias")}


# ------------------------------------------------------------------------- 7. eval() is not no_grad(), both ways
def _train_with(model, opt, w, steps, x, y, after_validation):
    for step in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)
        if step == 1:
            after_validation(model)


@pytest.mark.parametrize("every", [1, 5])
def test_training_on_after_eval_without_train_is_reported(run_dir, every):
    def validate_and_forget_train(model):
        model.eval()
        with torch.no_grad():
            model(torch.randn(16, 8))                  # ... and model.train() is never called again
    model = zoo.BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = batches(16)()
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        _train_with(model, opt, w, 7, x, y, validate_and_forget_train)
        (f,) = by_code(w, "train-step-in-eval-mode")
        assert f.severity == "warning" and (f.first_step, f.count) == (2, 5) and "bn" in f.evidence["modules"]
        assert not by_code(w, "eval-builds-graph")
        model.train()                                  # the fix
        _train_with(model, opt, w, 1, x, y, lambda m: None)
        assert not by_code(w, "train-step-in-eval-mode")


def precise_bn(model, batches):
    """fvcore's and detectron2's PreciseBN: the model in training mode under no_grad, every BatchNorm at momentum
    1.0, the caller averaging each batch's statistics."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    momenta = [m.momentum for m in norms]
    means = [torch.zeros_like(m.running_mean) for m in norms]
    with torch.no_grad():
        for m in norms:
            m.momentum = 1.0
        for i, x in enumerate(batches):
            model(x)
            for mean, m in zip(means, norms, strict=True):
                mean += (m.running_mean - mean) / (i + 1)
        for mean, m, momentum in zip(means, norms, momenta, strict=True):
            m.running_mean.copy_(mean)
            m.momentum = momentum


@pytest.mark.parametrize("recompute", ["update_bn", "precise_bn"])
def test_recomputing_batchnorm_statistics_is_no_validation_in_train_mode(run_dir, recompute):
    """swa_utils.update_bn and PreciseBN run the model in training mode under no_grad on purpose, to recompute the
    BatchNorm statistics during training; validation in train mode afterwards is still found."""
    model = zoo.BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = batches(16)()
    stats = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(6):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if step % 2 == 1:
                if recompute == "update_bn":
                    torch.optim.swa_utils.update_bn(stats, model)
                else:
                    precise_bn(model, stats)
        assert by_code(w, "train-mode-under-no-grad") == []
        with torch.no_grad():
            model(x)                                     # validation, in train mode
        _train_with(model, opt, w, 1, x, y, lambda m: None)
        assert len(by_code(w, "train-mode-under-no-grad")) == 1


def pgd(model, x, y, steps=3, eps=0.1):
    """The attack of adversarial training (Madry et al.), as robustness libraries run it: in eval mode, gradients with
    respect to the input only."""
    model.eval()
    x_adv = x.clone()
    for _ in range(steps):
        x_adv.requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(model(x_adv), y), [x_adv])
        x_adv = (x_adv.detach() + eps / steps * g.sign()).clamp(x - eps, x + eps)
    return x_adv.detach()


@pytest.mark.parametrize("every", [1, 5])
@pytest.mark.parametrize("train_after_attack", [True, False])
def test_adversarial_training_attacks_in_eval_mode(run_dir, every, train_after_attack):
    """PGD adversarial training: the attack's eval forwards are backpropagated (to the input), then model.train() and
    the step trains on the adversarial batch. No finding; without model.train() after the attack, the step trains in
    eval mode: found."""
    model = zoo.BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = batches(16)()
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        for _ in range(6):
            x_adv = pgd(model, x, y)
            if train_after_attack:
                model.train()
            loss = F.cross_entropy(model(x_adv), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        codes = {f.code for f in w.findings()}
    if train_after_attack:
        assert codes == set()
    else:
        assert "train-step-in-eval-mode" in codes and "eval-builds-graph" not in codes


@pytest.mark.parametrize("every", [1, 5])
def test_evaluation_without_no_grad_builds_graphs_for_nothing(run_dir, every):
    def validate_without_no_grad(model):
        model.eval()
        model(torch.randn(16, 8))                      # builds an autograd graph nobody uses
        model.train()
    model = zoo.BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = batches(16)()
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        _train_with(model, opt, w, 4, x, y, validate_without_no_grad)
        (f,) = by_code(w, "eval-builds-graph")
        assert f.severity == "info" and f.first_step == 2 and f.evidence == {"forwards": 1, "output_numel": 32}
        assert not by_code(w, "train-step-in-eval-mode") and not by_code(w, "train-mode-under-no-grad")


def test_validation_done_right_gives_neither(run_dir):
    def validate(model):
        model.eval()
        with torch.no_grad():
            model(torch.randn(16, 8))
        model.train()
    model = zoo.BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = batches(16)()
    with probes.watch(model, opt, run_dir=run_dir, every=5) as w:
        _train_with(model, opt, w, 6, x, y, validate)
        assert w.findings() == []


# ------------------------------------------------------------------------- 8. keep what works
def test_amp_grad_scaler_skipping_steps_is_no_finding(run_dir):
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches()()
    skipped = 0
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(8):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if step in (1, 2):                         # an overflow, as fp16 training meets now and then
                model.net[0].weight.grad[0, 0] = float("inf")
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            w.step(loss)
        assert skipped >= 1
        assert [f for f in w.findings() if f.severity == "error" or f.code == "not-updating"] == []


def test_gradient_accumulation_over_micro_batches_is_not_grad_accumulating(run_dir):
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(5):
            opt.zero_grad()
            for _ in range(4):                         # four micro-batches per optimizer step
                x, y = batches()()
                (F.cross_entropy(model(x), y) / 4).backward()
            opt.step()
        assert w.findings() == []


def test_a_gradient_on_a_tensor_no_module_owns_is_no_bypass_and_breaks_no_sample():
    """A registered tensor whose module the walk did not find (module_id None: its parameter lives on a wrapper) has
    no owner. Its owners were an empty tuple, and the forward-bypass check, which reads each tensor's first owner,
    raised on it: the sample's findings were lost (a probe error) whenever such a tensor got a gradient."""
    import dataclasses
    from types import MappingProxyType

    from probes.capture.record import StepRecord
    from probes.findings.evaluation import bypass_candidates
    from probes.model import index as model_index

    model = zoo.Bypass()
    index = model_index.build_index(model, [torch.optim.SGD(model.parameters(), lr=0.1)], model_index.IdRegistry())
    ownerless = index.structure.tensors[index.tensor_paths["proj.weight"]]
    ownerless.module_id = None
    index = dataclasses.replace(index, owners=MappingProxyType(model_index._owners(index.structure)))
    assert ownerless.param_id not in index.owners
    rec = StepRecord()
    rec.calls = {index.paths["out"]: 1}        # proj's forward skipped its hooks: its tensors are candidates
    rec.arrived = {t.param_id for t in index.structure.tensors}
    found = bypass_candidates(rec, index)
    assert [c.tensor_id for c in found] == [index.tensor_paths["proj.bias"]]
