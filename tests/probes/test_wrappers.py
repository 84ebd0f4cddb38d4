"""Wrappers are transparent: paths are the user's, whatever PyTorch puts around or inside the model.

DDP is covered in test_distributed.py and torch.compile in test_reliability.py. FSDP1
(FullyShardedDataParallel) needs an accelerator in this torch build, so the sharded case here is FSDP2
(``fully_shard``), which runs on the CPU with gloo."""
import sqlite3
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import zoo
from helpers import train

import probes

HERE = Path(__file__).resolve().parent


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def stored(store, sql):
    con = sqlite3.connect(store)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_activation_checkpoint_wrappers_inside_the_model_are_transparent(run_dir):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    model = Net()
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, 3, lambda: (x, torch.randint(0, 2, (8,))))
        assert w.findings() == [] and not w.probe_errors
    paths = {p for (p,) in stored(w.store_path, "SELECT path FROM modules")}
    assert {"blocks.0", "blocks.0.fc", "blocks.1.fc"} <= paths
    assert not any("_checkpoint_wrapped_module" in p for p in paths)
    assert ("blocks.0.fc.weight",) in stored(w.store_path, "SELECT path FROM params")
    measured = {p for (p,) in stored(w.store_path, "SELECT DISTINCT m.path FROM module_stats JOIN modules m "
                                                   "USING (rank, module_id)")}
    assert "blocks.0.fc" in measured


def _fsdp2_worker(rank: int, world: int, init_file: str, run_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    import probes
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = Net()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
            for _ in range(4):
                loss = F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 2, (8,)))
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)
            assert not w.probe_errors, w.probe_errors
            assert w.findings() == [], [str(f) for f in w.findings()]
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_model_is_watched_with_its_own_names(tmp_path):
    run_dir = tmp_path / "fsdp"
    mp.spawn(_fsdp2_worker, args=(2, str(tmp_path / "rendezvous"), str(run_dir)), nprocs=2, join=True)
    stores = sorted(run_dir.glob("modscope-*.sqlite"))
    assert len(stores) == 2
    for store in stores:
        # fully_shard() swaps in classes named FSDPNet/FSDPBlock: the tree shows the user's
        assert stored(store, "SELECT path, type FROM modules WHERE path IN ('', 'blocks.0') ORDER BY path") == [
            ("", "Net"), ("blocks.0", "Block")]
        # the global shapes, and the norms of this rank's shard at every sampled step
        assert ("blocks.0.fc.weight", "[16, 16]") in stored(store, "SELECT path, shape FROM params")
        (n, grads, updates, fingerprints), = stored(
            store, "SELECT COUNT(*), COUNT(grad_norm), COUNT(update_norm), COUNT(fingerprint) FROM param_stats")
        assert n == grads == updates == 6 * 4 and fingerprints == 0   # shards differ by design: no fingerprint


def test_watching_the_wrapper_or_the_model_gives_the_same_tree(run_dir):
    model = zoo.MLP(din=8, hidden=8, dout=2, depth=1)
    compiled = torch.compile(model, backend="eager")
    with probes.watch(compiled, run_dir=run_dir / "a") as a:
        pass
    with probes.watch(model, run_dir=run_dir / "b") as b:
        pass
    q = "SELECT path, type, kind FROM modules ORDER BY path"
    assert stored(a.store_path, q) == stored(b.store_path, q)
    assert stored(a.store_path, "SELECT model_class FROM ranks") == [(f"{zoo.__name__}.MLP",)]


class _Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class _Blocks(nn.Module):
    """Blocks compiled one by one (as FSDP2 users do), two levels below the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Residual(16) for _ in range(2))
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _dynamo_run(watch: bool, how: str, steps: int, run_dir, every: int = 2, compiled_loss: bool = False):
    """``how``: "wrapper" (torch.compile(model)), "in_place" (model.compile()), "blocks" (each block
    compiled in place, two levels down) or "method" (model.forward = torch.compile(model.forward))."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model: nn.Module = _Blocks() if how == "blocks" else zoo.MLP(din=8, hidden=16, dout=2, depth=2)
    called = model
    if how == "wrapper":
        called = torch.compile(model, backend="eager")
    elif how == "in_place":
        model.compile(backend="eager")
    elif how == "blocks":
        for block in model.blocks:
            block.compile(backend="eager")
    elif how == "method":
        model.forward = torch.compile(model.forward, backend="eager")
    loss_fn = torch.compile(F.cross_entropy, backend="eager") if compiled_loss else F.cross_entropy
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = probes.watch(called, opt, run_dir=run_dir, every=every) if watch else None
    losses = train(called, opt, w, steps, lambda: (torch.randn(8, 8), torch.randint(0, 2, (8,))), loss_fn)
    found = []
    if w is not None:
        found = w.findings()
        assert not w.probe_errors, w.probe_errors
        w.close()
    stats = {k: dict(counters[k]) for k in ("frames", "stats", "graph_break", "recompiles")}
    return stats, losses, found


def test_a_watched_compiled_model_stays_compiled(tmp_path):
    """Every other step is sampled (eagerly); the compiled graph is captured once, like without modscope, and
    never broken nor recompiled over a hundred steps."""
    bare, bare_losses, _ = _dynamo_run(False, "wrapper", 100, None)
    watched, watched_losses, found = _dynamo_run(True, "wrapper", 100, tmp_path / "run")
    assert bare["stats"]["unique_graphs"] == 1 and bare["frames"] == {"total": 1, "ok": 1}
    assert watched == bare                               # one graph, one frame, no break, no recompile
    assert found == []
    assert all(torch.equal(a, b) for a, b in zip(bare_losses, watched_losses, strict=True))


@pytest.mark.parametrize("how", ["in_place", "blocks", "method"])
def test_a_model_compiled_in_place_stays_compiled(tmp_path, how):
    bare, bare_losses, _ = _dynamo_run(False, how, 40, None)
    watched, watched_losses, found = _dynamo_run(True, how, 40, tmp_path / "run")
    assert bare["stats"]["unique_graphs"] >= 1
    # the same graphs, never broken nor recompiled (compiled in place, the root's own sentinel hooks are
    # frames of their own for dynamo: more frames, no graph)
    assert watched["stats"] == bare["stats"] and not watched["recompiles"] and not watched["graph_break"]
    assert found == []
    assert all(torch.equal(a, b) for a, b in zip(bare_losses, watched_losses, strict=True))


@pytest.mark.parametrize(("how", "every"), [("in_place", 2), ("method", 2), ("method", 1)])
def test_a_model_compiled_in_place_stays_compiled_across_rebuilds_of_the_index(tmp_path, monkeypatch, how, every):
    """The model index is rebuilt at the end of a sampled step, while that step's compiled calls are swapped
    out: they must still be known as compiled for the next sampled step (never traced with our hooks)."""
    import probes.watcher
    monkeypatch.setattr(probes.watcher, "REBUILD_EVERY", 1)       # a rebuild at every sample
    bare, _, _ = _dynamo_run(False, how, 12, None)
    watched, _, _ = _dynamo_run(True, how, 12, tmp_path / "run", every=every)
    assert not watched["recompiles"] and not watched["graph_break"]
    if every == 2:
        assert watched["stats"] == bare["stats"]
    else:
        assert not watched["stats"]            # every step sampled: the model never runs its compiled code


def test_only_the_watched_model_runs_eagerly_on_sampled_steps(tmp_path):
    """Every step sampled: the watched model always runs eagerly, but the compiled loss called between its
    forward and the next step (while the next sampled step is armed) is compiled as without modscope."""
    bare, _, _ = _dynamo_run(False, "none", 20, None, compiled_loss=True)
    watched, _, _ = _dynamo_run(True, "wrapper", 20, tmp_path / "run", every=1, compiled_loss=True)
    assert bare["frames"] == {"total": 1, "ok": 1} and bare["stats"]["unique_graphs"] == 1
    assert watched == bare                    # the loss's graph, and none of the watched model's


def _compiled_function_run(watch: bool, steps: int, run_dir, compiled: str, every: int = 2):
    """The model itself is not compiled; a compiled function calls it: the train step's loss (``compiled``:
    "train") or, between eager training steps, an evaluation under no_grad in eval mode ("eval")."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="eager")
    def loss_of(x, y):
        return F.cross_entropy(model(x), y)
    w = probes.watch(model, opt, run_dir=run_dir, every=every) if watch else None
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
        loss = loss_of(x, y) if compiled == "train" else F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if w is not None:
            w.step(loss)
        losses.append(loss.detach())
        if compiled == "eval":
            model.eval()
            with torch.no_grad():
                losses.append(loss_of(x, y))
            model.train()
    if w is not None:
        assert not w.probe_errors and w.findings() == [], (w.probe_errors, w.findings())
        w.close()
    stats = {k: dict(counters[k]) for k in ("frames", "stats", "graph_break", "recompiles")}
    return stats, losses, w


@pytest.mark.parametrize("compiled", ["train", "eval"])
def test_a_compiled_function_calling_the_watched_model_keeps_its_graph(tmp_path, compiled):
    """Dynamo traces through the model and its hooks (Lightning compiles training_step and validation_step
    so). Ours return at once while traced: no graph break (their timing would be one), no module of dynamo's
    taken for one of the model's. A sampled step whose forward ran only as compiled code (its hooks never ran
    eagerly) teaches the watcher to run all compiled code eagerly on the sampled steps after it, which are
    measured."""
    bare, bare_losses, _ = _compiled_function_run(False, 12, None, compiled)
    watched, watched_losses, w = _compiled_function_run(True, 12, tmp_path / "run", compiled)
    assert not bare["graph_break"] and not watched["graph_break"]
    assert all(torch.equal(a, b) for a, b in zip(bare_losses, watched_losses, strict=True))
    assert stored(w.store_path, "SELECT COUNT(*) FROM modules WHERE kind = 'runtime'") == [(0,)]
    measured = [s for s, in stored(w.store_path, "SELECT DISTINCT step FROM module_stats ORDER BY step")]
    # one graph more at most, over six sampled steps: the compiled code traced once while a sampled step was armed
    # (its trigger hooks on the model), kept in dynamo's cache, never traced again
    assert watched["stats"]["unique_graphs"] <= bare["stats"]["unique_graphs"] + 1
    assert measured == ([0, 2, 4, 6, 8, 10] if compiled == "eval" else [2, 4, 6, 8, 10])


def test_two_watched_compiled_models_leave_no_eager_stance_behind(tmp_path):
    """A GAN-like pair, each watched (interleaved sampled steps); after both close, a fresh compiled function
    compiles: no stance was left forcing eager execution."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    nets = [zoo.MLP(din=8, hidden=8, dout=2, depth=1) for _ in range(2)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    called = [torch.compile(n, backend="eager") for n in nets]
    watchers = [probes.watch(c, o, run_dir=tmp_path / f"r{i}", every=e)
                for i, (c, o, e) in enumerate(zip(called, opts, (1, 3), strict=True))]
    for _ in range(7):
        for c, o, w in zip(called, opts, watchers, strict=True):
            loss = c(torch.randn(4, 8)).sum()
            o.zero_grad()
            loss.backward()
            o.step()
            w.step(loss)
    for w in watchers:
        assert not w.probe_errors, w.probe_errors
        w.close()
    frames = counters["frames"].get("ok", 0)
    assert frames >= 1                  # the second net's unsampled steps ran compiled
    torch.compile(lambda t: t * 2 + 1, backend="eager")(torch.ones(3))
    assert counters["frames"]["ok"] == frames + 1


def test_a_compiled_model_called_twice_in_a_sampled_step_shows_no_warning_about_our_hooks(tmp_path):
    """torch warns when torch.compile(module) is called while global module hooks exist; ours exist only
    during a sampled step and skip the wrapper, so that warning is hidden then, and the filters restored."""
    import warnings
    model = zoo.MLP(din=8, hidden=8, dout=2, depth=1)
    called = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        w = probes.watch(called, opt, run_dir=tmp_path / "run", every=1)
        for _ in range(3):
            for _micro in range(2):              # gradient accumulation: two forwards per sampled step
                F.cross_entropy(called(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
            opt.step()
            opt.zero_grad()
            w.step()
        w.close()
        assert warnings.filters == before
        # the user's own global hook still gets torch's warning
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        called(torch.randn(4, 8))
        handle.remove()
    messages = [str(c.message) for c in caught]
    assert sum("global hooks" in m for m in messages) == 1, messages
    assert not w.probe_errors
