"""Two DDP ranks (gloo, CPU) watch their model into one run directory: one store per rank, one run."""
import sqlite3
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def _worker(rank: int, world: int, init_file: str, run_dir: str, every: int | None = 1, steps: int = 5) -> None:
    import zoo

    import probes
    # rendezvous through a file: no TCP port to race other tests for
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(zoo.XORClassifier())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        X, y = zoo.xor_data(128, seed=rank)
        with probes.watch(model, opt, run_dir=run_dir, every=every) as w:
            for _ in range(steps):
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
        assert paths == {"encoder.blocks"}                                  # the plain list, no DDP `module.`
        con.close()
    assert not list(run_dir.glob("*.lock"))            # both writers let go of their locks



def test_a_rank_waits_while_another_rank_creates_the_store(tmp_path):
    """Ranks start together: one is creating the file while the next switches it to WAL, which
    SQLite refuses at once (SQLITE_BUSY, no busy wait). The writer must retry, not fail."""
    import threading
    import time

    from probes.store.writer import StoreWriter
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


def test_replicas_carry_fingerprints_and_their_own_gradients(tmp_path):
    run_dir = tmp_path / "ddp"
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(run_dir)), nprocs=2, join=True)
    stats = {}
    for rank, store in enumerate(sorted(run_dir.glob("modscope-*.sqlite"))):
        con = sqlite3.connect(store)
        stats[rank] = {(path, step): (fp, dn, g, lg) for path, step, fp, dn, g, lg in con.execute(
            "SELECT p.path, s.step, s.fingerprint, s.data_norm, s.grad_norm, s.local_grad_norm "
            "FROM param_stats s JOIN params p USING (rank, param_id) WHERE p.kind = 'parameter'")}
        con.close()
    assert stats[0].keys() == stats[1].keys() and len(stats[0]) > 10
    for key, (fp0, dn0, g0, lg0) in stats[0].items():
        fp1, dn1, g1, lg1 = stats[1][key]
        assert fp0 is not None and (fp0, dn0) == (fp1, dn1), key       # replicas: identical, to the bit
        if key[0].startswith(("stem", "head")):                       # registered: DDP averages the gradients
            assert g0 == pytest.approx(g1, rel=1e-5) and lg0 is not None and lg1 is not None
    # each rank trains on its own data: its own gradients differ before the all-reduce
    assert any(v[3] != stats[1][k][3] for k, v in stats[0].items() if k[0].startswith("stem"))


def test_ranks_sample_the_same_steps_under_the_budget(tmp_path):
    run_dir = tmp_path / "ddp"
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(run_dir), None, 60), nprocs=2, join=True)
    sampled = []
    for store in sorted(run_dir.glob("modscope-*.sqlite")):
        con = sqlite3.connect(store)
        sampled.append([r[0] for r in con.execute("SELECT step FROM steps WHERE sampled = 1 ORDER BY step")])
        con.close()
    assert sampled[0] == sampled[1] and sampled[0][:3] == [0, 1, 2] and len(sampled[0]) < 60
