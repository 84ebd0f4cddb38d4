"""When a watcher closes, the main store file holds the run: the writer checkpoints the write-ahead log into it and
truncates the log, also while a dashboard reads the store (its open connection makes the writer's close not the
last one, which would otherwise leave every row in ``-wal``) and while a reader is inside a read transaction (the
checkpoint waits for it)."""
from __future__ import annotations

import shutil
import sqlite3
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from zoo import XORClassifier, xor_data

import probes
from dashboard.read.store import Store, StoreError

STEPS = 30


def train(run_dir: Path, during: threading.Event | None = None, at_step: int = 5) -> Path:
    torch.manual_seed(0)
    model = XORClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = xor_data(128)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for step in range(STEPS):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
            if step == at_step and during is not None:
                during.set()
                time.sleep(0.2)
        store = Path(w.store_path)
    return store


def rows_in_main_file_alone(store: Path, tmp: Path) -> int:
    """The steps the main file holds without its -wal (copied alone, opened as a file nothing writes)."""
    alone = tmp / "alone.sqlite"
    shutil.copyfile(store, alone)
    con = sqlite3.connect(f"file:{alone}?immutable=1", uri=True)
    try:
        return int(con.execute("SELECT COUNT(*) FROM steps").fetchone()[0])
    finally:
        con.close()


def wal_bytes(store: Path) -> int:
    wal = Path(str(store) + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_the_main_file_holds_the_run_while_a_dashboard_polls_it(tmp_path):
    run_dir = tmp_path / "run"
    started, stop = threading.Event(), threading.Event()
    polls = []

    def dashboard() -> None:
        started.wait(60)
        reader = Store.open_run(run_dir)
        while not stop.is_set():                  # what a page's poll reads, over and over
            try:
                reader.overview(0)
                reader.loss_series(0)
                reader.findings(0)
                polls.append(1)
            except StoreError:
                pass
            time.sleep(0.005)

    t = threading.Thread(target=dashboard)
    t.start()
    try:
        store = train(run_dir, during=started)
        assert polls                               # it read while the run was written, and still reads
        assert wal_bytes(store) == 0
        assert rows_in_main_file_alone(store, tmp_path) == STEPS
    finally:
        stop.set()
        t.join(30)


def test_a_reader_inside_a_read_transaction_is_waited_for(tmp_path):
    """The reader takes a read snapshot at the last step and keeps it for two seconds, across the watcher's close:
    the close ends after the reader let go, with the log in the main file."""
    run_dir = tmp_path / "run"
    started = threading.Event()
    released: list[float] = []

    def hold_a_snapshot() -> None:
        started.wait(60)
        [store] = run_dir.glob("modscope-*.sqlite")
        con = sqlite3.connect(f"file:{store}?mode=ro", uri=True, check_same_thread=False)
        try:
            con.execute("BEGIN")
            con.execute("SELECT COUNT(*) FROM steps").fetchone()
            time.sleep(2.0)
            released.append(time.monotonic())
            con.execute("COMMIT")
        finally:
            con.close()

    t = threading.Thread(target=hold_a_snapshot)
    t.start()
    try:
        store = train(run_dir, during=started, at_step=STEPS - 1)
        closed = time.monotonic()
    finally:
        t.join(30)
    assert released and closed >= released[0]          # the close waited for the reader
    assert wal_bytes(store) == 0
    assert rows_in_main_file_alone(store, tmp_path) == STEPS
