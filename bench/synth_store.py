"""Synthetic run stores for the dashboard's scale runs (bench/dashboard_scale.py, the 10,000-module
browser test) and for the states the real writer cannot be made to produce on demand (newer or older
schema versions, two ranks in one file, a stalled or vanished writer, failed commits, hostile strings).

What the real writer (``probes.watch``) writes, read through every query of ``dashboard.read.store``, is
tested in tests/contract. These stores are written with the schema's DDL (``probes.schema``, no
torch). ``demo`` mirrors examples/demo_train.py: the seed's XOR classifier whose encoder keeps its
three Linear blocks in a plain list (``fixed=True`` is the ModuleList version). ``big`` makes a
tree of any size.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import sqlite3
import time
import zlib
from pathlib import Path

from probes import schema

HIST_EDGES = schema.HIST_EDGES
HIST_BINS = schema.HIST_BINS


def _hist(rng: random.Random, scale: float, relu: bool) -> list[int]:
    counts = [0] * HIST_BINS
    for _ in range(200):
        v = rng.gauss(0.0, scale)
        if relu and v < 0:
            v = 0.0
        i = 0
        while i < len(HIST_EDGES) and v >= HIST_EDGES[i]:
            i += 1
        counts[i] += 1
    return counts


class SynthStore:
    """A store being written like probes would write it: WAL mode, one commit per step."""

    def __init__(self, path: Path, *, run_name: str = "synthetic", model_class: str = "Classifier",
                 rank: int = 0, seed: int = 0, run_id: str | None = None, world_size: int = 1,
                 hostname: str | None = None, pid: int = 1, journal: str = "wal", created_at: float | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.world_size = world_size
        self.rng = random.Random(seed)
        self.conn = sqlite3.connect(str(self.path), check_same_thread=False)
        self.conn.execute(f"PRAGMA journal_mode={'WAL' if journal == 'wal' else 'DELETE'}")
        self.conn.executescript(schema.DDL)
        self.conn.execute(f"PRAGMA user_version={schema.SCHEMA_VERSION}")
        now = time.time() if created_at is None else created_at
        hostname = socket.gethostname() if hostname is None else hostname    # pid 1 lives on every host
        meta = {"schema_version": schema.SCHEMA_VERSION, "run_name": run_name, "hist_edges": HIST_EDGES,
                "created_at": now, "world_size": world_size, "journal_mode": journal}
        if run_id is not None:
            meta["run_id"] = run_id
        for k, v in meta.items():
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, json.dumps(v)))
        self.conn.execute(
            "INSERT OR REPLACE INTO ranks (rank, world_size, hostname, pid, model_class, torch_version, "
            "python_version, device, sampling, started_at, updated_at, status, step, samples_written, "
            "samples_dropped, probe_errors, overhead) VALUES (?, ?, ?, ?, ?, '2.13.0', '3.11', 'cpu', "
            "?, ?, ?, 'running', NULL, 0, 0, 0, 0.004)",
            (rank, world_size, hostname, pid, model_class, json.dumps({"every": 1, "overhead": None, "window": 20}),
             now, now))
        self.conn.commit()
        self.modules: list[dict] = []
        self.params: list[dict] = []
        self.step = -1
        self.loss = 0.7
        self.step_ms = 3.0                 # every step's wall time (a straggler's is larger)
        # tensor path -> (first step, offset): from that step on this rank's copy of the tensor differs
        # (its fingerprint and data norm), as an in-place change on one rank makes it
        self.diverge: dict[str, tuple[int, float]] = {}
        # A pool of histogram rows (drawing 200 samples per module per step is slow at 10k modules).
        self._hists = {relu: [json.dumps(_hist(self.rng, 0.2 + 0.1 * i, relu)) for i in range(12)]
                       for relu in (True, False)}

    # -- structure -----------------------------------------------------------------------
    def add_module(self, path: str, parent: int | None, name: str, type_: str, kind: str = "registered",
                   params: int = 0, trainable: int | None = None, in_opt: int | None = None,
                   relu: bool = True) -> int:
        mid = len(self.modules)
        depth = 0 if parent is None else self.modules[parent]["depth"] + 1
        m = {"module_id": mid, "path": path, "parent_id": parent, "name": name, "type": type_,
             "kind": kind, "depth": depth, "params": params, "relu": relu,
             "trainable": params if trainable is None else trainable,
             "in_opt": (params if kind == "registered" else 0) if in_opt is None else in_opt}
        self.modules.append(m)
        self.conn.execute(
            "INSERT INTO modules (rank, module_id, path, parent_id, name, type, type_module, kind, depth, "
            "n_children, params_total, params_trainable, params_in_optimizer, first_step) "
            "VALUES (?, ?, ?, ?, ?, ?, 'user', ?, ?, 0, ?, ?, ?, 0)",
            (self.rank, mid, path, parent, name, type_, kind, depth, params, m["trainable"], m["in_opt"]))
        if parent is not None:
            self.conn.execute("UPDATE modules SET n_children = n_children + 1 WHERE rank = ? "
                              "AND module_id = ?", (self.rank, parent))
        return mid

    def add_param(self, module_id: int, path: str, name: str, shape: list[int], *, kind: str = "parameter",
                  requires_grad: bool = True, in_optimizer: bool = True, in_state_dict: bool | None = None,
                  aliases: list[str] | None = None, moved: int | None = 1) -> int:
        pid = len(self.params)
        numel = math.prod(shape)
        registered = kind in ("parameter", "buffer")
        self.params.append({"param_id": pid, "module_id": module_id, "moved": moved, "path": path,
                            "grads": requires_grad and kind != "buffer"})
        self.conn.execute(
            "INSERT INTO params (rank, param_id, path, module_id, name, shape, numel, dtype, device, kind, "
            "requires_grad, registered, is_parameter, in_state_dict, in_optimizer, opt_index, opt_group, lr, "
            "aliases, moved) VALUES (?, ?, ?, ?, ?, ?, ?, 'float32', 'cpu', ?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?)",
            (self.rank, pid, path, module_id, name, json.dumps(shape), numel, kind, int(requires_grad),
             int(registered), int(registered if in_state_dict is None else in_state_dict), int(in_optimizer),
             0 if in_optimizer else None, 0 if in_optimizer else None, 0.01 if in_optimizer else None,
             json.dumps(aliases or []), moved))
        return pid

    def add_finding(self, code: str, path: str, severity: str, module_id: int | None, message: str,
                    fix: str = "", evidence: dict | None = None, active: int = 1, *, count: int = 1,
                    cause: tuple[str, str] | None = None, first_step: int = 0, last_step: int | None = None) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO findings (rank, code, path, severity, module_id, message, fix, evidence, "
            "first_step, last_step, active, count, cause_code, cause_path) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (self.rank, code, path, severity, module_id, message, fix, json.dumps(evidence or {}), first_step,
             max(self.step, 0) if last_step is None else last_step, active, count, *(cause or (None, None))))
        self.conn.commit()

    def set_rank(self, **columns: object) -> None:
        """Overwrite columns of this rank's ``ranks`` row (heartbeat, pid, host, write errors ...)."""
        sets = ", ".join(f"{c} = ?" for c in columns)
        self.conn.execute(f"UPDATE ranks SET {sets} WHERE rank = ?", (*columns.values(), self.rank))
        self.conn.commit()

    def commit(self) -> None:
        self.conn.commit()

    # -- samples ---------------------------------------------------------------------------
    def add_steps(self, n: int, *, hist: bool = True, modules: list[int] | None = None) -> int:
        mods = self.modules if modules is None else [self.modules[i] for i in modules]
        for _ in range(n):
            self.step += 1
            s = self.step
            self.loss = max(0.02, self.loss * 0.985 + self.rng.uniform(-0.01, 0.01))
            self.conn.execute("INSERT INTO steps (rank, step, wall_time, loss, step_ms, probe_ms, sampled) "
                              "VALUES (?, ?, ?, ?, ?, ?, 1)",
                              (self.rank, s, time.time(), self.loss, self.step_ms, 0.01))
            rows = []
            for m in mods:
                scale = 0.5 + 0.3 * math.sin(s / 15 + m["module_id"])
                dead = 0.0 if not m["relu"] else 0.05 + 0.02 * (m["module_id"] % 3)
                rows.append((self.rank, m["module_id"], s, 1, 64, scale * 0.4, scale, scale * 3, dead,
                             dead, 0.0, 0, 0.01 / (1 + s) ** 0.5, 1, 1,
                             self._hists[m["relu"]][(s + m["module_id"]) % 12] if hist else None))
            self.conn.executemany(
                "INSERT INTO module_stats (rank, module_id, step, calls, numel, mean, std, absmax, zero_frac, "
                "dead_frac, sat_frac, nonfinite, out_grad_norm, training, grad_enabled, hist) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
            prow = [(self.rank, p["param_id"], s, *self.tensor_values(p, s)) for p in self.params]
            self.conn.executemany("INSERT INTO param_stats (rank, param_id, step, grad_norm, data_norm, update_norm, "
                                  "update_ratio, local_grad_norm, fingerprint) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                  prow)
            self.conn.execute("UPDATE ranks SET step = ?, samples_written = samples_written + 1, "
                              "updated_at = ? WHERE rank = ?", (s, time.time(), self.rank))
            self.conn.commit()
        return self.step

    def tensor_values(self, p: dict, s: int) -> tuple:
        """(grad_norm, data_norm, update_norm, update_ratio, local_grad_norm, fingerprint) of a tensor at
        step ``s``: the replicated values (data norm, fingerprint) are the same on every rank unless the
        tensor diverges here; the local gradient norm is this rank's own."""
        base = zlib.crc32(p["path"].encode()) % 1000 / 1000.0
        data_norm = 4.0 + base - 0.001 * s
        fingerprint = base * 3.0 - 1.0 + 0.0005 * s
        div = self.diverge.get(p["path"])
        if div is not None and s >= div[0]:
            data_norm += div[1]
            fingerprint += div[1]
        grads = p.get("grads", True)
        grad = 0.05 * (1 + 0.3 * math.sin(s / 7)) if grads else None
        local = ((0.05 + 0.01 * self.rank) * (1 + 0.3 * math.sin(s / 7))
                 if grads and self.world_size > 1 else None)
        moved = p["moved"] != 0 and grads
        return (grad, data_norm, 0.004 if moved else 0.0, 0.001 if moved else 0.0, local, fingerprint)

    def close(self, status: str = "closed") -> None:
        self.conn.execute("UPDATE ranks SET status = ?, closed_at = ? WHERE rank = ?",
                          (status, time.time(), self.rank))
        self.conn.commit()
        self.conn.close()


UNREG_MSG = ("encoder.blocks[0] (Linear) is reachable through a plain Python list but not registered: "
             "model.parameters(), the optimizer, state_dict() and .to() do not see its 272 parameters.")
UNREG_FIX = "Store the blocks in nn.ModuleList instead of a list."


def demo(path: Path, *, fixed: bool = False, steps: int = 30, live: bool = False,
         model_class: str = "Classifier", run_name: str | None = None) -> SynthStore:
    """The demo classifier (stem, encoder with three blocks, head). Returns the open writer when
    ``live`` (call ``add_steps``/``close``), else closes it."""
    st = SynthStore(path, run_name=run_name or ("demo-fixed" if fixed else "demo"), model_class=model_class)
    width = 16
    root = st.add_module("", None, "", model_class, params=898 if fixed else 82)
    stem = st.add_module("stem", root, "stem", "Linear", params=48)
    st.add_param(stem, "stem.weight", "weight", [width, 2])
    st.add_param(stem, "stem.bias", "bias", [width])
    enc = st.add_module("encoder", root, "encoder", "Encoder", params=816 if fixed else 0)
    blocks = []
    if fixed:
        lst = st.add_module("encoder.blocks", enc, "blocks", "ModuleList", params=816)
        for i in range(3):
            b = st.add_module(f"encoder.blocks.{i}", lst, str(i), "Linear", params=272)
            st.add_param(b, f"encoder.blocks.{i}.weight", "weight", [width, width])
            st.add_param(b, f"encoder.blocks.{i}.bias", "bias", [width])
            blocks.append(b)
    else:
        for i in range(3):
            b = st.add_module(f"encoder.blocks[{i}]", enc, f"blocks[{i}]", "Linear", kind="unregistered",
                              params=272, trainable=272, in_opt=0)
            st.add_param(b, f"encoder.blocks[{i}].weight", "weight", [width, width], kind="tensor",
                         in_optimizer=False, in_state_dict=False, moved=0)
            st.add_param(b, f"encoder.blocks[{i}].bias", "bias", [width], kind="tensor",
                         in_optimizer=False, in_state_dict=False, moved=0)
            blocks.append(b)
    head = st.add_module("head", root, "head", "Linear", params=34, relu=False)
    st.add_param(head, "head.weight", "weight", [2, width])
    st.add_param(head, "head.bias", "bias", [2])
    st.commit()
    if not fixed:
        for i, b in enumerate(blocks):
            st.add_finding("unregistered-module", f"encoder.blocks[{i}]", "error", b,
                           UNREG_MSG.replace("[0]", f"[{i}]"), UNREG_FIX,
                           {"container": "list", "attribute": "blocks", "params": 272})
            st.add_finding("not-updating", f"encoder.blocks[{i}].weight", "error", b,
                           f"encoder.blocks[{i}].weight receives gradients but never changes: no optimizer "
                           "holds it.", UNREG_FIX, {"steps_observed": steps})
    st.add_steps(steps)
    if not live:
        st.close()
    return st


def big(path: Path, *, n_modules: int = 10000, steps: int = 20, fanout: int = 10,
        findings_every: int = 97, hist: bool = True, keep_open: bool = False) -> SynthStore:
    """A tree of ``n_modules`` modules (``fanout`` children per node), findings spread over it."""
    st = SynthStore(path, run_name="big", model_class="BigModel")
    st.add_module("", None, "", "BigModel", params=n_modules * 10)
    queue = [0]
    codes = [("dead-units", "warning"), ("saturated", "warning"), ("frozen-parameter", "info"),
             ("unregistered-module", "error"), ("dead-layer", "error")]
    k = 0
    while len(st.modules) < n_modules and queue:
        parent = queue.pop(0)
        for c in range(fanout):
            if len(st.modules) >= n_modules:
                break
            ppath = st.modules[parent]["path"]
            path = f"{ppath}.layers.{c}" if ppath else f"layers.{c}"
            t = "Block" if len(st.modules) % 2 else "Linear"
            mid = st.add_module(path, parent, f"layers.{c}", t, params=10)
            queue.append(mid)
            if mid % findings_every == 0:
                code, sev = codes[k % len(codes)]
                k += 1
                st.add_finding(code, path, sev, mid, f"{path}: synthetic {code}", "synthetic fix")
    st.commit()
    if steps:
        st.add_steps(steps, hist=hist)
    if not keep_open:
        st.close()
    return st


def many_findings(path: Path, n: int) -> Path:
    """A tree of ``n + 1`` modules with an active finding on each but the root (errors and warnings by turns)."""
    st = big(path, n_modules=n + 1, steps=2, fanout=50, findings_every=10**9, keep_open=True)
    st.conn.executemany(
        "INSERT INTO findings (rank, code, path, severity, module_id, message, fix, evidence, first_step, last_step, "
        "active, count) VALUES (0, ?, ?, ?, ?, 'synthetic', 'fix', '{}', 0, 1, 1, 1)",
        [("dead-units" if m["module_id"] % 2 else "unregistered-module", m["path"],
          "warning" if m["module_id"] % 2 else "error", m["module_id"]) for m in st.modules[1:n + 1]])
    st.conn.commit()
    st.close()
    return path


def two_ranks(path: Path) -> Path:
    """Rank 0: the demo; rank 1: a different tiny tree (two DDP ranks sharing one store)."""
    demo(path, steps=6)
    b = SynthStore(path, rank=1, model_class="Classifier")
    root = b.add_module("", None, "", "Classifier", params=10)
    b.add_module("only_on_rank1", root, "only_on_rank1", "Linear", params=10)
    b.commit()
    b.add_steps(3)
    b.conn.execute("UPDATE ranks SET world_size = 2")
    b.close()
    return path


def as_version_1(path: Path) -> Path:
    """Make the (closed) store at ``path`` a schema-version-1 store: without the columns version 2
    added (``schema.ADDED_COLUMNS``), ``PRAGMA user_version = 1``."""
    conn = sqlite3.connect(str(path))
    try:
        for table, columns in schema.ADDED_COLUMNS.items():
            for column, _default in columns:
                conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        conn.execute("PRAGMA user_version = 1")
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', '1')")
        conn.commit()
    finally:
        conn.close()
    return path


# -- distributed jobs: one store per rank ---------------------------------------------------------------------
def demo_model(st: SynthStore, *, buffers: bool = True) -> dict[str, int]:
    """The demo classifier's registered version (stem, encoder.blocks.0-2, head) with a BatchNorm-like
    buffer on the stem: the module ids by path."""
    width = 16
    ids = {"": st.add_module("", None, "", "Classifier", params=898)}
    ids["stem"] = st.add_module("stem", ids[""], "stem", "Linear", params=48)
    st.add_param(ids["stem"], "stem.weight", "weight", [width, 2])
    st.add_param(ids["stem"], "stem.bias", "bias", [width])
    if buffers:
        st.add_param(ids["stem"], "stem.running_mean", "running_mean", [width], kind="buffer", requires_grad=False,
                     in_optimizer=False)
    ids["encoder"] = st.add_module("encoder", ids[""], "encoder", "Encoder", params=816)
    ids["encoder.blocks"] = st.add_module("encoder.blocks", ids["encoder"], "blocks", "ModuleList", params=816)
    for i in range(3):
        path = f"encoder.blocks.{i}"
        ids[path] = st.add_module(path, ids["encoder.blocks"], str(i), "Linear", params=272)
        st.add_param(ids[path], f"{path}.weight", "weight", [width, width])
        st.add_param(ids[path], f"{path}.bias", "bias", [width])
    ids["head"] = st.add_module("head", ids[""], "head", "Linear", params=34, relu=False)
    st.add_param(ids["head"], "head.weight", "weight", [2, width])
    st.add_param(ids["head"], "head.bias", "bias", [2])
    st.commit()
    return ids


def rank_run(run_dir: Path, run_id: str = "job1", world_size: int = 4, steps: int = 12, *,
             run_name: str = "ddp", diverge: dict[int, dict[str, tuple[int, float]]] | None = None,
             step_ms: dict[int, float] | None = None, hostname: str | None = None, pids: dict[int, int] | None = None,
             close: bool = True, journal: str = "wal", created_at: float | None = None) -> list[SynthStore]:
    """The stores of one distributed run: ``modscope-<run_id>-rank<R>.sqlite`` for every rank, each
    written like its own writer would (every rank samples the same steps). ``diverge[rank][path] =
    (step, offset)``: that rank's copy of the tensor differs from that step on; ``step_ms[rank]``: that
    rank's step time (3 ms otherwise). Returns the writers (open unless ``close``)."""
    run_dir = Path(run_dir)
    out = []
    for rank in range(world_size):
        st = SynthStore(run_dir / schema.store_filename(run_id, rank), run_name=run_name, rank=rank, seed=rank,
                        run_id=run_id, world_size=world_size, hostname=hostname,
                        pid=(pids or {}).get(rank, 1), journal=journal, created_at=created_at)
        demo_model(st)
        st.diverge = dict((diverge or {}).get(rank, {}))
        st.step_ms = (step_ms or {}).get(rank, 3.0)
        st.add_steps(steps)
        if close:
            st.close()
        out.append(st)
    return out


def several_runs(run_dir: Path, run_ids: tuple[str, ...] = ("aaa", "bbb"), world_size: int = 2,
                 steps: int = 5) -> dict[str, list[Path]]:
    """Runs written one after the other into one directory (each ``watch()`` is a run of its own): the
    last is the newest (its files have the largest modification time). Run k is named ``train-k``
    and has ``steps + k`` steps."""
    out = {}
    t0 = time.time() - 100 * len(run_ids)
    for k, run_id in enumerate(run_ids):
        rank_run(run_dir, run_id, world_size, steps + k, run_name=f"train-{k}", created_at=t0 + 100 * k)
        files = [run_dir / schema.store_filename(run_id, r) for r in range(world_size)]
        for f in files:
            os.utime(f, (t0 + 100 * k, t0 + 100 * k))
        out[run_id] = files
    return out


def three_layers(path: Path, *, steps: int = 41) -> SynthStore:
    """Three Linear layers kept in a plain list: 15 findings, of which 3 root causes
    (unregistered-module at encoder.blocks[i]) each explaining 4 consequences (not-updating and
    grad-accumulating of its weight and bias), seen 12 times between steps 3 and 40."""
    st = demo(path, steps=0, live=True, run_name="three-layers")
    st.conn.execute("DELETE FROM findings")
    st.conn.commit()
    for i in range(3):
        blk = f"encoder.blocks[{i}]"
        mid = next(m["module_id"] for m in st.modules if m["path"] == blk)
        st.add_finding("unregistered-module", blk, "error", mid, UNREG_MSG.replace("[0]", f"[{i}]"), UNREG_FIX,
                       {"container": "list"}, count=12, first_step=3, last_step=40)
        for name in ("weight", "bias"):
            st.add_finding("not-updating", f"{blk}.{name}", "error", mid, f"{blk}.{name} never changes.",
                           UNREG_FIX, count=12, cause=("unregistered-module", blk), first_step=3, last_step=40)
            st.add_finding("grad-accumulating", f"{blk}.{name}", "warning", mid,
                           f"{blk}.{name}.grad is never zeroed.", UNREG_FIX, count=12,
                           cause=("unregistered-module", blk), first_step=3, last_step=40)
    st.add_steps(steps)
    st.close()
    return st
