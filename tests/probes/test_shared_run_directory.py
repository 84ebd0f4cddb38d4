"""A run directory other users can write to (a shared job folder): the store's name is predictable
(``MODSCOPE_RUN_ID``, torchrun), so another user can plant a symbolic link at the store, ``<store>.status`` or
``<store>.lock`` (or a named pipe, or a hard link) before the training starts, or at a snapshot's temporary
``<file>.partial``. modscope never follows one, never
writes into what it did not create, never removes it, and says so in one line; the link's target is unchanged."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes
from probes import store_copy
from probes.schema import LOCK_SUFFIX, STATUS_SUFFIX, UntrustedStoreError, read_status, store_filename
from probes.store.rundir import RunDirError
from probes.store.writer import StoreError, StoreWriter

REPO = Path(__file__).resolve().parents[2]
PRECIOUS = b"the user's own file: must never change\n"


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """A run directory, the store's predictable name in it, and a file of the user's elsewhere."""
    run_id = f"shared-job-{uuid.uuid4().hex[:8]}"      # each explicit id names one run per process
    monkeypatch.setenv("MODSCOPE_RUN_ID", run_id)
    run_dir = tmp_path / "shared-run"
    run_dir.mkdir()
    victim = tmp_path / "home" / "notes.txt"
    victim.parent.mkdir()
    victim.write_bytes(PRECIOUS)
    return run_dir, run_dir / store_filename(run_id, 0), victim


def train(run_dir: Path, steps: int = 3) -> list[str]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            loss = F.mse_loss(model(torch.randn(16, 4)), torch.zeros(16, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    return [f.code for f in w.findings()]


def refused(run_dir: Path) -> str:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises((StoreError, RunDirError)) as exc:
        probes.watch(model, opt, run_dir=run_dir, every=1)
    assert not model._forward_hooks and not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks
    text = str(exc.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("suffix", ["", STATUS_SUFFIX, LOCK_SUFFIX])
def test_a_link_planted_at_a_run_file_is_not_followed(shared, suffix):
    run_dir, store, victim = shared
    planted = Path(f"{store}{suffix}")
    planted.symlink_to(victim)
    text = refused(run_dir)
    assert str(planted) in text and "a symbolic link" in text and "another run_dir" in text
    assert victim.read_bytes() == PRECIOUS                  # not overwritten
    assert planted.is_symlink() and os.readlink(planted) == str(victim)     # not removed either
    if suffix:
        assert not store.exists()                           # refused before the store was created


def test_a_link_to_a_missing_file_is_not_followed_either(shared, tmp_path):
    """A dangling link would make an ordinary open create its target, wherever it points."""
    run_dir, store, _ = shared
    target = tmp_path / "home" / "created-by-the-link"
    Path(f"{store}{STATUS_SUFFIX}").symlink_to(target)
    assert "a symbolic link" in refused(run_dir)
    assert not target.exists()


def test_a_named_pipe_at_the_lock_is_refused_without_blocking(shared):
    run_dir, store, _ = shared
    os.mkfifo(f"{store}{LOCK_SUFFIX}")
    assert "not a regular file" in refused(run_dir)


def test_a_hard_link_at_the_status_is_not_written_through(shared):
    run_dir, store, victim = shared
    os.link(victim, f"{store}{STATUS_SUFFIX}")
    assert "2 hard links" in refused(run_dir)
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.parametrize("suffix", ["-wal", "-journal"])
def test_links_at_sqlites_own_files_are_not_followed(shared, suffix, monkeypatch):
    """SQLite opens its journal files with O_NOFOLLOW itself."""
    run_dir, store, victim = shared
    monkeypatch.setenv("MODSCOPE_JOURNAL", "wal" if suffix == "-wal" else "delete")
    Path(f"{store}{suffix}").symlink_to(victim)
    try:
        train(run_dir)
    except StoreError as exc:
        assert "\n" not in str(exc)
    assert victim.read_bytes() == PRECIOUS


def test_the_files_it_created_itself_are_used_again(shared):
    """A store, status and lock this user's earlier writer left (a job restarted with the same run id)."""
    run_dir, store, _ = shared
    for _ in range(2):
        writer = StoreWriter(store)
        writer.flush()
        writer.close()
    assert store.stat().st_size > 0 and read_status(store) is not None
    assert "dead-layer" not in train(run_dir)        # the same names again, by a new watch()
    Path(f"{store}{LOCK_SUFFIX}").write_text("not json")  # a lock left half-written by a killed writer: stale
    train(run_dir)


def test_the_dashboard_reads_no_status_through_a_pipe_or_a_link(tmp_path):
    """The reader side: a status that is a named pipe or a link to /dev/zero is no status, at once."""
    store = tmp_path / "modscope-x-rank0.sqlite"
    os.mkfifo(f"{store}{STATUS_SUFFIX}")
    other = tmp_path / "modscope-y-rank0.sqlite"
    Path(f"{other}{STATUS_SUFFIX}").symlink_to("/dev/zero")
    code = ("import sys; from probes.schema import read_status; "
            "print(read_status(sys.argv[1]), read_status(sys.argv[2]))")
    r = subprocess.run([sys.executable, "-c", code, str(store), str(other)], cwd=str(REPO), capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.split() == ["None", "None"], r.stderr


# -- w.snapshot(): its temporary file, beside the snapshot, in a folder others may write to ---------------------------
def watched(run_dir: Path) -> tuple[probes.Watcher, nn.Module]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = probes.watch(model, opt, run_dir=run_dir, every=1)
    for _ in range(3):
        loss = F.mse_loss(model(torch.randn(16, 4)), torch.zeros(16, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w, model


@pytest.mark.parametrize("dangling", [False, True])
def test_a_link_planted_at_the_snapshots_temporary_file_is_not_followed(shared, tmp_path, dangling):
    run_dir, _, victim = shared
    target = tmp_path / "home" / "created-by-the-link" if dangling else victim
    dest = run_dir / "review.sqlite"
    planted = Path(f"{dest}.partial")
    planted.symlink_to(target)
    w, _ = watched(run_dir)
    try:
        with pytest.raises(UntrustedStoreError) as exc:
            w.snapshot(dest)
    finally:
        w.close()
    text = str(exc.value)
    assert "\n" not in text and str(planted) in text and "a symbolic link" in text
    assert not dest.exists()
    assert planted.is_symlink() and os.readlink(planted) == str(target)        # left as it was
    if dangling:
        assert not target.exists()                                              # nothing created through it
    else:
        assert victim.read_bytes() == PRECIOUS


def test_a_temporary_file_a_stopped_snapshot_left_is_replaced(shared):
    run_dir, _, _ = shared
    dest = run_dir / "review.sqlite"
    Path(f"{dest}.partial").write_bytes(b"half a snapshot, its writer killed")
    w, _ = watched(run_dir)
    try:
        assert w.snapshot(dest) == dest
    finally:
        w.close()
    assert not Path(f"{dest}.partial").exists()
    conn = sqlite3.connect(f"file:{dest}?mode=ro", uri=True)
    try:
        assert conn.execute("SELECT COUNT(*) FROM modules").fetchone()[0] == 4
    finally:
        conn.close()


def test_a_link_swapped_in_after_the_temporary_file_was_created_is_refused(shared, monkeypatch):
    """Between modscope's exclusive create and SQLite's open, another user of a folder without the sticky bit can
    replace the new file by a link: SQLite would open the link's target. The file SQLite opened is checked first."""
    run_dir, _, victim = shared
    real = store_copy._create_partial

    def swapped(dest: Path) -> tuple[Path, int]:
        tmp, fd = real(dest)
        os.unlink(tmp)
        tmp.symlink_to(victim)
        return tmp, fd

    monkeypatch.setattr(store_copy, "_create_partial", swapped)
    dest = run_dir / "review.sqlite"
    w, _ = watched(run_dir)
    try:
        with pytest.raises(UntrustedStoreError, match="was replaced while the snapshot opened it"):
            w.snapshot(dest)
    finally:
        w.close()
    assert victim.read_bytes() == PRECIOUS and not dest.exists()
    assert Path(f"{dest}.partial").is_symlink()                 # not its own: not removed
