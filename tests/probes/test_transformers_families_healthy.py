"""Healthy models of the transformers families people train today, built from small configs (nothing downloaded),
train a few steps under probes.watch, validated in eval mode under no_grad, with exactly the findings intended: the
tied weights a family ties (an info), nothing else. Both with every step sampled and under the default budget.

Llama, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and Gemma-2 keep stateless helpers outside the registered tree (a plain
dict of rotary-embedding functions, ``self_attn._kernel_funcs``): no finding. A family the installed transformers
lacks is skipped, naming the version."""

from __future__ import annotations

import pytest
import torch

import probes

transformers = pytest.importorskip("transformers")

_DECODER = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(_DECODER, intermediate_size=64)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(_DECODER, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(_DECODER, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       num_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(_DECODER, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       head_dim=8)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",
              dict(_DECODER, intermediate_size=16, num_experts=8, num_experts_per_tok=2, eos_token_id=None,
                   pad_token_id=None)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(_DECODER, intermediate_size=64, head_dim=8, sliding_window=8)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)),
    "bert": ("BertForMaskedLM", "BertConfig",
             dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100,
                  max_position_embeddings=32)),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           dict(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=100,
                decoder_start_token_id=0)),
}
# the findings each family is meant to give: its tied weights, an info (the embedding tied to the output layer;
# BERT also ties the decoder's bias to its prediction head's)
INTENDED = {
    "gemma2": {("shared-parameter", "info", "model.embed_tokens.weight")},
    "gpt2": {("shared-parameter", "info", "transformer.wte.weight")},
    "bert": {("shared-parameter", "info", "bert.embeddings.word_embeddings.weight"),
             ("shared-parameter", "info", "cls.predictions.bias")},
    "t5": {("shared-parameter", "info", "shared.weight")},
}


def build(name: str):
    model_cls, config_cls, kwargs = FAMILIES[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    model.train()
    return model


def batch(name: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 100, (2, 12))
    return {"input_ids": ids, "labels": torch.randint(1, 100, (2, 6)) if name == "t5" else ids}


@pytest.mark.parametrize("every", [1, None], ids=["every-step", "default-budget"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_trains_with_only_the_intended_findings(name, every, run_dir):
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
        for step in range(6):
            out = model(**batch(name))
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            w.step(out.loss)
            if step % 3 == 2:                       # validation done right: eval and no_grad
                model.eval()
                with torch.no_grad():
                    model(**batch(name))
                model.train()
        found = {(f.code, f.severity, f.path) for f in w.findings()}
        assert found == INTENDED.get(name, set()), sorted(found)
        assert not w.probe_errors, w.probe_errors
