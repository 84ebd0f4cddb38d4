"""probes.integrations.accelerate with the real accelerate, on CPU: steps are optimizer steps under
``accelerator.accumulate``, paths are the user's through a wrapper, AMP skips (a real GradScaler, plain and
fused optimizers) and clipping give no false finding, the seeded bugs are found, losses are bit-identical,
and everything the helper attaches comes off when the watcher closes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from frameworks import (
    Net,
    assert_bugs_found,
    assert_healthy,
    assert_user_paths,
    codes,
    grad_norms,
    inject_inf,
    loader,
    status,
    steps,
)
from torch.nn.modules import module as module_hooks

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """AcceleratorState is a process-wide singleton: each test makes its own Accelerator."""
    yield
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run(model, run_dir=None, accumulate=2, clip=1.0, scaler=None, fused=False, wrap=None, **accelerator_kw):
    """Train ``model`` with an accelerate loop; watched when ``run_dir`` is given. Returns (watcher or None,
    per-micro-batch losses, the AcceleratedOptimizer, the accelerator, optimizer steps taken)."""
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate, **accelerator_kw)
    if scaler is not None:
        acc.scaler = scaler                        # accelerate makes none on CPU: a real one, given
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    model, opt, data = acc.prepare(model, opt, loader())
    if wrap is not None:
        model = wrap(model)
    w = None
    if run_dir is not None:
        from probes.integrations.accelerate import watch
        w = watch(acc, model, opt, run_dir=run_dir, every=1)
    losses, stepped = [], 0
    try:
        for x, y in data:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients and clip:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
            stepped += acc.sync_gradients
            losses.append(loss.detach().clone())
    finally:
        if w is not None:
            w.close()
    return w, losses, opt, acc, stepped


def test_healthy_with_accumulation_and_clipping_steps_are_optimizer_steps(run_dir, capsys):
    w, losses, opt, acc, stepped = run(Net(), run_dir)
    assert stepped == 4                                       # 8 batches, 2 accumulated
    recorded = steps(w.store_path)
    assert [s for s, _ in recorded] == list(range(4))
    # the loss of a step: the mean of the losses given to accelerator.backward for its micro-batches
    expected = [float((a + b) / 2) for a, b in zip(losses[0::2], losses[1::2], strict=True)]
    assert [loss for _, loss in recorded] == pytest.approx(expected, rel=1e-6)
    assert_healthy(w.findings())
    assert all(g is not None and g > 0 for g in grad_norms(w.store_path, "stem.weight"))
    assert status(w.store_path) == "closed"
    assert "backward" not in vars(acc) and "step" not in vars(opt)       # the wrappers came off
    assert not opt.optimizer._optimizer_step_pre_hooks and not opt.optimizer._optimizer_step_post_hooks
    assert capsys.readouterr().err.count(f"modscope: watching Net -> {run_dir}") == 1


def test_a_wrapper_adds_no_prefix_to_the_paths(run_dir):
    """The model as the loop calls it, inside a wrapper (DataParallel: DDP's ``module.`` on CPU)."""
    w, *_ = run(Net(bug=True), run_dir, wrap=torch.nn.DataParallel)
    assert_user_paths(w.store_path)
    assert_bugs_found(w.findings())


def test_bf16_autocast_gives_no_false_finding(run_dir):
    w, *_ , stepped = run(Net(), run_dir, mixed_precision="bf16")
    assert_healthy(w.findings())
    assert len(steps(w.store_path)) == stepped


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_amp_skipped_steps_are_steps_without_a_false_finding(run_dir, fused):
    """A real GradScaler: an inf gradient (an fp16 overflow) makes it skip a step. A plain optimizer is not
    called then; a fused one is, with the scaler's found_inf set."""
    model = Net()
    handle = inject_inf(model.head.weight, {2})
    scaler = torch.amp.GradScaler("cpu")
    w, _, _, _, stepped = run(model, run_dir, accumulate=1, clip=0.0, scaler=scaler, fused=fused)
    handle.remove()
    assert scaler.get_scale() < 65536.0                       # the scaler did skip a step
    assert len(steps(w.store_path)) == stepped == 8           # the skipped step is a step
    assert_healthy(w.findings())


def test_seeded_bugs_are_found_at_the_plain_paths(run_dir):
    w, *_ = run(Net(bug=True), run_dir)
    findings = w.findings()
    assert_bugs_found(findings)
    assert ("not-updating", "encoder.blocks[0].weight") in codes(findings)


def test_losses_are_bit_identical_with_and_without_watch(run_dir):
    results = []
    for rd in (None, run_dir):
        torch.manual_seed(0)
        model = Net()
        _, losses, *_ = run(model, rd)
        results.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    (plain, plain_params), (watched, watched_params) = results
    assert torch.equal(plain, watched)
    assert all(torch.equal(a, b) for a, b in zip(plain_params, watched_params, strict=True))


def test_an_exception_in_the_loop_closes_the_watcher_and_detaches(run_dir):
    model = Net()
    from probes.integrations.accelerate import watch
    acc = accelerate.Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    with pytest.raises(RuntimeError, match="boom"), watch(acc, model, opt, run_dir=run_dir, every=1) as w:
        for i, (x, y) in enumerate(loader()):
            if i == 3:
                raise RuntimeError("boom")
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    assert w.closed and status(w.store_path) == "closed"
    assert "backward" not in vars(acc) and "step" not in vars(opt)
    assert not module_hooks._global_forward_hooks and not module_hooks._global_forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt.optimizer._optimizer_step_pre_hooks and not opt.optimizer._optimizer_step_post_hooks


def test_bad_arguments_name_the_value(run_dir):
    from probes.integrations.accelerate import watch
    with pytest.raises(TypeError, match=r"accelerator must be an accelerate\.Accelerator, got str: 'acc'"):
        watch("acc", Net(), None, run_dir=run_dir)
    with pytest.raises(TypeError, match="boundaries='optimizer'"):
        watch(accelerate.Accelerator(cpu=True), Net(), None, run_dir=run_dir, boundaries="optimizer")
