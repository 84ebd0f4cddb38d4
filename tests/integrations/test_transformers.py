"""probes.integrations.transformers with the real Hugging Face Trainer, on CPU: a tiny GPT-2 from a config
(nothing downloaded) is healthy under accumulation, clipping, evaluation and bf16; the seeded bugs are
found at the plain paths; steps are optimizer steps; losses are the Trainer's own and bit-identical."""
from __future__ import annotations

import pytest
import torch
from frameworks import (
    MODE_CODES,
    DictDataset,
    Net,
    assert_bugs_found,
    assert_healthy,
    assert_user_paths,
    codes,
    grad_norms,
    inject_inf,
    status,
    steps,
)
from torch.nn.modules import module as module_hooks

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 16) -> None:
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def args(tmp_path, **kw):
    opts = {"output_dir": str(tmp_path / "out"), "report_to": "none", "use_cpu": True, "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 8, "num_train_epochs": 1, "save_strategy": "no", "logging_steps": 1,
            "disable_tqdm": True, "seed": 0, "learning_rate": 1e-3, **kw}
    return transformers.TrainingArguments(**opts)


def modscope(run_dir):
    from probes.integrations.transformers import ModscopeCallback
    return ModscopeCallback(run_dir=run_dir, every=1)


def train(model, tmp_path, callbacks, dataset=None, eval_dataset=None, before=None, **kw):
    trainer = transformers.Trainer(model=model, args=args(tmp_path, **kw), train_dataset=dataset or TokenDataset(),
                                   eval_dataset=eval_dataset, callbacks=callbacks)
    trainer.remove_callback(transformers.PrinterCallback)
    if before is not None:
        before(trainer)
    trainer.train()
    return trainer


def logged_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# ---------------------------------------------------------------------------------------- healthy
def test_tiny_gpt2_with_accumulation_clipping_and_evaluation_is_healthy(tmp_path, run_dir, capsys):
    cb = modscope(run_dir)
    t = train(gpt2(), tmp_path, [cb], eval_dataset=TokenDataset(16), gradient_accumulation_steps=2,
              max_grad_norm=0.5, eval_strategy="steps", eval_steps=2)
    w = cb.watcher
    assert w.closed and status(w.store_path) == "closed"
    assert t.state.global_step == 4                          # 32 samples / 4 per batch / 2 accumulated
    recorded = steps(w.store_path)
    assert [s for s, _ in recorded] == list(range(4))        # steps are optimizer steps, not micro-batches
    # the loss of each step is what the Trainer logs for it (logging_steps=1; older transformers, such as 4.42, log it
    # rounded to 4 decimals)
    assert [loss for _, loss in recorded] == pytest.approx(logged_losses(t), rel=1e-6, abs=5.01e-5)
    findings = w.findings()
    assert_healthy(findings)                                 # tied embeddings are an info finding only
    assert not {c for c, _ in codes(findings)} & MODE_CODES
    assert_user_paths(w.store_path)
    assert all(g is not None and g > 0 for g in grad_norms(w.store_path, "transformer.h.0.mlp.c_fc.weight"))
    assert "training_step" not in vars(t)                    # the wrapper went with the watcher
    assert capsys.readouterr().err.count(f"modscope: watching GPT2LMHeadModel -> {run_dir}") == 1


def test_bf16_on_cpu_gives_no_false_finding(tmp_path, run_dir):
    cb = modscope(run_dir)
    t = train(gpt2(), tmp_path, [cb], bf16=True, gradient_accumulation_steps=2)
    assert_healthy(cb.watcher.findings())
    assert len(steps(cb.watcher.store_path)) == t.state.global_step == 4


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_amp_skipped_steps_are_steps_without_a_false_finding(tmp_path, run_dir, optim):
    """accelerate makes no GradScaler on CPU: one is given to the Trainer's accelerator before train(), and an
    inf gradient (an fp16 overflow) makes it skip a step. The Trainer still counts that step. The fused
    AdamW (the Trainer's default) is called on the skipped step, with the scaler's found_inf set."""
    cb = modscope(run_dir)
    model = gpt2()
    handle = inject_inf(model.lm_head.weight, {1})
    scaler = torch.amp.GradScaler("cpu")

    def with_scaler(trainer):
        trainer.accelerator.scaler = scaler
    t = train(model, tmp_path, [cb], max_grad_norm=0.0, before=with_scaler, optim=optim)
    handle.remove()
    assert scaler.get_scale() < 65536.0                     # the scaler did skip a step
    assert len(steps(cb.watcher.store_path)) == t.state.global_step == 8
    assert_healthy(cb.watcher.findings())


# ---------------------------------------------------------------------------------------- bugs
def test_seeded_bugs_are_found_at_the_plain_paths(tmp_path, run_dir):
    cb = modscope(run_dir)
    t = train(Net(bug=True), tmp_path, [cb], dataset=DictDataset(), per_device_train_batch_size=8,
              gradient_accumulation_steps=2)
    assert len(steps(cb.watcher.store_path)) == t.state.global_step == 4
    findings = cb.watcher.findings()
    assert_bugs_found(findings)
    assert ("not-updating", "encoder.blocks[0].weight") in codes(findings)
    assert_user_paths(cb.watcher.store_path)


# ---------------------------------------------------------------------------------------- numerics
def test_losses_are_bit_identical_with_and_without_the_callback(tmp_path, run_dir):
    runs = []
    for watched in (False, True):
        model = gpt2()
        losses: list[torch.Tensor] = []

        def record(module, args, out, losses=losses):
            if module.training:
                losses.append(out.loss.detach().clone())
        model.register_forward_hook(record)
        train(model, tmp_path, [modscope(run_dir)] if watched else [], gradient_accumulation_steps=2)
        runs.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    (plain, plain_params), (watched_losses, watched_params) = runs
    assert torch.equal(plain, watched_losses)
    assert all(torch.equal(a, b) for a, b in zip(plain_params, watched_params, strict=True))


# ---------------------------------------------------------------------------------------- torch.compile
def _compiled_run(tmp_path, callbacks):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    t = train(gpt2(), tmp_path, callbacks, torch_compile=True, torch_compile_backend="eager")
    return t, {k: dict(counters[k]) for k in ("stats", "graph_break", "recompiles")}


def test_torch_compile_true_stays_compiled_under_the_callback(tmp_path, run_dir):
    """The Trainer compiles the model it calls (accelerate's torch.compile wrapper); the callback watches
    that wrapper, so sampled steps run eagerly and the graph is neither broken nor recompiled by hooks."""
    _, bare_dynamo = _compiled_run(tmp_path, [])
    from probes.integrations.transformers import ModscopeCallback
    cb = ModscopeCallback(run_dir=run_dir, every=2)
    t, watched_dynamo = _compiled_run(tmp_path, [cb])
    assert type(t.model_wrapped).__name__ == "OptimizedModule"
    assert bare_dynamo["stats"].get("unique_graphs", 0) >= 1
    assert watched_dynamo == bare_dynamo
    w = cb.watcher
    assert len(steps(w.store_path)) == t.state.global_step == 8
    assert_healthy(w.findings())
    assert_user_paths(w.store_path)
    assert any(g is not None for g in grad_norms(w.store_path, "transformer.h.0.mlp.c_fc.weight"))


# ---------------------------------------------------------------------------------------- lifecycle
class Failing(Net):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x, labels=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom in forward")
        return super().forward(x, labels)


def test_an_exception_in_training_closes_the_watcher(tmp_path, run_dir):
    cb = modscope(run_dir)
    model = Failing(fail_at=3)
    trainer = transformers.Trainer(model=model, args=args(tmp_path), train_dataset=DictDataset(), callbacks=[cb])
    with pytest.raises(RuntimeError, match="boom in forward"):
        trainer.train()
    w = cb.watcher
    assert w.closed and status(w.store_path) == "closed"
    assert "training_step" not in vars(trainer)
    assert not module_hooks._global_forward_hooks and not module_hooks._global_forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    inner = trainer.optimizer.optimizer
    assert not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks


def test_bad_arguments_fail_when_the_callback_is_made():
    from probes.integrations.transformers import ModscopeCallback
    with pytest.raises(ValueError, match=r"window must be an int from 1 to 256 \(sampled steps\), got 0"):
        ModscopeCallback(window=0)
    assert isinstance(ModscopeCallback(), transformers.TrainerCallback)
