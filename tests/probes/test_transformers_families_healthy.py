"""Healthy models of the transformers families people train today, built from small configs (nothing downloaded),
train a few steps under probes.watch, validated in eval mode under no_grad, with exactly the findings intended: the
tied weights a family ties (an info), nothing else. Both with every step sampled and under the default budget.

Llama, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and Gemma-2 keep stateless helpers outside the registered tree (a plain
dict of rotary-embedding functions, ``self_attn._kernel_funcs``): no finding. A family the installed transformers
lacks is skipped, naming the version."""

from __future__ import annotations

import hf_families
import pytest
import torch

import probes

transformers = pytest.importorskip("transformers")

# the families trained here (hf_families.FAMILIES also builds DeepSeek-V3, for the mixture-of-experts tests)
NAMES = ("llama", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gemma2", "gpt2", "bert", "t5")
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
    torch.manual_seed(0)
    model = hf_families.build(name)
    model.train()
    return model


def batch(name: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 100, (2, 12))
    return {"input_ids": ids, "labels": torch.randint(1, 100, (2, 6)) if name == "t5" else ids}


@pytest.mark.parametrize("every", [1, None], ids=["every-step", "default-budget"])
@pytest.mark.parametrize("name", NAMES)
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
