"""The run directory: which run a ``watch()`` is, the file of its rank, the lock that keeps one writer
per (run, rank), and the journal mode its store is written in.

Every ``watch()`` is its own run: its store is ``<run_dir>/modscope-<run_id>-rank<R>.sqlite`` next to
the stores of earlier runs in the same directory, so two runs are never mixed. The ranks of one
distributed job agree on the run id (through torch.distributed's key-value store when the process group
is up, else torchrun's rendezvous id, else ``MODSCOPE_RUN_ID``), so the dashboard reads them as one run.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import NamedTuple

from ..schema import LOCK_SUFFIX, RUN_ID_RE, status_path, store_filename
from . import run_files

RUN_ID_ENV = "MODSCOPE_RUN_ID"            # an explicit run id, the same on every rank (and node) of a job
JOURNAL_ENV = "MODSCOPE_JOURNAL"          # 'wal' or 'delete': override the journal mode chosen below
LOCK_BYTES = 4096                         # a lock is a short JSON object: read no more
AGREE_TIMEOUT_S = 120.0                   # how long a rank waits for rank 0's run id
# Filesystems on which SQLite's WAL mode is unsafe: its shared-memory index (-shm) is not shared between
# hosts (network and cluster filesystems), so a reader on another host could see a torn state.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "cephfs",
    "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "9p", "afs",
    "orangefs", "pvfs2", "wekafs", "fuse.weka",
})
_watch_calls = 0                          # this process's watch() calls: the k-th on every rank agree
_explicit_uses: dict[str, int] = {}       # explicit run id -> watch() calls that used it in this process


class RunDirError(RuntimeError):
    """The run directory cannot be used: one line naming the directory, the run and the reason."""


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """The files of one rank of one run."""

    run_dir: Path
    run_id: str
    rank: int

    @property
    def store(self) -> Path:
        return self.run_dir / store_filename(self.run_id, self.rank)

    @property
    def lock(self) -> Path:
        return Path(str(self.store) + LOCK_SUFFIX)

    @property
    def status(self) -> Path:
        return status_path(self.store)

    def siblings(self) -> list[Path]:
        """The stores of every rank of this run present in the directory (this rank's included)."""
        prefix = store_filename(self.run_id, 0).rsplit("-rank", 1)[0] + "-rank"
        found = [p for p in self.run_dir.glob(prefix + "*.sqlite")
                 if re.fullmatch(re.escape(prefix) + r"\d+\.sqlite", p.name)]
        return sorted(found, key=lambda p: int(p.name[len(prefix):-len(".sqlite")]))


def local_run_id() -> str:
    """A new run id: the start time (sortable) and a random suffix (unique)."""
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def agree_run_id(rank: int, world_size: int) -> str:
    """The run id of this ``watch()``, the same on every rank of a distributed job."""
    global _watch_calls
    _watch_calls += 1
    explicit = os.environ.get(RUN_ID_ENV)
    if explicit:
        if not RUN_ID_RE.match(explicit):
            raise ValueError(f"{RUN_ID_ENV}={explicit!r}: expected 1-64 letters, digits, '.', '_' or '-' "
                             "(starting with a letter or digit)")
        uses = _explicit_uses[explicit] = _explicit_uses.get(explicit, 0) + 1
        return explicit if uses == 1 else f"{explicit}.{uses}"     # a second watch() is a second run
    if world_size <= 1:
        return local_run_id()
    agreed = _agree_through_process_group(rank, _watch_calls)
    if agreed:
        return agreed
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":
        base = re.sub(r"[^A-Za-z0-9._-]", "_", rdzv)[:40].lstrip("._-") or "job"
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        suffix = f"-r{restart}" if restart not in ("", "0") else ""
        return f"{base}{suffix}-w{_watch_calls}"
    # nothing the ranks share: each rank is a run of its own (the dashboard shows them apart)
    return f"{local_run_id()}-rank{rank}"


def _agree_through_process_group(rank: int, call: int) -> str | None:
    """Rank 0 publishes its run id in torch.distributed's key-value store; the others read it. A store
    operation, not a collective: nothing waits on the other ranks' training."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = dist.distributed_c10d._get_default_store()
        key = f"modscope/run_id/{call}"
        if rank == 0:
            run_id = local_run_id()
            store.set(key, run_id)
            return run_id
        deadline = time.monotonic() + AGREE_TIMEOUT_S
        while time.monotonic() < deadline:
            if store.check([key]):
                value = store.get(key).decode()
                return value if RUN_ID_RE.match(value) else None
            time.sleep(0.05)
    except Exception:          # a broken or exotic process group must not stop training
        return None
    return None


# ---------------------------------------------------------------------------------- the writer lock
@dataclasses.dataclass(frozen=True)
class LockOwner:
    pid: int
    hostname: str
    started_at: float


class WriterLock:
    """``<store>.lock``: created exclusively by the one live writer of a (run, rank); names its pid and host.

    A lock left by a dead process on this host is taken over; one held by a live process, or by another
    host (whose processes cannot be checked from here), refuses the second writer."""

    def __init__(self, files: RunFiles) -> None:
        self.files = files
        self.path = files.lock
        self._held = False

    def acquire(self) -> None:
        me = LockOwner(os.getpid(), socket.gethostname(), time.time())
        payload = json.dumps(dataclasses.asdict(me)).encode()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except FileExistsError:
                owner = self._read_owner()      # raises for a name modscope did not create (a link, a pipe)
                if owner is not None and (owner.hostname != me.hostname or _pid_alive(owner.pid)):
                    raise RunDirError(
                        f"{self.files.run_dir}: run {self.files.run_id} rank {self.files.rank} is already being "
                        f"written by pid {owner.pid} on {owner.hostname} (lock {self.path.name}); two writers of "
                        f"one rank are refused: use another {RUN_ID_ENV} or run_dir") from None
                run_files.remove_own(self.path)     # stale: its process is gone (or the lock is unreadable)
                continue
            except OSError as exc:
                raise RunDirError(f"{self.files.run_dir}: cannot create the writer lock "
                                  f"({exc.strerror or exc})") from None
            try:
                os.write(fd, payload)
            finally:
                os.close(fd)
            self._held = True
            return
        raise RunDirError(f"{self.files.run_dir}: cannot take the writer lock {self.path.name} (it keeps reappearing)")

    def release(self) -> None:
        if self._held:
            self._held = False
            try:
                owner = self._read_owner()
                if owner is not None and owner.pid == os.getpid():
                    run_files.remove_own(self.path)
            except (OSError, RunDirError):       # replaced by something that is not the lock: left alone
                pass

    def _read_owner(self) -> LockOwner | None:
        """The lock's owner; None for a lock of this user that cannot be read (a writer killed while writing it).
        A name that is not such a file (a link, a pipe, another user's file) raises RunDirError: it is no lock
        of modscope's, and is neither read nor removed."""
        try:
            raw = run_files.read_own(self.path, LOCK_BYTES)
        except run_files.UnsafeRunFileError as exc:
            raise RunDirError(f"cannot take the writer lock: {exc}") from None
        except OSError:
            return None
        try:
            doc = json.loads(raw)
            return LockOwner(int(doc["pid"]), str(doc["hostname"]), float(doc["started_at"]))
        except (ValueError, KeyError, TypeError):
            return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


# ---------------------------------------------------------------------------------- journal mode
def journal_mode(run_dir: Path) -> str:
    """'wal' where every reader shares this host's memory, else 'delete' (the rollback journal).

    WAL lets the dashboard read while the writer commits, but its index lives in shared memory (-shm),
    which only processes on one host share. On a network or cluster filesystem, or in a job spanning
    several hosts (whose stores share one run directory), the rollback journal is used instead: its
    readers and writer coordinate through file locks, which those filesystems provide."""
    forced = os.environ.get(JOURNAL_ENV, "").strip().lower()
    if forced in ("wal", "delete"):
        return forced
    if forced:
        raise ValueError(f"{JOURNAL_ENV}={forced!r}: expected 'wal' or 'delete'")
    if _multi_node() or filesystem_type(run_dir) in NETWORK_FILESYSTEMS:
        return "delete"
    return "wal"


def _multi_node() -> bool:
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError:
        return False
    return world > local


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (Linux /proc/mounts), or None when unknown."""
    try:
        target = str(path.resolve())
        best, best_type = "", None
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, best_type = mount, parts[2]
        return best_type
    except OSError:
        return None


# ---------------------------------------------------------------------------------- the sampling interval
class Schedule(NamedTuple):
    """What a step is: a full sample at the multiples of ``interval`` (after the first three steps), else a dense
    step at the multiples of ``dense`` (0: the dense tier is off). Rank 0 announces it; ``capture.sampling``
    chooses it."""

    interval: int
    dense: int


class StoreIntervalChannel:
    """Rank 0's sampling schedule (the full sample's and the dense tier's intervals), shared through
    torch.distributed's key-value store (a store operation on sampled steps and during the start only, never a
    collective). Failures are swallowed: a rank that cannot read the announcement keeps its intervals, which
    are still powers of two (its samples nest with the others')."""

    def __init__(self, store: object, key: str) -> None:
        self._store = store
        self._key = key

    def announce(self, from_step: int, schedule: Schedule) -> None:
        try:
            self._store.set(self._key, f"{from_step}:{schedule.interval}:{schedule.dense}")  # type: ignore[attr-defined]
        except Exception:
            pass

    def latest(self) -> tuple[int, Schedule] | None:
        try:
            if not self._store.check([self._key]):  # type: ignore[attr-defined]
                return None
            first, interval, dense = self._store.get(self._key).decode().split(":")  # type: ignore[attr-defined]
            return int(first), Schedule(int(interval), int(dense))
        except Exception:
            return None


def interval_channel(run_id: str, world_size: int) -> StoreIntervalChannel | None:
    if world_size <= 1:
        return None
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return StoreIntervalChannel(dist.distributed_c10d._get_default_store(), f"modscope/{run_id}/interval")
    except Exception:
        return None
