"""Findings that must be one root cause and not noise, each on a real training loop: a forgotten zero_grad() is one
root finding, a learning rate decayed to nothing says so, layers dead because their input is dead are
consequences, and a frozen backbone is one info."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import probes


def data(n=32, din=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, din, generator=g), torch.randint(0, classes, (n,), generator=g)
    return x, y


# ------------------------------------------------------------------------- 1. zero_grad() forgotten
class ResBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x)))


class ResMLP(nn.Module):
    def __init__(self, din=16, d=32, classes=4, blocks=5):
        super().__init__()
        self.stem = nn.Linear(din, d)
        self.blocks = nn.Sequential(*[ResBlock(d) for _ in range(blocks)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def test_a_forgotten_zero_grad_is_one_root_finding_with_the_right_fix(run_dir):
    model = ResMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data()
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(5):
            loss = F.cross_entropy(model(x), y)
            loss.backward()                            # optimizer.zero_grad() never called
            opt.step()
            w.step(loss)
        found = [f for f in w.findings() if f.code == "grad-accumulating"]
    n = sum(1 for _ in model.parameters())
    # one finding at the root, not one per tensor (26 here; hundreds on an LLM)
    assert [(f.path, f.severity, f.cause) for f in found] == [("", "warning", None)], [str(f) for f in found]
    root = found[0]
    assert root.evidence["tensors"] == n and root.evidence["optimizers"] == [0]
    assert "never zeroed" in root.message and "nobody uses" not in root.message
    assert "optimizer.zero_grad()" in root.fix and "register" not in root.fix


def test_a_part_of_the_model_left_unzeroed_is_reported_per_tensor(run_dir):
    """Only the blocks are zeroed (blocks.zero_grad()): the stem and the head accumulate, each its own finding."""
    model = ResMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data()
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            loss = F.cross_entropy(model(x), y)
            model.blocks.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        found = {f.path: f for f in w.findings() if f.code == "grad-accumulating"}
    assert sorted(found) == ["head.bias", "head.weight", "stem.bias", "stem.weight"]
    assert "steps with that growing sum" in found["stem.weight"].message
    stem = found["stem.weight"]
    judged = stem.evidence["tensors_with_gradients"]        # every tensor the optimizer holds got some
    assert judged == sum(1 for _ in model.parameters()) and judged - 4 == stem.evidence["tensors_zeroed"]
    assert f"{judged - 4} of the {judged} tensors it holds that got gradients are zeroed" in stem.message
    assert "optimizer.zero_grad()" in found["stem.weight"].fix


class Unregistered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.scale = torch.ones(4, requires_grad=True)      # no optimizer holds it, nothing zeroes it

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_tensor_no_optimizer_holds_that_accumulates_keeps_its_own_finding(run_dir):
    model = Unregistered()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data()
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        found = [(f.path, f.cause) for f in w.findings() if f.code == "grad-accumulating"]
        msg = next(f.message for f in w.findings() if f.code == "grad-accumulating")
    assert found == [("scale", ("unregistered-tensor", "scale"))]
    assert "nobody uses" in msg


def test_gradient_accumulation_over_micro_batches_is_not_reported(run_dir):
    model = ResMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            for _ in range(3):                         # zero_grad after every 3rd micro-batch, step every 3
                x, y = data(seed=torch.randint(0, 100, ()).item())
                (F.cross_entropy(model(x), y) / 3).backward()
            opt.step()
            opt.zero_grad()
            w.step()
        assert [str(f) for f in w.findings()] == []


# ------------------------------------------------------------------------- 2. a learning rate decayed to nothing
def test_a_learning_rate_decayed_to_nothing_is_named_as_why_a_tensor_does_not_update(run_dir):
    """StepLR(step_size=10, gamma=0.1) stepped per batch, not per epoch (the review's was step_size=50 over 400
    batches): after 80 batches lr is 1e-11, AdamW's steps of about lr per value round away in float32, and the message
    says the lr is why."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.1)
    x, y = data()
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(85):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()                               # per batch
            w.step(loss)
        found = {f.path: f for f in w.findings() if f.code == "not-updating"}
    # a weight's values near 0 still move by 1e-11 (its update is seen); its biases' do not
    assert "0.bias" in found, [str(f) for f in w.findings()]
    f = found["0.bias"]
    assert "lr is 1.0e-11" in f.message and "scheduler" in f.message, f.message
    assert "did not change it" not in f.message
    assert f.evidence["lr"] == pytest.approx(1e-11) and "schedule" in f.fix


def test_a_healthy_small_learning_rate_is_not_blamed(run_dir):
    """lr=1e-6 moves float32 weights: no finding. lr=0 keeps its own message."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-6},
                             {"params": model[2].parameters(), "lr": 0.0}])
    x, y = data()
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        found = {f.path: f for f in w.findings() if f.code == "not-updating"}
    assert sorted(found) == ["2.bias", "2.weight"]
    assert "lr=0" in found["2.weight"].message


# ------------------------------------------------------------------------- 4. layers after a dead layer
def _dead_findings(model, run_dir, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = data()
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return {f.path: f for f in w.findings() if f.code in ("dead-layer", "dead-units")}


def test_layers_dead_because_their_input_is_dead_are_consequences_of_the_first_dead_layer(run_dir):
    """Linear -> ReLU (bias -3: dead) -> Linear (bias -3) -> ReLU: the second Linear's output is its bias, constant,
    and the ReLU after it is 0: both follow from the first dead ReLU, their cause, not root errors of their own."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].bias.fill_(-3.0)
        model[2].bias.fill_(-3.0)
    found = _dead_findings(model, run_dir)
    assert sorted(found) == ["1", "2", "3"], [str(f) for f in found.values()]
    assert found["1"].cause is None and found["1"].severity == "error"
    for p in ("2", "3"):
        assert found[p].cause == ("dead-layer", "1"), str(found[p])
        assert "LeakyReLU" not in found[p].fix and "1" in found[p].fix
    assert found["2"].evidence["dead_input"] == "1" and found["3"].evidence["dead_input"] == "2"
    # a Dropout between them passes the zeros on: the chain goes through it
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    with torch.no_grad():
        model[0].bias.fill_(-3.0)
        model[3].bias.fill_(-3.0)
    found = _dead_findings(model, run_dir / "dropout")
    assert {p: f.cause for p, f in found.items()} == {"1": None, "3": ("dead-layer", "1"), "4": ("dead-layer", "1")}


class TwoBranches(nn.Module):
    """Two branches of the same input, run one after the other, each dead of its own bias: two root causes (the
    second's input, x, is alive, though a dead layer ran just before it)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            self.a[0].bias.fill_(-100.0)
            self.b[0].bias.fill_(-100.0)

    def forward(self, x):
        return self.head(torch.cat([self.a(x), self.b(x)], 1))


def test_a_dead_layer_whose_input_is_alive_stays_a_root_cause(run_dir):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].bias.fill_(-100.0)                    # the second ReLU dies; its input, the first's, is alive
    found = _dead_findings(model, run_dir)
    assert [(p, f.cause) for p, f in found.items()] == [("3", None)]
    found = _dead_findings(TwoBranches(), run_dir / "branches")
    assert sorted((p, f.cause) for p, f in found.items()) == [("a.1", None), ("b.1", None)]


# ------------------------------------------------------------------------- 3. a frozen backbone is one info
class FineTuned(nn.Module):
    """A frozen backbone (a ResNet's), a neck whose bias is frozen inside a Linear that trains, a trained head."""

    def __init__(self):
        super().__init__()
        import zoo
        self.backbone = zoo.ResNetSmall(num_classes=16)
        self.neck = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.backbone.requires_grad_(False)
        self.neck.bias.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.neck(self.backbone(x))))


def _frozen(model, run_dir, steps=2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            loss = F.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.randint(0, 4, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return [f for f in w.findings() if f.code == "frozen-parameter"], w


def test_a_frozen_backbone_is_one_info_and_a_frozen_tensor_in_a_trained_module_its_own(run_dir):
    model = FineTuned()
    found, w = _frozen(model, run_dir)
    assert sorted((f.path, f.severity) for f in found) == [("backbone", "info"), ("neck.bias", "info")], \
        [str(f) for f in found]
    backbone = next(f for f in found if f.path == "backbone")
    tensors = list(model.backbone.parameters())
    assert backbone.evidence["tensors"] == len(tensors)
    assert backbone.evidence["parameters"] == sum(p.numel() for p in tensors)
    assert f"in {len(tensors)} tensors, all requires_grad=False" in backbone.message
    # drawn on the backbone's module in the tree
    from helpers import stored
    assert stored(w, "SELECT m.path FROM findings f JOIN modules m USING (rank, module_id) "
                     "WHERE f.code = 'frozen-parameter' AND f.path = 'backbone'") == [("backbone",)]


class LoRA(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base
        self.A = nn.Linear(base.in_features, 2, bias=False)
        self.B = nn.Linear(2, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.B(self.A(x))


def test_many_frozen_modules_around_adapters_are_one_info_at_the_root(run_dir):
    """LoRA on every Linear of a 12-block MLP: each block's base Linear and its norm are frozen, 24 subtrees (290 infos
    on LLaMA-7B): one info at the root that counts them."""
    blocks = []
    for _ in range(12):
        blocks += [LoRA(nn.Linear(16, 16)), nn.LayerNorm(16)]
    model = nn.Sequential(nn.Flatten(), nn.Linear(768, 16), *blocks, nn.Linear(16, 4))
    for m in model.modules():
        if not isinstance(m, LoRA) and m is not model:
            m.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, LoRA):
            m.A.requires_grad_(True)
            m.B.requires_grad_(True)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    found, _ = _frozen(model, run_dir)
    assert [(f.path, f.severity) for f in found] == [("", "info")], [str(f) for f in found]
    assert found[0].evidence["tensors"] == len(frozen) and found[0].evidence["modules"] == 26
    assert "2.base" in found[0].evidence["examples"]


# ------------------------------------------------------------------------- 6. saturated Tanh is no confident output
def _saturated(model, run_dir, watch_optimizer=True, steps=6):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, _ = data(n=64, din=8)
    with probes.watch(model, opt if watch_optimizer else None, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return {f.path: f for f in w.findings() if f.code == "saturated"}


def test_a_saturated_hidden_tanh_watched_without_an_optimizer_is_a_warning(run_dir):
    """probes.watch(model) with no optimizer: nothing says which layers train, so no activation is the output layer
    (it was: every saturated activation was a 'confident model' info)."""
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[0].weight.mul_(100)
    found = _saturated(model, run_dir, watch_optimizer=False)
    assert found["1"].severity == "warning"
    assert "confident" not in found["1"].message


def test_a_saturated_final_tanh_is_a_warning_and_a_final_sigmoid_an_info(run_dir):
    """A generator (actor) watched alone whose final Tanh feeds an unwatched critic: a Tanh's saturation is no
    confident probability, a warning; a final Sigmoid stays the confident output layer's info."""
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Tanh())
    with torch.no_grad():
        gen[2].weight.mul_(100)
    found = _saturated(gen, run_dir)
    assert found["3"].severity == "warning"
    assert "confident" not in found["3"].message
    clf = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Sigmoid())
    with torch.no_grad():
        clf[2].weight.mul_(100)
    found = _saturated(clf, run_dir / "clf")
    assert found["3"].severity == "info"


# ------------------------------------------------------------------------- 7. a head skipped every other step
class TwoHeads(nn.Module):
    """A multi-task model alternating heads per step; head A's ReLU is dead (bias -100)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.a_fc, self.a_act, self.a_out = nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
        self.b_fc, self.b_act, self.b_out = nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
        with torch.no_grad():
            self.a_fc.bias.fill_(-100.0)

    def forward(self, x, task):
        h = self.trunk(x)
        if task == 0:
            return self.a_out(self.a_act(self.a_fc(h)))
        return self.b_out(self.b_act(self.b_fc(h)))


def test_a_dead_layer_in_a_head_called_every_other_step_is_reported(run_dir):
    """A head called on even steps only, with fixed batches: its dead ReLU (constant 0) was never judged (the values
    per unit of a sometimes-called module were estimated as its number of calls, never 64); a constant output over
    3 calls is evidence by itself. The healthy head stays quiet."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(10):
            loss = model(torch.randn(64, 8, generator=g), step % 2).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        found = {f.path: f for f in w.findings() if f.code in ("dead-layer", "dead-units")}
    assert found["a_act"].code == "dead-layer"
    assert not [p for p in found if p.startswith("b_")]


# ------------------------------------------------------------------------- 8. dead units seen only at a dropout
def _dead_units(model, run_dir, steps=12, batch=8):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            loss = model(torch.randn(batch, 10, 16, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        return {f.path: f for f in w.findings() if f.code in ("dead-layer", "dead-units")}


def test_dead_units_of_a_transformer_layers_functional_relu_are_reported_at_its_dropout(run_dir):
    """nn.TransformerEncoderLayer applies F.relu: the Dropout after it is the only module whose output shows the
    dead FFN units. With p=0.1 and 16 sampled steps a live unit's values are all dropped with chance far below 1e-6:
    judged (dropouts were never judged)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True)
    with torch.no_grad():
        layer.linear1.bias[:32] = -100.0          # 32 of 64 FFN units never activate
    found = _dead_units(nn.Sequential(layer, nn.Linear(16, 1)), run_dir)
    assert found["0.dropout"].code == "dead-units"
    assert set(found) == {"0.dropout"}


def test_dead_units_before_a_light_dropout_are_reported_at_the_relu_only(run_dir):
    """A ReLU module with dead units followed by Dropout(0.1), judged now: the units that die upstream are reported
    at the activation that kills them, not again at the dropout."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    with torch.no_grad():
        model[0].bias[:32] = -100.0
    found = _dead_units(model, run_dir)
    assert set(found) == {"1"}
    assert found["1"].code == "dead-units"
