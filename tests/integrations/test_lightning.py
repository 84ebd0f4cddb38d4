"""probes.integrations.lightning with the real Lightning (lightning.pytorch and pytorch_lightning), on CPU:
steps are optimizer steps, paths are the LightningModule's, closures / accumulation / validation / bf16 /
AMP skips / clipping give no false finding, the seeded bugs are found, losses are bit-identical."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from frameworks import (
    MODE_CODES,
    assert_bugs_found,
    assert_healthy,
    assert_user_paths,
    build,
    codes,
    forward,
    grad_norms,
    inject_inf,
    loader,
    status,
    steps,
)
from torch.nn.modules import module as module_hooks

pytest.importorskip("lightning")
PACKAGES = ["lightning.pytorch", "pytorch_lightning"]


def pkg(name: str = "lightning.pytorch"):
    return pytest.importorskip(name)


def lightning_net(pl, bug: bool = False, fail_at: int | None = None, manual: bool = False,
                  validate_in_train_mode: bool = False, fused: bool = False):
    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            build(self, bug)
            self.automatic_optimization = not manual

        def forward(self, x):
            return forward(self, x)

        def training_step(self, batch, batch_idx):
            if fail_at is not None and batch_idx == fail_at:
                raise RuntimeError("boom in training_step")
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            if manual:                          # accumulate two micro-batches, then step
                opt = self.optimizers()
                self.manual_backward(loss / 2)
                if batch_idx % 2 == 1:
                    opt.step()
                    opt.zero_grad()
            return loss

        def validation_step(self, batch, batch_idx):
            if validate_in_train_mode:         # the bug: undoes the eval() of Lightning's validation loop
                self.train()
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self):
            if fused:                           # unscales and skips by itself under a GradScaler
                return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Net()


def trainer(pl, callbacks, **kw):
    opts = {"max_epochs": 2, "accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "logger": False,
            "enable_checkpointing": False, "enable_model_summary": False, "check_val_every_n_epoch": 1, **kw}
    return pl.Trainer(callbacks=callbacks, **opts)


def fit(pl, model, callbacks, **kw):
    t = trainer(pl, callbacks, **kw)
    t.fit(model, loader(), loader(16))
    return t


def recorder(pl):
    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].detach().clone())
    return Record()


def modscope(run_dir, **kw):
    from probes.integrations.lightning import ModscopeCallback
    return ModscopeCallback(run_dir=run_dir, every=1, **kw)


# ---------------------------------------------------------------------------------------- healthy
@pytest.mark.parametrize("package", PACKAGES)
def test_healthy_with_accumulation_validation_and_clipping_steps_are_optimizer_steps(package, run_dir, capsys):
    pl = pkg(package)
    cb = modscope(run_dir)
    t = fit(pl, lightning_net(pl), [cb], accumulate_grad_batches=2, gradient_clip_val=0.5)
    w = cb.watcher
    assert w.closed and status(w.store_path) == "closed"
    assert t.global_step == 8                               # 8 batches x 2 epochs / 2 accumulated
    recorded = steps(w.store_path)
    assert [s for s, _ in recorded] == list(range(8))       # steps are optimizer steps, not micro-batches
    assert all(loss is not None for _, loss in recorded)
    findings = w.findings()
    assert_healthy(findings)                                # no grad-accumulating, no mode finding, no clip alarm
    assert not {c for c, _ in codes(findings)} & MODE_CODES
    assert_user_paths(w.store_path)
    # measured after the closure ran backward, not at the optimizer's pre-hook (before forward)
    assert all(g is not None and g > 0 for g in grad_norms(w.store_path, "stem.weight"))
    assert capsys.readouterr().err.count(f"modscope: watching Net -> {run_dir}") == 1


def test_a_validation_in_train_mode_is_found(run_dir):
    """The contrast of the healthy run: the watcher does see the forwards of Lightning's validation loop."""
    pl = pkg()
    cb = modscope(run_dir)
    fit(pl, lightning_net(pl, validate_in_train_mode=True), [cb], max_epochs=1, num_sanity_val_steps=0)
    assert "train-mode-under-no-grad" in {c for c, _ in codes(cb.watcher.findings())}


def test_the_stored_loss_is_the_step_s_accumulated_loss(run_dir):
    pl = pkg()
    cb, rec = modscope(run_dir), recorder(pl)
    fit(pl, lightning_net(pl), [cb, rec], accumulate_grad_batches=2, max_epochs=1)
    # outputs["loss"] is each micro-batch's loss / accumulate_grad_batches: the step's loss is their sum
    expected = [float(a + b) for a, b in zip(rec.losses[0::2], rec.losses[1::2], strict=True)]
    assert [loss for _, loss in steps(cb.watcher.store_path)] == pytest.approx(expected, rel=1e-6)


def test_bf16_mixed_precision_gives_no_false_finding(run_dir):
    pl = pkg()
    cb = modscope(run_dir)
    t = fit(pl, lightning_net(pl), [cb], precision="bf16-mixed", accumulate_grad_batches=2)
    assert_healthy(cb.watcher.findings())
    assert len(steps(cb.watcher.store_path)) == t.global_step == 8


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_amp_skipped_steps_are_steps_without_a_false_finding(run_dir, fused):
    """16-mixed with a real GradScaler on CPU: an inf gradient (an fp16 overflow) makes the scaler skip that
    step; Lightning still counts it. No non-finite or not-updating alarm for it. A fused optimizer is not
    unscaled by Lightning and is called on the skipped step too, with the scaler's found_inf set."""
    pl = pkg()
    from lightning.pytorch.plugins.precision import MixedPrecision
    scaler = torch.amp.GradScaler("cpu")
    model = lightning_net(pl, fused=fused)
    handle = inject_inf(model.head.weight, {2})
    cb = modscope(run_dir)
    before = scaler.get_scale()
    t = fit(pl, model, [cb], plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], max_epochs=1)
    handle.remove()
    assert scaler.get_scale() < before                       # the scaler did skip a step
    assert len(steps(cb.watcher.store_path)) == t.global_step == 8
    assert_healthy(cb.watcher.findings())


# ---------------------------------------------------------------------------------------- bugs
@pytest.mark.parametrize("package", PACKAGES)
def test_seeded_bugs_are_found_at_the_plain_paths(package, run_dir):
    pl = pkg(package)
    cb = modscope(run_dir)
    fit(pl, lightning_net(pl, bug=True), [cb], accumulate_grad_batches=2)
    findings = cb.watcher.findings()
    assert_bugs_found(findings)
    assert ("not-updating", "encoder.blocks[0].weight") in codes(findings)
    assert_user_paths(cb.watcher.store_path)


# ---------------------------------------------------------------------------------------- numerics
def test_losses_are_bit_identical_with_and_without_the_callback(run_dir):
    pl = pkg()
    runs = []
    for watched in (False, True):
        torch.manual_seed(0)
        rec = recorder(pl)
        model = lightning_net(pl)
        fit(pl, model, [rec, modscope(run_dir)] if watched else [rec], accumulate_grad_batches=2,
            gradient_clip_val=0.5)
        runs.append((torch.stack(rec.losses), [p.detach().clone() for p in model.parameters()]))
    (plain, plain_params), (watched_losses, watched_params) = runs
    assert torch.equal(plain, watched_losses)
    assert all(torch.equal(a, b) for a, b in zip(plain_params, watched_params, strict=True))


# ---------------------------------------------------------------------------------------- lifecycle
def _compiled_fit(pl, callbacks):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = lightning_net(pl)
    fit(pl, torch.compile(net, backend="eager"), callbacks)   # Lightning's from_compiled: compiled methods
    return net, {k: dict(counters[k]) for k in ("stats", "graph_break", "recompiles")}


def test_a_compiled_lightning_module_stays_compiled(run_dir):
    """fit(torch.compile(module)) compiles the module's forward and training_step on the instance: a sampled
    step runs the class's own (eager) methods, so the hooks are never traced; unsampled steps compile."""
    pl = pkg()
    _, bare = _compiled_fit(pl, [])
    from probes.integrations.lightning import ModscopeCallback
    cb = ModscopeCallback(run_dir=run_dir, every=2)
    net, watched = _compiled_fit(pl, [cb])
    assert bare["stats"]["unique_graphs"] >= 1 and watched["stats"].get("unique_graphs", 0) >= 1
    assert not watched["recompiles"]
    assert set(watched["graph_break"]) <= set(bare["graph_break"])   # Lightning's own (self.log), none of ours
    assert hasattr(vars(net)["training_step"], "_torchdynamo_orig_callable")   # put back after the fit
    assert not cb.watcher.probe_errors
    assert_healthy(cb.watcher.findings())
    assert len(steps(cb.watcher.store_path)) == 16


def test_an_exception_in_training_step_closes_the_watcher(run_dir):
    pl = pkg()
    cb = modscope(run_dir)
    model = lightning_net(pl, fail_at=3)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        fit(pl, model, [cb])
    w = cb.watcher
    assert w.closed and status(w.store_path) == "closed"
    assert not module_hooks._global_forward_hooks and not module_hooks._global_forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
               for opt in [o.optimizer if hasattr(o, "optimizer") else o for o in [model.optimizers(False)]])


def test_manual_optimization_uses_the_optimizer_s_own_steps(run_dir):
    pl = pkg()
    cb = modscope(run_dir)
    t = fit(pl, lightning_net(pl, manual=True), [cb], max_epochs=1)
    assert t.global_step == 4
    assert len(steps(cb.watcher.store_path)) == 4
    assert_healthy(cb.watcher.findings())


def test_bad_arguments_fail_when_the_callback_is_made():
    from probes.integrations.lightning import ModscopeCallback
    with pytest.raises(ValueError, match=r"every must be None or an int from 1 to 1,000,000 .*, got 0"):
        ModscopeCallback(every=0)
    with pytest.raises(ValueError, match=r"overhead must be a fraction in \(0, 1\], got 2"):
        ModscopeCallback(overhead=2)
    with pytest.raises(TypeError, match=r"run_dir must be a str, os\.PathLike or None, got int: 3"):
        ModscopeCallback(run_dir=3)


def test_one_class_is_a_callback_of_both_packages():
    from probes.integrations.lightning import ModscopeCallback
    cb = ModscopeCallback()
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        assert isinstance(cb, module.Callback)


def test_a_failure_inside_the_callback_never_stops_training(run_dir, monkeypatch, capsys):
    import probes

    def broken(*args, **kwargs):
        raise RuntimeError("the store cannot be made")
    monkeypatch.setattr(probes, "watch", broken)
    pl = pkg()
    cb = modscope(run_dir)
    t = fit(pl, lightning_net(pl), [cb], max_epochs=1)
    assert t.global_step == 8 and cb.watcher is None
    err = capsys.readouterr().err
    assert err.count("modscope: LightningWatch.start: RuntimeError: the store cannot be made") == 1


# ------------------------------------------------------------------------- modes without self(x)
def fine_tune_net(pl, direct: bool, mistake: str | None):
    """A frozen backbone with a BatchNorm and a trained head with a Dropout. ``direct``: training_step and
    validation_step call the submodules (``self.head(self.backbone(x))``, as Lightning's own examples do), so
    the LightningModule's forward never runs. ``mistake``: None (the backbone's BatchNorm left training: its
    statistics move), "fixed" (the backbone in eval at each epoch's start, as the warning says), "dropout off"
    (the head's Dropout put in eval at each epoch's start), "validation in train mode" (validation_step calls
    self.train())."""
    class FineTune(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU())
            self.backbone.requires_grad_(False)
            self.head = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                            torch.nn.Linear(16, 2))

        def forward(self, x):
            return self.head(self.backbone(x))

        def logits(self, x):
            return self.head(self.backbone(x)) if direct else self(x)

        def on_train_epoch_start(self):
            if mistake == "fixed":
                self.backbone.eval()
            elif mistake == "dropout off":
                self.head[1].eval()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.logits(x), y)

        def validation_step(self, batch, batch_idx):
            if mistake == "validation in train mode":
                self.train()
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.logits(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.head.parameters(), lr=0.05)

    torch.manual_seed(0)
    return FineTune()


def mode_kind(evidence: dict) -> str:
    """Which of the mode findings: frozen statistics that move, frozen on purpose, or one module's mismatch."""
    return next(k for k in ("running_statistics_updated", "frozen_normalization", "root_training") if k in evidence)


@pytest.mark.parametrize(("mistake", "expected"), [
    (None, {("training-mode-mismatch", "warning", "", "running_statistics_updated")}),
    ("fixed", {("training-mode-mismatch", "info", "", "frozen_normalization")}),
    ("dropout off", {("training-mode-mismatch", "warning", "", "running_statistics_updated"),
                     ("training-mode-mismatch", "warning", "head.1", "root_training")}),
])
def test_mode_findings_are_the_same_when_training_step_calls_submodules_only(run_dir, mistake, expected):
    """The Trainer sets the LightningModule's mode (train for the fit loop, eval for validation): that flag is
    the model's mode whether training_step calls self(x) or the submodules directly."""
    pl = pkg()
    found = {}
    for direct in (False, True):
        cb = modscope(run_dir / str(direct))
        fit(pl, fine_tune_net(pl, direct, mistake), [cb])
        found[direct] = {(f.code, f.severity, f.path, mode_kind(f.evidence)) for f in cb.watcher.findings()
                         if f.code == "training-mode-mismatch"}
    assert found[True] == found[False] == expected


def test_a_pretrained_hugging_face_model_left_in_eval_is_one_warning(run_dir, tmp_path):
    """``from_pretrained()`` returns the model in eval mode, and the Trainer does not call train() on the
    LightningModule that holds it: the fine-tuning runs with every dropout off. One warning at the model (its layers
    told in it), not one finding per layer and container; none once the model is put in training mode."""
    pl = pkg()
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")

    class FineTune(pl.LightningModule):
        def __init__(self, train_mode: bool) -> None:
            super().__init__()
            self.lm = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
            if train_mode:
                self.lm.train()

        def training_step(self, batch, batch_idx):
            return self.lm(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    found = {}
    for train_mode in (False, True):
        cb = modscope(run_dir / str(train_mode))
        trainer(pl, [cb], max_epochs=1).fit(FineTune(train_mode), data)
        found[train_mode] = [f for f in cb.watcher.findings() if f.code in MODE_CODES]
    assert found[True] == []
    # one cause: the step trained in eval mode because the model was left in it
    assert sorted((f.code, f.path, f.severity, f.cause) for f in found[False]) == [
        ("train-step-in-eval-mode", "", "warning", ("training-mode-mismatch", "lm")),
        ("training-mode-mismatch", "lm", "warning", None)]
    (f,) = [f for f in found[False] if f.code == "training-mode-mismatch"]
    assert (f.evidence["module_training"], f.evidence["root_training"]) == (False, True)
    assert f.evidence["modules_inside"] >= 8 and "from_pretrained(), which returns a model in eval mode" in f.message


def test_validation_in_train_mode_is_found_when_the_steps_call_submodules_only(run_dir):
    """Lightning's own examples call ``self.head(self.backbone(x))`` in training_step and validation_step: the
    LightningModule's forward never runs, yet validation in train mode is found, as with ``self(x)``."""
    pl = pkg()
    for direct in (False, True):
        cb = modscope(run_dir / str(direct))
        fit(pl, fine_tune_net(pl, direct, "validation in train mode"), [cb], num_sanity_val_steps=0)
        found = [f for f in cb.watcher.findings() if f.code == "train-mode-under-no-grad"]
        assert len(found) == 1 and "head.1" in found[0].evidence["modules"], direct
