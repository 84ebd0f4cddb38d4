"""Small configs of the transformers families people train today (nothing downloaded), by name, and the model
each builds; a family the installed transformers lacks skips the test, naming the version."""

from __future__ import annotations

import pytest

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
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(_DECODER, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=64,
                         moe_intermediate_size=16, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
}


def build(name: str):
    """The ``name`` family's model from its small config (a test skipped when transformers lacks it)."""
    transformers = pytest.importorskip("transformers")
    model_cls, config_cls, kwargs = FAMILIES[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
