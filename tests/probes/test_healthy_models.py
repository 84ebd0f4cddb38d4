"""False alarms are defects: healthy real models train under watch with no finding at all (tied weights,
which are deliberate, are reported as info and expected)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo

import probes

EXPECTED = {"shared-parameter"}          # tied weights: an info, said once


def errors(w):
    """Every finding but the expected ones (the name is historical: warnings and infos count too)."""
    return [str(f) for f in w.findings() if f.code not in EXPECTED]


def run_with_validation(model, opt, w, steps, batch_fn, loss_fn, no_grad=torch.no_grad):
    for step in range(steps):
        x, y = batch_fn()
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)
        if step % 2 == 1:                      # validation done right: eval + no_grad (or inference_mode)
            model.eval()
            with no_grad():
                model(batch_fn()[0])
            model.train()


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_resnet_with_inplace_relu_and_batchnorm(run_dir, no_grad):
    """Validated under no_grad, and under inference_mode (Lightning's default), whose tensors have no version
    counter: the hooks must not ask for it."""
    model = zoo.ResNetSmall()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = lambda: (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        run_with_validation(model, opt, w, 5, batch, F.cross_entropy, no_grad)
        assert errors(w) == []
        assert not w.probe_errors, w.probe_errors
        assert not [f for f in w.findings() if f.code == "train-mode-under-no-grad"]


def test_gpt_with_tied_weights_and_nonpersistent_mask(run_dir):
    model = zoo.GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = lambda: (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    loss_fn = lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        run_with_validation(model, opt, w, 5, batch, loss_fn)
        assert errors(w) == []
        assert not w.probe_errors, w.probe_errors
        found = {(f.code, f.path) for f in w.findings()}
    assert ("shared-parameter", "wte.weight") in found
    assert not any(c == "forward-bypassed" for c, _ in found)


def test_lstm(run_dir):
    model = zoo.LSTMTagger()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = lambda: (torch.randint(0, 50, (4, 12)), torch.randint(0, 5, (4, 12)))
    loss_fn = lambda out, y: F.cross_entropy(out.reshape(-1, 5), y.reshape(-1))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        run_with_validation(model, opt, w, 4, batch, loss_fn)
        assert errors(w) == []
        assert not w.probe_errors, w.probe_errors


def test_torch_transformer_encoder_multihead_attention(run_dir):
    """nn.MultiheadAttention uses out_proj's weights functionally: not a bypass."""
    model = nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2),
                          nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = lambda: (torch.randn(4, 10, 32), torch.randint(0, 3, (4, 10)))
    loss_fn = lambda out, y: F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        run_with_validation(model, opt, w, 3, batch, loss_fn)
        assert errors(w) == []
        assert not [f for f in w.findings() if f.code == "forward-bypassed"]


transformers = pytest.importorskip("transformers")


def _hf_models():
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        T5Config,
        T5ForConditionalGeneration,
    )
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32))
    bert = BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=100, max_position_embeddings=32))
    t5 = T5ForConditionalGeneration(T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64,
                                             num_heads=2, d_kv=16, vocab_size=100,
                                             decoder_start_token_id=0))
    return {"gpt2": gpt2, "bert": bert, "t5": t5}


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_hugging_face_models_raise_no_error(name, run_dir):
    torch.manual_seed(0)
    model = _hf_models()[name]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(1, 100, (2, 12))
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(3):
            if name == "t5":
                out = model(input_ids=ids, labels=torch.randint(1, 100, (2, 6)))
            else:
                out = model(input_ids=ids, labels=ids)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            w.step(out.loss)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, labels=ids) if name != "t5" else model(input_ids=ids, labels=ids[:, :6].contiguous())
        model.train()
        assert errors(w) == []
        assert not w.probe_errors, w.probe_errors
    import sqlite3
    con = sqlite3.connect(w.store_path)
    n = con.execute("SELECT COUNT(DISTINCT module_id) FROM module_stats").fetchone()[0]
    assert n > 10                                  # statistics really were taken on these models
