"""More healthy models people really train, and the training patterns around them: a finding at warning or error on
any of them is a false alarm (see test_healthy_models.py). Real training loops, tiny sizes, CPU: mixture-of-experts
whose router skips experts, LLaMA, ViT, gradient accumulation, bf16 autocast, gradient clipping, a GAN with two
optimizers, a frozen backbone with low-rank adapters, warmup from lr=0, dropout, a confident multi-label classifier."""
import hf_families
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo
from helpers import stored

import probes

EXPECTED = {"shared-parameter"}          # tied weights: an info, said once


def alarms(w):
    """The findings at warning or error."""
    return [str(f) for f in w.findings() if f.severity in ("warning", "error")]


def anything(w, expected=EXPECTED):
    return [str(f) for f in w.findings() if f.code not in expected]


def assert_healthy_hf(model, run_dir, steps, inputs, after_step=None):
    """Train a Hugging Face model (its loss from ``labels``) with AdamW for ``steps`` steps, ``inputs()`` giving each
    step's keyword arguments and ``after_step(step)`` run after each: no finding but tied weights, no probe error."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(steps):
            out = model(**inputs())
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            w.step(out.loss)
            if after_step is not None:
                after_step(step)
        assert anything(w) == []
        assert not w.probe_errors, w.probe_errors


# ----------------------------------------------------------------------------- mixture of experts
class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TopKMoE(nn.Module):
    """A token-choice top-k router; an expert no token was routed to is not run (as Mixtral's loop over the experts
    hit does)."""

    def __init__(self, d=16, h=32, n=16, k=2):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(n))
        self.k = k

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.k, -1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return (flat + out).reshape(x.shape)


class MoELM(nn.Module):
    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.moe1 = TopKMoE(d)
        self.norm = nn.LayerNorm(d)
        self.moe2 = TopKMoE(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.moe2(self.norm(self.moe1(self.emb(ids)))))


def test_top_k_moe_whose_router_skips_experts(run_dir):
    """Two tokens a step among 16 experts (k=2): each expert runs in a few steps, on a token or two. Its ReLU units
    are zero over those few inputs by chance; they were called dead (dead-units, a warning) before: the unit activity
    covers the last sampled steps, and an expert skipped in most of them was judged on the couple it ran in."""
    model = MoELM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(30):
            ids = torch.randint(0, 50, (1, 2))
            loss = F.cross_entropy(model(ids).reshape(-1, 50), torch.randint(0, 50, (2,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert anything(w) == []
        assert not w.probe_errors, w.probe_errors
    calls = dict(stored(w, "SELECT m.path, COUNT(*) FROM module_stats s JOIN modules m USING(rank, module_id) "
                           "WHERE m.path LIKE 'moe%.experts.%.act' GROUP BY m.path"))
    assert calls and max(calls.values()) < 30                  # the router did skip experts
    # and no expert was taken for dead while no unit of any is: every unit fires on some of the 50 tokens
    with torch.no_grad():
        h = model.norm(model.moe1(model.emb(torch.arange(50)[None])))[0]
        assert all(bool((e.act(e.fc1(h)).amax(0) > 0).all()) for e in model.moe2.experts)


class StackedExperts(nn.Module):
    """The experts' weights stacked in one holder with no forward: the layer runs them in one batched product."""

    def __init__(self, n=4, d=8, h=16):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, d, h) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n, h, d) * 0.1)


class DenseMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = StackedExperts()
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(8)) for _ in range(2)])
        self.shifts = nn.ParameterDict({"out": nn.Parameter(torch.zeros(8))})
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        gates = self.router(x).softmax(-1)
        h = torch.einsum("bd,edh->beh", x, self.experts.w1).relu()
        y = (torch.einsum("beh,ehd->bed", h, self.experts.w2) * gates[..., None]).sum(1)
        return self.head(y * self.scales[0] + self.scales[1] + self.shifts["out"])


def test_parameter_holders_read_by_their_parent(run_dir):
    """A module with no forward (ParameterList, ParameterDict, a holder of stacked expert weights) is read, never
    called: it was reported forward-bypassed (a warning each) before."""
    model = DenseMoE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 2, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert anything(w) == []
        assert not w.probe_errors, w.probe_errors


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_hugging_face_mixture_of_experts(name, run_dir):
    """Three tokens a step among 8 experts: the router skips most of them in every step."""
    def inputs():
        ids = torch.randint(1, 100, (1, 3))
        return {"input_ids": ids, "labels": ids}
    assert_healthy_hf(hf_families.build(name), run_dir, 6, inputs)


def test_switch_transformers_experts_in_a_module_dict(run_dir):
    """One module per expert, run on the tokens routed to it (capacity 4): unrouted experts do not run."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "SwitchTransformersForConditionalGeneration"):
        pytest.skip("no SwitchTransformers")
    model = transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=8,
        expert_capacity=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, decoder_start_token_id=0,
        pad_token_id=0))
    assert_healthy_hf(model, run_dir, 6, lambda: {"input_ids": torch.randint(1, 100, (1, 4)),
                                                  "labels": torch.randint(1, 100, (1, 3))})


# ----------------------------------------------------------------------------- LLaMA, ViT
def test_llama(run_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))

    def inputs():
        ids = torch.randint(1, 100, (2, 12))
        return {"input_ids": ids, "labels": ids}
    assert_healthy_hf(model, run_dir, 8, inputs)


def test_vit(run_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5))

    def validate(step):
        if step % 4 == 3:
            model.eval()
            with torch.no_grad():
                model(pixel_values=torch.randn(4, 3, 16, 16))
            model.train()
    assert_healthy_hf(model, run_dir, 8, lambda: {"pixel_values": torch.randn(4, 3, 16, 16),
                                                  "labels": torch.randint(0, 5, (4,))}, validate)


# ----------------------------------------------------------------------------- training patterns
def gpt_batch():
    return torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))


def gpt_loss(out, y):
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("pattern", ["accumulation", "bf16-autocast", "clipping", "warmup-from-zero"])
def test_training_patterns_on_a_gpt(pattern, run_dir):
    """Gradient accumulation (an optimizer step every 4 micro-batches: watch's step is the optimizer's), bf16
    autocast on the CPU, clipping to a tiny norm, a linear warmup from lr=0 (the first step does not move anything)."""
    model = zoo.GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 5)) if pattern == "warmup-from-zero" \
        else None
    micro = 4 if pattern == "accumulation" else 1
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            for _ in range(micro):
                x, y = gpt_batch()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=pattern == "bf16-autocast"):
                    loss = gpt_loss(model(x), y) / micro
                loss.backward()
            if pattern == "clipping":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            w.step(loss)
        assert anything(w) == []
        assert not w.probe_errors, w.probe_errors


def test_bf16_autocast_resnet_with_batchnorm(run_dir):
    model = zoo.ResNetSmall()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(torch.randn(8, 3, 16, 16)), torch.randint(0, 10, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert anything(w) == []
        assert not w.probe_errors, w.probe_errors


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
        self.D = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())


def test_gan_with_two_optimizers(run_dir):
    """D trained on G's output under detach, then G through D: two optimizers, one watch step. D's final Sigmoid is
    the output layer; G's final Tanh is not (D runs on it)."""
    gan = GAN()
    opt_g = torch.optim.Adam(gan.G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(gan.D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    with probes.watch(gan, [opt_g, opt_d], run_dir=run_dir, every=1) as w:
        for _ in range(15):
            fake = gan.G(torch.randn(32, 8))
            loss_d = F.binary_cross_entropy(gan.D(torch.randn(32, 16) * 0.5 + 1), ones) + \
                F.binary_cross_entropy(gan.D(fake.detach()), zeros)
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = F.binary_cross_entropy(gan.D(fake), ones)
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            w.step(loss_g)
        assert anything(w) == []
        assert not w.probe_errors, w.probe_errors


class WGAN(nn.Module):
    """Lightning-style: the module's forward is the generator's."""

    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.D = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, z):
        return self.G(z)


def test_wgan_critic_trained_five_times_per_generator_step(run_dir):
    """The critic steps five times per generator step, the generator making its samples in each (detached): the steps
    in which the critic alone trained are not expected to reach G. G was reported no-gradient (a warning, on and off
    all run long) before: a step that trained any optimizer counted against every other one's tensors."""
    gan = WGAN()
    opt_g = torch.optim.Adam(gan.G.parameters(), lr=1e-4, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(gan.D.parameters(), lr=1e-4, betas=(0.0, 0.9))
    # the critic's last bias cancels in the difference of means: its gradient is exactly zero, it never learns (an info)
    intended = [("not-updating", "info", "D.2.bias")]
    with probes.watch(gan, [opt_g, opt_d], run_dir=run_dir, every=1) as w:
        for _ in range(3):
            for _ in range(5):
                fake = gan(torch.randn(32, 8)).detach()
                loss_d = gan.D(fake).mean() - gan.D(torch.randn(32, 16)).mean()
                opt_d.zero_grad()
                loss_d.backward()
                opt_d.step()
                w.step(loss_d)
                assert [(f.code, f.severity, f.path) for f in w.findings()] in ([], intended)
            loss_g = -gan.D(gan(torch.randn(32, 8))).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            w.step(loss_g)
        assert [(f.code, f.severity, f.path) for f in w.findings()] == intended
        assert not w.probe_errors, w.probe_errors
    assert stored(w, "SELECT code, path FROM findings") == [("not-updating", "D.2.bias")]   # nothing else, ever


class LoRALinear(nn.Module):
    """A frozen base layer and a trainable low-rank update (B starts at zero, as LoRA's does)."""

    def __init__(self, base, rank=4):
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + x @ self.A.t() @ self.B.t()


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.l1 = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.l2 = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, ids):
        return self.head(self.norm(self.l2(self.act(self.l1(self.emb(ids)))).mean(1)))


def test_frozen_backbone_with_low_rank_adapters(run_dir):
    """Base weights requires_grad=False and in no optimizer: frozen on purpose, an info per frozen module, never
    not-in-optimizer; the adapters train (B from zero: its first gradient moves A not at all)."""
    model = Backbone()
    model.requires_grad_(False)
    model.l1, model.l2 = LoRALinear(model.l1), LoRALinear(model.l2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(8):
            loss = F.cross_entropy(model(torch.randint(0, 50, (8, 10))), torch.randint(0, 5, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert anything(w, EXPECTED | {"frozen-parameter"}) == []
        assert {f.path for f in w.findings()} == {"emb", "l1.base", "l2.base", "norm", "head"}   # one per module
        assert {f.severity for f in w.findings()} == {"info"}
        assert not w.probe_errors, w.probe_errors


def test_dropout_heavy_model_validated_in_eval(run_dir):
    model = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 64),
                          nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(12):
            loss = F.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 10, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if step % 4 == 3:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(16, 32))
                model.train()
        assert anything(w) == []
        assert not w.probe_errors, w.probe_errors


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_rollouts_and_training_in_either_mode_with_dropout_at_zero(run_dir, p):
    """Reinforcement learning from feedback samples rollouts under no_grad with the model in train mode, and some
    trainers train in eval mode to turn dropout off: with every dropout at p=0 (as LLM fine-tuning configures them)
    the modes compute the same, and neither was a finding to report (train-mode-under-no-grad, train-step-in-eval-mode,
    warnings, before). At p=0.1 both still are."""
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(p), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(6):
            with torch.no_grad():
                model(torch.randn(16, 8))              # the rollout, in train mode
            if step >= 3:
                model.eval()                           # then trained in eval mode
            loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            model.train()
        found = {f.code for f in w.findings()}
        assert not w.probe_errors, w.probe_errors
    assert found == (set() if p == 0 else {"train-mode-under-no-grad", "train-step-in-eval-mode"})


def test_gpt2_rollouts_in_train_mode_with_dropout_off(run_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))

    def rollout():                                  # sampled under no_grad, in train mode
        with torch.no_grad():
            ids = model.generate(torch.randint(1, 100, (2, 4)), max_new_tokens=4, do_sample=True, pad_token_id=0)
        return {"input_ids": ids, "labels": ids}
    assert_healthy_hf(model, run_dir, 3, rollout)


# ----------------------------------------------------------------------------- a confident output layer
def test_confident_multi_label_classifier_with_a_sigmoid_output(run_dir):
    """A multi-label classifier ending in nn.Sigmoid, trained with binary_cross_entropy until it is confident: its
    output sits in the sigmoid's tails, which stalls nothing (the loss's gradient is p - y). It was a warning, twice
    (the Sigmoid and the Sequential returning its output); now an info at the Sigmoid alone."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8), nn.Sigmoid())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 32), (torch.randn(64, 8) > 0).float()
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(60):
            loss = F.binary_cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert alarms(w) == []
        found = [(f.code, f.path, f.severity, f.evidence["output_layer"]) for f in w.findings()]
        assert found == [("saturated", "3", "info", True)]
        assert "confident" in w.findings()[0].message
    assert loss.item() < 0.05                     # it is confident, and right
