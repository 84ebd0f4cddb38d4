"""Two DDP ranks (gloo, CPU) watch their model into one run directory: one store per rank, one run."""
import sqlite3
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def _worker(rank: int, world: int, init_file: str, run_dir: str) -> None:
    sys.path[:0] = [str(HERE.parents[1]), str(HERE)]
    import probes
    import zoo
    # rendezvous through a file: no TCP port to race other tests for
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(zoo.XORClassifier())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        X, y = zoo.xor_data(128, seed=rank)
        with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
            for _ in range(5):
                loss = F.cross_entropy(model(X), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                w.step(loss)
    finally:
        dist.destroy_process_group()


def test_two_ranks_write_one_run_with_a_store_each(tmp_path):
    from probes.schema import parse_store_filename
    run_dir = tmp_path / "ddp"
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(run_dir)), nprocs=2, join=True)
    stores = sorted(run_dir.glob("modscope-*.sqlite"))
    names = [parse_store_filename(p.name) for p in stores]
    assert [n.rank for n in names] == [0, 1] and names[0].run_id == names[1].run_id   # one run, agreed
    for rank, store in enumerate(stores):
        con = sqlite3.connect(store)
        assert con.execute("SELECT rank, world_size, status FROM ranks").fetchall() == [(rank, 2, "closed")]
        assert con.execute("SELECT rank, COUNT(*) FROM steps GROUP BY rank").fetchall() == [(rank, 5)]
        for table in ("modules", "params", "module_stats", "param_stats", "findings"):
            assert {r[0] for r in con.execute(f"SELECT DISTINCT rank FROM {table}")} == {rank}, table
        paths = {r[0] for r in con.execute(
            "SELECT path FROM findings WHERE code='unregistered-module' AND active=1")}
        assert paths == {"module.encoder.blocks[0]", "module.encoder.blocks[1]", "module.encoder.blocks[2]"}
        con.close()
    assert not list(run_dir.glob("*.lock"))            # both writers let go of their locks



def test_a_rank_waits_while_another_rank_creates_the_store(tmp_path):
    """Ranks start together: one is creating the file while the next switches it to WAL, which
    SQLite refuses at once (SQLITE_BUSY, no busy wait). The writer must retry, not fail."""
    sys.path[:0] = [str(HERE.parents[1])]
    import threading
    import time

    from probes.store import StoreWriter
    path = tmp_path / "s.sqlite"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")                  # the other rank, mid-creation (a write lock)
    holder.execute("CREATE TABLE placeholder (x)")
    threading.Timer(0.5, lambda: holder.execute("COMMIT")).start()
    t0 = time.monotonic()
    writer = StoreWriter(path)
    writer.close()
    assert time.monotonic() - t0 >= 0.4                 # it waited for the lock ...
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"   # ... and then set the store up
    assert con.execute("SELECT COUNT(*) FROM sqlite_master WHERE name='steps'").fetchone()[0] == 1
    holder.close()
