"""The store under bad luck: reused run directories, two writers of one rank, a full disk."""
import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import zoo
from helpers import train

import probes
from probes.schema import WriterState, parse_store_filename, read_status

ROOT = Path(__file__).resolve().parents[2]


def xor_batches(n=64):
    X, y = zoo.xor_data(n)
    return lambda: (X, y)


def stores(run_dir):
    return sorted(run_dir.glob("modscope-*.sqlite"))


def rows(store, sql):
    con = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


# ---------------------------------------------------------------------------------------- runs
def test_every_watch_is_a_run_of_its_own(tmp_path):
    run_dir = tmp_path / "run"
    first = zoo.MLP(din=2, hidden=8, dout=2)
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    with probes.watch(first, opt, run_dir=run_dir, every=1) as w1:
        train(first, opt, w1, 5, xor_batches())
    second = zoo.XORClassifier()                          # another model, the same directory
    opt2 = torch.optim.Adam(second.parameters(), lr=1e-2)
    with probes.watch(second, opt2, run_dir=run_dir, every=1) as w2:
        train(second, opt2, w2, 3, xor_batches())
    assert w1.run_id != w2.run_id and w1.store_path != w2.store_path
    assert {parse_store_filename(p.name).run_id for p in stores(run_dir)} == {w1.run_id, w2.run_id}
    # nothing of the first run is in the second's store, and its steps start again at 0
    assert rows(w2.store_path, "SELECT MIN(step), MAX(step) FROM steps") == [(0, 2)]
    assert rows(w2.store_path, "SELECT type FROM modules WHERE parent_id IS NULL") == [("XORClassifier",)]
    assert rows(w1.store_path, "SELECT type FROM modules WHERE parent_id IS NULL") == [("MLP",)]
    assert rows(w1.store_path, "SELECT MAX(step) FROM steps") == [(4,)]
    assert rows(w1.store_path, "SELECT value FROM meta WHERE key='run_id'") == [(f'"{w1.run_id}"',)]


def test_two_trainings_into_one_directory_at_the_same_time(tmp_path):
    run_dir = tmp_path / "shared"
    cmd = [sys.executable, str(ROOT / "examples" / "demo_train.py"), "--run-dir", str(run_dir), "--steps", "15",
           "--every", "1"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
             for _ in range(2)]
    for p in procs:
        assert p.wait(180) == 0, p.stderr.read().decode()
    found = stores(run_dir)
    assert len(found) == 2 and len({parse_store_filename(p.name).run_id for p in found}) == 2
    for store in found:
        assert rows(store, "SELECT COUNT(*), MIN(step), MAX(step) FROM steps") == [(15, 0, 14)]
        assert rows(store, "SELECT COUNT(DISTINCT pid) FROM ranks") == [(1,)]


def test_a_second_live_writer_of_one_rank_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MODSCOPE_RUN_ID", f"given-{uuid.uuid4().hex[:8]}")
    model = zoo.MLP(din=2, hidden=8, dout=2)
    with probes.watch(model, run_dir=tmp_path) as w:
        # the same run and rank again (here: a second watch() reusing the id in another process's place)
        lock = Path(str(w.store_path) + ".lock")
        assert lock.exists()
        code = ("import os, sys, probes, torch; "
                "probes.watch(torch.nn.Linear(2, 2), run_dir=sys.argv[1])")
        env = dict(os.environ, MODSCOPE_RUN_ID=w.run_id, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                              timeout=120)
        assert proc.returncode != 0
        last = proc.stderr.strip().splitlines()[-1]
        assert f"is already being written by pid {os.getpid()} on " in last and w.run_id in last
    assert not lock.exists()                                  # released at close


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path, monkeypatch):
    import json
    import socket

    from probes.schema import store_filename
    run_id = f"stale-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MODSCOPE_RUN_ID", run_id)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / (store_filename(run_id, 0) + ".lock")
    lock.write_text(json.dumps({"pid": dead.pid, "hostname": socket.gethostname(), "started_at": 0.0}))
    with probes.watch(zoo.MLP(din=2, hidden=8, dout=2), run_dir=tmp_path) as w:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        w.step()
    assert not lock.exists()


# ---------------------------------------------------------------------------------------- a full disk
class FaultySQLite:
    """Makes the writer's statements fail with SQLite's own 'database or disk is full' while on."""

    def __init__(self, monkeypatch):
        from probes.store.writer import StoreWriter
        self.on = False
        original = StoreWriter._execute

        def execute(writer, conn, sql, rows_):
            if self.on:
                raise sqlite3.OperationalError("database or disk is full")
            return original(writer, conn, sql, rows_)
        monkeypatch.setattr(StoreWriter, "_execute", execute)


def _outage_run(run_dir, break_disk, repair_disk):
    """Train the plain-list classifier with the store failing from its very first step (before any
    finding was written), then repaired; returns the watcher after close."""
    model = zoo.XORClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    w = probes.watch(model, opt, run_dir=run_dir, every=1)
    w._writer.flush()                              # identity and tree are in
    break_disk()
    train(model, opt, w, 6, xor_batches())          # findings appear now, while nothing can be written
    w._writer.flush()
    assert w._writer.failing
    status = read_status(w.store_path)
    assert status is not None and status.state == WriterState.FAILING
    assert "disk is full" in status.error and status.failed_commits >= 1
    assert w.samples_dropped > 0
    repair_disk()
    train(model, opt, w, 3, xor_batches())          # nothing new to say: the findings did not change
    w.close()
    assert read_status(w.store_path).state == WriterState.OK
    return w


def _assert_recovered(w):
    store = w.store_path
    (count, message), = rows(store, "SELECT count, message FROM probe_errors WHERE location='store-write'")
    assert count >= 1 and "disk is full" in message
    (write_errors, dropped), = rows(store, "SELECT write_errors, samples_dropped FROM ranks")
    assert write_errors >= 1 and dropped > 0
    active = {r[0] for r in rows(store, "SELECT path FROM findings WHERE code='unregistered-module' AND active=1")}
    assert active == {"encoder.blocks"}
    assert {r[0] for r in rows(store, "SELECT path FROM findings WHERE code='not-updating'")} >= {
        "encoder.blocks[0].weight"}
    assert rows(store, "SELECT status FROM ranks") == [("closed",)]


def test_failed_commits_are_counted_retried_and_rewritten(tmp_path, monkeypatch):
    faulty = FaultySQLite(monkeypatch)
    w = _outage_run(tmp_path / "run", lambda: setattr(faulty, "on", True), lambda: setattr(faulty, "on", False))
    _assert_recovered(w)


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A real filesystem that can fill up: a tmpfs of the given size (needs the right to mount)."""
    mounted = []

    def make(size: str) -> Path:
        where = tmp_path / f"fs-{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); the injected-error test covers it")
        mounted.append(where)
        return where
    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(fs: Path) -> Path:
    filler = fs / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return filler


def test_full_disk_mid_run_on_a_real_filesystem(tiny_filesystem):
    fs = tiny_filesystem("8m")
    holder = {}
    w = _outage_run(fs / "run", lambda: holder.setdefault("filler", _fill(fs)),
                    lambda: holder["filler"].unlink())
    _assert_recovered(w)


def test_full_disk_at_start_is_a_clear_error_and_leaves_no_file(tiny_filesystem):
    fs = tiny_filesystem("16k")
    with pytest.raises(RuntimeError) as info:
        probes.watch(zoo.MLP(din=2, hidden=8, dout=2), run_dir=fs / "run")
    message = str(info.value)
    assert "\n" not in message and "cannot create the store (the disk is full" in message
    assert [p.name for p in (fs / "run").iterdir()] == []


def test_a_version_1_store_written_again_gets_the_columns_added_since(tmp_path, monkeypatch):
    """Reusing a run id on a store of modscope 0.1 (schema 1) upgrades it instead of writing rows its
    tables cannot hold."""
    from probes.schema import ADDED_COLUMNS, store_filename
    run_id = f"old-{uuid.uuid4().hex[:8]}"
    store = tmp_path / store_filename(run_id, 0)
    con = sqlite3.connect(store)
    con.executescript(probes.schema.DDL)
    for table, columns in ADDED_COLUMNS.items():
        for column, _ in columns:
            con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    con.execute("PRAGMA user_version = 1")
    con.commit()
    con.close()
    monkeypatch.setenv("MODSCOPE_RUN_ID", run_id)
    model = zoo.XORClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        train(model, opt, w, 3, xor_batches())
    assert w.store_path == store
    assert rows(store, "PRAGMA user_version") == [(probes.SCHEMA_VERSION,)]
    assert rows(store, "SELECT COUNT(*) FROM findings WHERE cause_code='unregistered-module'")[0][0] > 0
    assert rows(store, "SELECT COUNT(*) FROM param_stats WHERE lr = 1e-2")[0][0] > 0          # version 3
    assert rows(store, "SELECT write_errors FROM ranks") == [(0,)]


# ---------------------------------------------------------------------------------------- many rows
@pytest.mark.parametrize("as_columns", [False, True], ids=["tuples", "columns"])
def test_many_rows_are_written_as_one_statement_per_row_would_write_them(tmp_path, as_columns):
    """The writer inserts large ops several rows per statement (fewer GIL hand-overs with the training
    thread); what it stores equals a statement per row: every row, the last duplicate of a key winning,
    the rows left over after the last full statement, NULLs and BLOBs, and other statements untouched.
    Rows given as columns (records.ColumnRows, what a sampled step hands over) are stored alike."""
    from probes.store import records
    from probes.store.writer import ROWS_PER_STATEMENT, StoreWriter

    n = 3 * ROWS_PER_STATEMENT + 5
    rows = [(0, m, 7, 1, 128, 0.1 * m, None, 0.3, 0.0, None, -1.0, 0, 0.01, 1, 0, bytes([m % 256]) * 50)
            for m in range(n)]
    rows[40] = (0, 3, 7, 2, 64, 9.5, 1.0, 0.3, 0.0, None, -1.0, 0, None, 0, 1, None)     # key of row 3 again
    sql = records.module_stats_op([])[0]
    writer = StoreWriter(tmp_path / "store.sqlite")
    given = records.ColumnRows([list(c) for c in zip(*rows, strict=True)]) if as_columns else rows
    writer.submit([records.module_stats_op(given)])
    writer.flush()
    writer.close()
    reference = sqlite3.connect(":memory:")
    from probes.schema import DDL
    reference.executescript(DDL)
    for row in rows:
        reference.execute(sql, row)
    query = "SELECT * FROM module_stats ORDER BY rank, module_id, step"
    written = sqlite3.connect(tmp_path / "store.sqlite").execute(query).fetchall()
    assert written == reference.execute(query).fetchall()
    assert len(written) == n - 1 and written[3][5] == 9.5


def test_column_rows_are_the_rows_of_their_columns():
    from probes.store.records import ColumnRows

    rows = ColumnRows([[0, 0, 0], [1, 2, 3], ["a", None, b"x"]])
    assert len(rows) == 3 and list(rows) == [(0, 1, "a"), (0, 2, None), (0, 3, b"x")] == list(rows)
    assert rows[1] == (0, 2, None) and rows[-1] == (0, 3, b"x") and rows[1:] == [(0, 2, None), (0, 3, b"x")]
    assert len(ColumnRows([])) == 0 and list(ColumnRows([[], []])) == []
    with pytest.raises(ValueError, match=r"columns of lengths \[2, 3\]: expected columns of one length"):
        ColumnRows([[1, 2, 3], [1, 2]])
