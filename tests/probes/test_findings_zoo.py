"""Each finding code is raised on a model from the seeds' bug classes, at the right path."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
import zoo
from helpers import by_code, codes, train

import probes


def xor_batches(n=256):
    X, y = zoo.xor_data(n)
    return lambda: (X, y)


def test_plain_list_encoder_is_unregistered_not_updating_and_accumulating(run_dir):
    model = zoo.XORClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 6, xor_batches())
        found = codes(w.findings(), "error")
        warnings = codes(w.findings(), "warning")
    # the layers of one plain list: one root cause, at the list, naming its layers; the rest are its consequences
    [unregistered] = [f for f in w.findings() if f.code == "unregistered-module"]
    assert unregistered.path == "encoder.blocks" and unregistered.cause is None
    assert unregistered.evidence["layers"] == [f"encoder.blocks[{i}]" for i in range(3)]
    assert unregistered.evidence["parameter_tensors"] == 6 and unregistered.evidence["parameter_numbers"] == 816
    for i in range(3):
        assert ("not-updating", f"encoder.blocks[{i}].weight") in found
        assert ("grad-accumulating", f"encoder.blocks[{i}].weight") in warnings
    assert {f.cause for f in w.findings() if f.path.startswith("encoder.blocks[")} == \
        {("unregistered-module", "encoder.blocks")}
    # the registered layers are healthy
    assert not any(p.startswith(("stem", "head")) for _, p in found)
    msg = unregistered.message
    assert "optimizer" in msg and "state_dict()" in msg and "plain Python list encoder.blocks" in msg
    assert "encoder.blocks[0], encoder.blocks[1], encoder.blocks[2]" in msg


def test_fixed_model_has_no_errors(run_dir):
    model = zoo.XORClassifier()
    model.encoder.blocks = nn.ModuleList(model.encoder.blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 6, xor_batches())
        assert codes(w.findings(), "error") == set()


def test_audit_adapter_model_matches_the_chapter():
    model = zoo.AdapterModel()
    for p in model.norm.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.head = nn.Linear(32, 4)                 # re-initialised after the optimizer was built
    found = by_code(probes.audit(model, opt))
    [adapters] = found["unregistered-module"]          # one plain list: one finding naming its two layers
    assert (adapters.path, adapters.evidence["layers"]) == ("adapters", ["adapters[0]", "adapters[1]"])
    gate = found["unregistered-tensor"]
    assert [(f.path, f.severity) for f in gate] == [("gate", "error")]
    assert {f.path for f in found["not-in-optimizer"]} == {"head.weight", "head.bias"}
    assert {f.path for f in found["frozen-parameter"]} == {"norm"}           # one info for the frozen module
    stale = found["stale-optimizer-param"]
    assert len(stale) == 2 and all(f.severity == "warning" for f in stale)
    assert {f.evidence["replaced"] for f in stale} == {"head.weight", "head.bias"}
    # 'positions' is a non-persistent buffer: deliberate, not a finding
    assert not any(f.path == "positions" for fs in found.values() for f in fs)


def test_unregistered_tensor_without_grad_is_an_info_until_to_leaves_it_behind():
    """A constant kept as a plain tensor (torchvision's AnchorGenerator keeps its cell anchors so, moving them at use)
    is an info; once .to() moved the model and left the tensor on another device, a warning."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.scale = torch.ones(2)
            self.cache = {"k": torch.zeros(3)}
    model = M()
    found = {(f.code, f.path): f.severity for f in probes.audit(model)}
    assert found[("unregistered-tensor", "scale")] == "info"
    assert found[("unregistered-tensor", "cache['k']")] == "info"
    model.to("meta")
    found = {(f.code, f.path): f for f in probes.audit(model)}
    assert found[("unregistered-tensor", "scale")].severity == "warning"
    assert "on cpu while the model is on meta" in found[("unregistered-tensor", "scale")].message


def test_containers_of_any_depth_and_cycles():
    class Holder:
        def __init__(self):
            self.proj = nn.Linear(2, 2)
            self.me = self                         # cycle

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.adapters = {"a": nn.Linear(2, 2)}
            self.nested = [({"deep": nn.Linear(2, 2)},)]
            self.helper = Holder()
            self.tags = {nn.Identity()}
            self.drops = [nn.Dropout(0.1)]
            self.loop = [self.fc]
            self.loop.append(self.loop)
    paths = {f.path: f.severity for f in probes.audit(M()) if f.code == "unregistered-module"}
    assert paths["adapters['a']"] == "error"
    assert paths["nested[0][0]['deep']"] == "error"
    assert paths["helper.proj"] == "error"
    assert "tags{0}" not in paths                  # no state and no mode: nothing can miss it
    assert paths["drops[0]"] == "error"            # no parameters, but model.eval() never reaches it
    assert "fc" not in paths and "loop[0]" not in paths


def test_dead_layer_and_dead_units(run_dir):
    x = torch.randn(64, 8)
    y = torch.randint(0, 2, (64,))
    for dead, expected in ((16, "dead-layer"), (8, "dead-units")):
        model = zoo.DeadReLU(dead_units=dead)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with probes.watch(model, opt, run_dir=run_dir / str(dead), every=1) as w:
            train(model, opt, w, 5, lambda: (x, y))
            f = [f for f in w.findings() if f.path == "act"]
        assert [g.code for g in f] == [expected], f
        assert f[0].evidence["dead_fraction"] >= (0.9 if dead == 16 else 0.25)


@pytest.mark.parametrize("dead,expected", [(32, "dead-layer"), (16, "dead-units")])
def test_dead_units_of_an_expert_the_router_skips_on_some_steps(run_dir, dead, expected):
    """An expert that runs in every other step, on 40 to 68 tokens: it is judged over those (the varying sizes show
    that they held enough values per unit), and its dead units are found."""
    model = zoo.SometimesRoutedExperts(dead_units=dead)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 8, lambda: (torch.randn(96, 8), torch.randint(0, 2, (96,))))
        f = [(g.code, g.path) for g in w.findings() if g.code in ("dead-layer", "dead-units")]
    assert f == [(expected, "experts.0.act")]


def test_a_dead_layer_is_reported_at_the_relu_not_at_the_blocks_returning_its_output(run_dir):
    block = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    with torch.no_grad():
        block[0].bias.fill_(-100.0)
    model = nn.Sequential(block, nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, lambda: (torch.randn(64, 8), torch.randint(0, 2, (64,))))
        f = [(g.code, g.path) for g in w.findings() if g.code.startswith("dead")]
    assert f == [("dead-layer", "0.1")]


def test_dead_units_are_reported_at_the_relu_never_at_the_dropout_after_it(run_dir):
    """Half the ReLU's units are dead: found there. The Dropout after it zeroes more at random, and over a few small
    batches a healthy unit's values are all dropped: dropout's zeros are no dead units (it was a dead-units warning,
    at the Dropout, beside the ReLU's or alone)."""
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 2))
    with torch.no_grad():
        model[0].bias[:32] = -100.0
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, lambda: (torch.randn(64, 8), torch.randint(0, 2, (64,))))
        f = [(g.code, g.path) for g in w.findings() if g.code.startswith("dead")]
    assert f == [("dead-units", "1")]
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.9), nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir / "small", every=1) as w:
        train(model, opt, w, 3, lambda: (torch.randn(4, 8), torch.randint(0, 2, (4,))))
        assert w.findings() == []


def test_constant_output_is_a_dead_layer(run_dir):
    class Const(nn.Module):
        def forward(self, x):
            return torch.zeros_like(x) + 3.0
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.const = Const()
            self.out = nn.Linear(4, 2)
        def forward(self, x):
            return self.out(self.fc(x) + self.const(x))
    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, lambda: (torch.randn(16, 4), torch.randint(0, 2, (16,))))
        assert ("dead-layer", "const") in codes(w.findings(), "error")


def test_saturated_tanh(run_dir):
    model = zoo.Saturated()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, lambda: (torch.randn(64, 8), torch.randint(0, 2, (64,))))
        sat = [f for f in w.findings() if f.code == "saturated"]
    assert [f.path for f in sat] == ["act"]
    assert sat[0].evidence["saturated_fraction"] > 0.5


def test_saturated_hidden_layer_is_reported_at_the_activation_not_its_wrappers(run_dir):
    """A block returning its Tanh's very output shares its statistics: one warning, at the Tanh. A generator's final
    Tanh is no output layer: the discriminator runs on it, and G learns through it."""
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 2))
    with torch.no_grad():
        model[0][0].weight.mul_(200.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, lambda: (torch.randn(64, 8), torch.randint(0, 2, (64,))))
        sat = [f for f in w.findings() if f.code == "saturated"]
    assert [(f.path, f.severity) for f in sat] == [("0.1", "warning")]
    assert sat[0].evidence["output_layer"] is False

    class GAN(nn.Module):
        def __init__(self):
            super().__init__()
            self.G = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
            self.D = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))
    gan = GAN()
    with torch.no_grad():
        gan.G[0].weight.mul_(200.0)
    opt_g, opt_d = torch.optim.SGD(gan.G.parameters(), lr=1e-4), torch.optim.SGD(gan.D.parameters(), lr=1e-4)
    with probes.watch(gan, [opt_g, opt_d], run_dir=run_dir / "gan", every=1) as w:
        for _ in range(4):
            fake = gan.G(torch.randn(32, 4))
            loss_d = F.softplus(gan.D(fake.detach())).mean() + F.softplus(-gan.D(torch.randn(32, 16))).mean()
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = F.softplus(-gan.D(fake)).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            w.step(loss_g)
        sat = [(f.path, f.severity) for f in w.findings() if f.code == "saturated"]
    assert sat == [("G.1", "warning")]


def test_training_mode_mismatch_for_unregistered_dropout(run_dir):
    model = zoo.DropoutInList()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        model.eval()                               # does not reach regs[0]
        train(model, opt, w, 2, lambda: (torch.randn(8, 8), torch.randn(8, 8)), loss_fn=F.mse_loss)
        f = [f for f in w.findings() if f.code == "training-mode-mismatch"]
    assert [(g.path, g.severity) for g in f] == [("regs[0]", "error")]
    assert f[0].evidence == {"module_training": True, "root_training": False}


def _train_with_norms_in_eval(model, opt, w, steps, frozen):
    for _ in range(steps):
        model.train()
        for m in frozen(model):
            m.eval()
        loss = F.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.randint(0, 10, (4,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)


def test_batchnorm_frozen_on_purpose_is_one_info_and_one_left_in_eval_a_warning(run_dir):
    """Fine-tuning with every BatchNorm in eval (mmdetection's norm_eval, timm's freeze_bn) freezes their running
    statistics on purpose: one info at the root. A stage left in eval while others train: its mode was set after
    model.train() (one warning at the stage, its blocks and layers told in it)."""
    model = zoo.ResNetSmall()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        _train_with_norms_in_eval(model, opt, w, 3, lambda m: norms)
        found = [f for f in w.findings() if f.code == "training-mode-mismatch"]
        assert [(f.path, f.severity, f.evidence["n_modules"]) for f in found] == [("", "info", len(norms))]
        assert "stem.1" in found[0].evidence["modules"] and "frozen" in found[0].message
        _train_with_norms_in_eval(model, opt, w, 2, lambda m: m.layer1.modules())     # eval() left on one block
        found = [f for f in w.findings() if f.code == "training-mode-mismatch"]
    assert sorted((f.path, f.severity, f.evidence.get("modules_inside")) for f in found) == [
        ("layer1", "warning", 6)]                  # its 2 blocks (user modules with state) and their 4 BatchNorms


def test_validation_in_train_mode_under_no_grad(run_dir):
    model = zoo.BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 2, lambda: (torch.randn(16, 8), torch.randint(0, 2, (16,))))
        assert not [f for f in w.findings() if f.code == "train-mode-under-no-grad"]
        with torch.no_grad():
            model(torch.randn(16, 8))              # validation, still in train mode
        train(model, opt, w, 1, lambda: (torch.randn(16, 8), torch.randint(0, 2, (16,))))
        f = [f for f in w.findings() if f.code == "train-mode-under-no-grad"]
        assert len(f) == 1 and f[0].severity == "warning" and "bn" in f[0].evidence["modules"]
        model.eval()                               # the fix
        with torch.no_grad():
            model(torch.randn(16, 8))
        model.train()
        train(model, opt, w, 1, lambda: (torch.randn(16, 8), torch.randint(0, 2, (16,))))
        assert not [f for f in w.findings() if f.code == "train-mode-under-no-grad"]


def test_non_finite_names_the_first_producer(run_dir):
    model = zoo.ProducesNaN()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 1, lambda: (torch.randn(16, 8), torch.randint(0, 2, (16,))))
        nf = [f for f in w.findings() if f.code == "non-finite"]
    assert nf and nf[0].path == "bad" and nf[0].severity == "error"
    assert nf[0].evidence["modules_affected"] >= 2      # out and the root inherit it


def test_a_non_finite_episode_names_what_later_steps_saw_once(run_dir):
    """A log of negative values from the fourth step on (bench.stored_stats' model)."""
    from bench.stored_stats import TurnsNonFinite
    model = TurnsNonFinite()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 6, lambda: (torch.randn(8, 16), torch.randint(0, 3, (8,))))
        (nf,) = [f for f in w.findings() if f.code == "non-finite"]
    assert (nf.path, nf.first_step, nf.count) == ("head", 3, 3)
    later = nf.evidence["later"]
    assert "<root>" in later and len(set(later)) == len(later)


class MaskedPolicy(nn.Module):
    """Invalid actions masked with -inf before the loss (reinforcement learning's action masks)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.pi = MaskedLogits()

    def forward(self, x):
        return self.pi(torch.relu(self.body(x)))


class MaskedLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.mask_all = False          # every action of the first row invalid: its log-softmax is NaN

    def forward(self, h):
        mask = torch.zeros(h.shape[0], 4, dtype=torch.bool)
        mask[:, 3] = True
        if self.mask_all:
            mask[0] = True
        return self.lin(h).masked_fill(mask, float("-inf"))


def test_minus_inf_masking_is_an_info_until_nan_follows(run_dir):
    model = MaskedPolicy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batch = lambda: (torch.randn(16, 8), torch.randint(0, 3, (16,)))        # targets among the valid actions
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, batch)
        nf = [f for f in w.findings() if f.code == "non-finite"]
        assert [(f.path, f.severity, f.evidence["masking"]) for f in nf] == [("pi", "info", True)]
        assert "-inf values" in nf[0].message and not w.probe_errors
        model.pi.mask_all = True
        train(model, opt, w, 2, batch)
        nf = [f for f in w.findings() if f.code == "non-finite"]
    assert nf and all(f.severity == "error" for f in nf)


def test_divergence_to_nan_is_one_non_finite_finding_not_dead_layers(run_dir):
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():
        model.net[0].weight.fill_(float("nan"))          # diverged: NaN flows through every layer
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, lambda: (torch.randn(8, 8), torch.randint(0, 2, (8,))))
        found = w.findings()
    assert not [f for f in found if f.code in ("dead-layer", "dead-units", "saturated")]
    assert [f.path for f in found if f.code == "non-finite" and f.evidence["kind"] == "activation"] == ["net.0"]


class GainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.lin(x) * self.gain


class BypassedBlockAndTables(nn.Module):
    """A block whose .forward() is called directly (its child runs through __call__, it does not: certain), and
    embedding tables read directly, as DETR reads its queries and GPT-2-like code slices learned positions."""

    def __init__(self):
        super().__init__()
        self.block = GainBlock()
        self.queries = nn.Embedding(4, 8)
        self.pos = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.block.forward(x) + self.pos.weight[:x.shape[0]] + self.queries.weight.mean(0)
        return self.out(h)


def test_forward_bypassed(run_dir):
    """A leaf whose .forward() is called directly cannot be told from one whose weight is read directly: a warning
    naming both, but an info for an embedding table; a module whose children ran without it: a warning."""
    model = zoo.Bypass()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 2, lambda: (torch.randn(8, 8), torch.randint(0, 2, (8,))))
        f = [f for f in w.findings() if f.code == "forward-bypassed"]
    assert [(g.path, g.severity, g.evidence["forward_called"]) for g in f] == [("proj", "warning", False)]
    assert ".forward() was called directly or its parameters were read directly" in f[0].message
    model = BypassedBlockAndTables()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir / "tables", every=1) as w:
        train(model, opt, w, 2, lambda: (torch.randn(8, 8), torch.randint(0, 2, (8,))))
        found = sorted((g.path, g.evidence["parameter"], g.severity, g.evidence["forward_called"])
                       for g in w.findings() if g.code == "forward-bypassed")
    assert found == [("block", "block.gain", "warning", True), ("pos", "pos.weight", "info", False),
                     ("queries", "queries.weight", "info", False)]


def test_shared_parameter_is_info():
    model = zoo.GPT()
    f = [f for f in probes.audit(model) if f.code == "shared-parameter"]
    assert len(f) == 1 and f[0].severity == "info"
    assert f[0].path == "wte.weight" and f[0].evidence["aliases"] == ["head.weight"]


def test_closure_module_found_at_run_time(run_dir):
    model = zoo.make_closure_model()
    assert not [f for f in probes.audit(model) if f.code == "unregistered-module"]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 2, lambda: (torch.randn(8, 8), torch.randint(0, 2, (8,))))
        f = [f for f in w.findings() if f.code == "unregistered-module"]
    assert [(g.path, g.severity) for g in f] == [("<unreachable Linear>", "error")]


def test_parameter_free_criterion_built_in_forward_is_no_finding_but_shows_in_the_tree(run_dir):
    """Hugging Face models build CrossEntropyLoss() inside forward: harmless, so not a finding."""
    model = zoo.CriterionInForward()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(3):
            loss = model(torch.randn(8, 8), torch.randint(0, 2, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert w.findings() == []
    import sqlite3
    con = sqlite3.connect(w.store_path)
    assert con.execute("SELECT path, kind FROM modules WHERE kind='runtime'").fetchall() == [
        ("<unreachable CrossEntropyLoss>", "runtime")]


def test_fresh_linear_built_each_call_is_an_error(run_dir):
    model = zoo.FreshLinearEachCall()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 3, lambda: (torch.randn(8, 8), torch.randint(0, 2, (8,))))
        f = [f for f in w.findings() if f.code == "unregistered-module"]
    assert [(g.path, g.severity) for g in f] == [("<unreachable Linear>", "error")]
    assert "every forward" in f[0].message


class CutGraph(nn.Module):
    """The graph from the loss back to ``body`` cut in one of the ways that train the rest of the model silently."""

    def __init__(self, cut):
        super().__init__()
        self.cut = cut
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        if self.cut == "detach":
            h = self.body(x).detach()
        elif self.cut == "reentrant-checkpoint":          # its input does not require grad: gradients are None
            h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=True)
        elif self.cut == "no_grad-in-forward":
            with torch.no_grad():
                h = self.body(x)
        else:
            h = self.body(x)
        return self.head(h)


@pytest.mark.parametrize("cut", ["detach", "reentrant-checkpoint", "no_grad-in-forward"])
def test_a_trained_layer_no_gradient_reaches_is_reported_until_one_does(run_dir, cut):
    torch.manual_seed(0)
    model = CutGraph(cut)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = lambda: (torch.randn(16, 8), torch.randint(0, 2, (16,)))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w, warnings.catch_warnings():
        warnings.simplefilter("ignore")                   # the checkpoint's own warning
        train(model, opt, w, 1, batch)
        assert not [f for f in w.findings() if f.code == "no-gradient"]     # one step could be another loss's
        train(model, opt, w, 2, batch)
        found = [f for f in w.findings() if f.code == "no-gradient"]
        assert [(f.path, f.severity, f.evidence["tensors"], f.count) for f in found] == [
            ("body.0", "warning", ["body.0.weight", "body.0.bias"], 3)]
        assert not w.probe_errors and codes(w.findings()) == {("no-gradient", "body.0")}
        model.cut = None                                  # the fix
        train(model, opt, w, 1, batch)
        assert w.findings() == []


def test_every_finding_says_what_to_do():
    for code, (severity, fix) in probes.CODES.items():
        assert severity in ("error", "warning", "info") and len(fix) > 20, code


class OneElementSGD(torch.optim.Optimizer):
    """Updates a single element of each tensor: a change the strided update sample misses."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.view(-1)[1] -= group["lr"] * (p.grad.view(-1)[1] + 1.0)


def test_bfloat16_weights_whose_updates_round_away_are_not_updating_and_say_why(run_dir):
    """Pure bfloat16 training: AdamW's steps of about lr=1e-3 are below half the spacing of bfloat16 around a
    LayerNorm's weight of 1 (2**-8): the weight never changes, and the finding says that precision is why."""
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 4, lambda: (torch.randn(16, 8, dtype=torch.bfloat16), torch.randint(0, 2, (16,))))
        f = {g.path: g for g in w.findings() if g.code == "not-updating"}
    assert "1.weight" in f and "0.weight" not in f
    assert f["1.weight"].evidence["dtype"] == "bfloat16" and "bfloat16" in f["1.weight"].message
    assert "master weights" in f["1.weight"].message


def test_an_update_the_sample_misses_is_still_seen(run_dir):
    model = nn.Sequential(nn.Linear(1000, 100))
    opt = OneElementSGD(model.parameters())
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 3, lambda: (torch.randn(4, 1000), torch.randn(4, 100)), loss_fn=F.mse_loss)
        assert not [f for f in w.findings() if f.code == "not-updating"]
    import sqlite3
    con = sqlite3.connect(w.store_path)
    rows = con.execute("SELECT s.update_norm FROM param_stats s JOIN params p USING(rank, param_id) "
                       "WHERE p.path = '0.weight'").fetchall()
    assert rows and all(r[0] > 0 for r in rows)
    assert con.execute("SELECT moved FROM params WHERE path = '0.weight'").fetchone()[0] == 1


def test_default_sampling_reports_the_demo_bugs_within_the_first_steps(run_dir):
    model = zoo.XORClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=run_dir) as w:          # the overhead budget, no every=
        train(model, opt, w, 4, xor_batches())
        found = codes(w.findings())
    assert ("not-updating", "encoder.blocks[0].weight") in found
    assert ("grad-accumulating", "encoder.blocks[2].bias") in found
