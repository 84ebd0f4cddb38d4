"""Wrappers are transparent: paths are the user's, whatever PyTorch puts around or inside the model.

DDP is covered in test_distributed.py and torch.compile in test_reliability.py. FSDP1
(FullyShardedDataParallel) needs an accelerator in this torch build, so the sharded case here is FSDP2
(``fully_shard``), which runs on the CPU with gloo."""
import sqlite3
from pathlib import Path

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


def _dynamo_run(watch: bool, inplace: bool, steps: int, run_dir):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=2)
    if inplace:
        model.compile(backend="eager")
        called = model
    else:
        called = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = probes.watch(called, opt, run_dir=run_dir, every=2) if watch else None
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
        loss = F.cross_entropy(called(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if w is not None:
            w.step(loss)
        losses.append(loss.detach())
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
    bare, bare_losses, _ = _dynamo_run(False, False, 100, None)
    watched, watched_losses, found = _dynamo_run(True, False, 100, tmp_path / "run")
    assert bare["stats"]["unique_graphs"] == 1 and bare["frames"] == {"total": 1, "ok": 1}
    assert watched == bare                               # one graph, one frame, no break, no recompile
    assert found == []
    assert all(torch.equal(a, b) for a, b in zip(bare_losses, watched_losses, strict=True))


def test_a_model_compiled_in_place_stays_compiled(tmp_path):
    bare, _, _ = _dynamo_run(False, True, 40, None)
    watched, _, _ = _dynamo_run(True, True, 40, tmp_path / "run")
    assert watched["stats"] == bare["stats"] and not watched["recompiles"] and not watched["graph_break"]
