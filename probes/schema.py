"""The run store's schema: the only contract between ``probes`` (the writer) and ``dashboard`` (the reader).

Everything both sides agree on lives here and nowhere else: the DDL and its version, the file names, the
tables, the finding codes (severities, badge labels, fixes), the closed sets of values, the path grammar,
the snapshot, the writer's status file and the sampling options of both command lines. Standard library
only (never torch): the dashboard imports it on machines without torch. Versioned with ``PRAGMA
user_version``: readers refuse a newer store and read every older one (later columns read as NULL).
Every row carries ``rank``. docs/schema.md says what the tables mean.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import re
import sqlite3
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .store_copy import Column, SchemaAudit

from ._compat import StrEnum
from .paths import (
    ROOT_DISPLAY,
    attr_path,
    display_path,
    item_path,
    key_path,
    member_path,
    module_path_candidates,
    normalize_path,
    printable,
    runtime_label,
)
from .state_dict_keys import KeyPrefix, key_prefix
from .writer_status import (
    STATUS_BYTES,
    STATUS_SUFFIX,
    WriterState,
    WriterStatus,
    encode_status,
    read_status,
    status_path,
)

__all__ = ["ADDED_COLUMNS", "ADDED_TABLES", "CODES", "DDL", "EVENT_CODES", "HIST_BINS", "HIST_EDGES",
           "LEGACY_STORE_FILENAME", "MAX_VALUE_BYTES", "MIN_READ_VERSION", "ROOT_DISPLAY", "SCHEMA_VERSION",
           "SEVERITY_ORDER", "STATUS_BYTES", "STATUS_SUFFIX", "TABLES", "CodeInfo", "FindingCode", "KeyPrefix",
           "ModuleKind", "RunStatus", "Severity", "StoreName", "StrEnum", "TensorKind", "UntrustedStoreError",
           "WriterState", "WriterStatus", "attr_path", "code_label", "contract_columns", "count_text", "decode_hist",
           "display_path", "encode_hist", "encode_status", "every_option", "guard_reads", "item_path", "key_path",
           "key_prefix", "member_path", "module_path_candidates", "normalize_path", "overhead_option",
           "parse_store_filename", "printable", "read_status", "runtime_label", "snapshot", "status_path",
           "store_filename"]

SCHEMA_VERSION = 5
MIN_READ_VERSION = 1          # the oldest store version readers still open
MAX_VALUE_BYTES = 1_000_000   # the longest string or blob in a store: readers let SQLite build nothing longer

# ---------------------------------------------------------------------------------- file names
# A run directory holds one store per (run, rank): ``modscope-<run_id>-rank<R>.sqlite``, each with a
# single writer. Version 1 wrote every rank of one run into ``modscope.sqlite``; readers still open it.
LEGACY_STORE_FILENAME = "modscope.sqlite"
STORE_PREFIX = "modscope-"
STORE_SUFFIX = ".sqlite"
LOCK_SUFFIX = ".lock"         # <store>.lock: the live writer's pid and host (two writers are refused)
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_STORE_NAME_RE = re.compile(r"^modscope-(?P<run>[A-Za-z0-9][A-Za-z0-9._-]{0,63})-rank(?P<rank>\d{1,6})\.sqlite$")


@dataclass(frozen=True)
class StoreName:
    """What a store's file name says: the run it belongs to and the rank that writes it."""

    run_id: str
    rank: int


def store_filename(run_id: str, rank: int) -> str:
    """The file name of the store of ``rank`` in run ``run_id``."""
    if not RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-64 letters, digits, '.', '_' or '-' (starting with a "
                         "letter or digit)")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    return f"{STORE_PREFIX}{run_id}-rank{rank}{STORE_SUFFIX}"


def parse_store_filename(name: str) -> StoreName | None:
    """The run and rank of a per-rank store file name, or None for any other name."""
    m = _STORE_NAME_RE.match(name)
    return StoreName(m.group("run"), int(m.group("rank"))) if m else None


# ---------------------------------------------------------------------------------- sampling options
# `--every N` and `--overhead F` as both command lines (`modscope run`, `python -m probes.launch.autorun`) read them
_N = TypeVar("_N", int, float)


def _option(text: str, convert: Callable[[str], _N], ok: Callable[[_N], bool], expected: str) -> _N:
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
    return value


MAX_EVERY = 1_000_000         # the longest sampling interval (probes/limits.py: watch()'s other limits)


def every_option(text: str) -> int:
    return _option(text, int, lambda v: 1 <= v <= MAX_EVERY, f"an integer from 1 to {MAX_EVERY:,} "
                   "(sample every N-th step)")


def overhead_option(text: str) -> float:
    return _option(text, float, lambda v: 0 < v <= 1, "a fraction in (0, 1], such as 0.01 for 1%")


# ---------------------------------------------------------------------------------- closed sets
class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


SEVERITY_ORDER = MappingProxyType({Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2})


class ModuleKind(StrEnum):
    REGISTERED = "registered"        # in model.modules()
    UNREGISTERED = "unregistered"    # reachable from the model's attributes only
    RUNTIME = "runtime"              # executed during forward, reachable from nowhere


class TensorKind(StrEnum):
    PARAMETER = "parameter"          # a registered parameter
    BUFFER = "buffer"                # a registered buffer
    TENSOR = "tensor"                # an unregistered tensor or Parameter


class RunStatus(StrEnum):
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(frozen=True)
class CodeInfo:
    """A finding code: its default severity, the short label of its badge and what to do about it.

    A *state* finding holds while the evidence shows it (re-evaluated on every sampled step). An *event*
    finding is about something that happened: it stays active, with its count and first/last step, until
    there is evidence of the fix (or to the end of the run)."""

    severity: Severity
    label: str
    fix: str
    event: bool = False


class FindingCode(StrEnum):
    UNREGISTERED_MODULE = "unregistered-module"
    UNREGISTERED_TENSOR = "unregistered-tensor"
    NOT_IN_OPTIMIZER = "not-in-optimizer"
    STALE_OPTIMIZER_PARAM = "stale-optimizer-param"
    FROZEN_PARAMETER = "frozen-parameter"
    DEAD_LAYER = "dead-layer"
    DEAD_UNITS = "dead-units"
    SATURATED = "saturated"
    NOT_UPDATING = "not-updating"
    GRAD_ACCUMULATING = "grad-accumulating"
    TRAINING_MODE_MISMATCH = "training-mode-mismatch"
    TRAIN_MODE_UNDER_NO_GRAD = "train-mode-under-no-grad"
    TRAIN_STEP_IN_EVAL_MODE = "train-step-in-eval-mode"
    EVAL_BUILDS_GRAPH = "eval-builds-graph"
    NON_FINITE = "non-finite"
    FORWARD_BYPASSED = "forward-bypassed"
    NO_GRADIENT = "no-gradient"
    SHARED_PARAMETER = "shared-parameter"
    RANK_DIVERGENCE = "rank-divergence"
    RANK_STRAGGLER = "rank-straggler"
    CHECKPOINT_KEYS = "checkpoint-keys"


_E, _W, _I = Severity.ERROR, Severity.WARNING, Severity.INFO
CODES: MappingProxyType[str, CodeInfo] = MappingProxyType({
    FindingCode.UNREGISTERED_MODULE: CodeInfo(
        _E, "unregistered",
        "Hold sub-modules in nn.ModuleList / nn.ModuleDict / nn.Sequential (or assign them as attributes) "
        "so that parameters(), the optimizer, state_dict(), .to() and eval() see them."),
    FindingCode.UNREGISTERED_TENSOR: CodeInfo(
        _E, "unregistered tensor",
        "Make learned tensors nn.Parameter; register state with register_buffer(name, t) "
        "(persistent=False for constants recomputable from the config)."),
    FindingCode.NOT_IN_OPTIMIZER: CodeInfo(
        _E, "not in optimizer",
        "Build the optimizer after the model is final (after replacing heads or unfreezing), "
        "from model.parameters(), or add the parameter with optimizer.add_param_group()."),
    FindingCode.STALE_OPTIMIZER_PARAM: CodeInfo(
        _W, "stale optimizer param",
        "Rebuild the optimizer after replacing modules, so it holds the parameters the model uses now."),
    FindingCode.FROZEN_PARAMETER: CodeInfo(
        _I, "frozen", "Expected if you froze it on purpose; otherwise call requires_grad_(True)."),
    FindingCode.DEAD_LAYER: CodeInfo(
        _E, "dead",
        "Check initialisation, learning rate and the preceding normalisation; consider LeakyReLU/GELU "
        "or a lower learning rate."),
    FindingCode.DEAD_UNITS: CodeInfo(
        _W, "dead units", "Check initialisation and learning rate; consider LeakyReLU/GELU."),
    FindingCode.SATURATED: CodeInfo(
        _W, "saturated",
        "Normalise the input of the activation (LayerNorm/BatchNorm), lower the learning rate or rescale "
        "the initialisation."),
    FindingCode.NOT_UPDATING: CodeInfo(
        _E, "not updating",
        "Give the tensor to the optimizer (register it: nn.Parameter / nn.ModuleList) and check its "
        "learning rate."),
    FindingCode.GRAD_ACCUMULATING: CodeInfo(
        _W, "grad accumulating",
        "Zero the gradients once per optimizer step: call optimizer.zero_grad() (or model.zero_grad()) after "
        "optimizer.step() (with gradient accumulation, after each optimizer step, not each micro-batch); a "
        "tensor no optimizer holds must be registered and given to it for optimizer.zero_grad() to reach it."),
    FindingCode.TRAINING_MODE_MISMATCH: CodeInfo(
        _E, "mode mismatch",
        "Register the module so model.train()/model.eval() reach it, or set its mode explicitly.", event=True),
    FindingCode.TRAIN_MODE_UNDER_NO_GRAD: CodeInfo(
        _W, "train mode under no_grad",
        "Call model.eval() before validation and model.train() after it; no_grad() does not change "
        "Dropout or BatchNorm behaviour.", event=True),
    FindingCode.TRAIN_STEP_IN_EVAL_MODE: CodeInfo(
        _W, "trained in eval mode",
        "Call model.train() after validation: eval() turns Dropout off and freezes BatchNorm statistics "
        "until train() is called again.", event=True),
    FindingCode.EVAL_BUILDS_GRAPH: CodeInfo(
        _I, "eval builds graph",
        "Wrap evaluation in torch.no_grad() (or torch.inference_mode()): eval() does not stop autograd "
        "from recording the graph.", event=True),
    FindingCode.NON_FINITE: CodeInfo(
        _E, "NaN/Inf",
        "Lower the learning rate, clip gradients, check for log(0)/division by zero, or use a wider dtype.",
        event=True),
    FindingCode.FORWARD_BYPASSED: CodeInfo(
        _W, "forward bypassed",
        "Call the module (module(x)), not module.forward(x): calling forward() skips every hook.", event=True),
    FindingCode.NO_GRADIENT: CodeInfo(
        _W, "no gradient",
        "Find where the graph is cut between this module's output and the loss: a .detach(), .data, .item() or "
        "torch.tensor(...) rebuilt from values, torch.no_grad() inside forward, a reentrant checkpoint "
        "(use_reentrant=True) whose inputs do not require grad (pass use_reentrant=False), or an output the "
        "loss does not use; if it is meant to stay fixed, set requires_grad_(False) and leave it out of the "
        "optimizer.", event=True),
    FindingCode.SHARED_PARAMETER: CodeInfo(
        _I, "shared", "Expected for tied weights; the tensor is stored once in parameters() and updated once."),
    FindingCode.RANK_DIVERGENCE: CodeInfo(
        _E, "ranks diverge",
        "Change replicated state only through the DDP-wrapped model, identically on every rank; use "
        "SyncBatchNorm or broadcast_buffers=True for buffers updated from local data."),
    FindingCode.RANK_STRAGGLER: CodeInfo(
        _W, "straggler",
        "Look for uneven data (sequence lengths, sharding), a slower device or host, or work only this "
        "rank does (logging, checkpointing, evaluation)."),
    FindingCode.CHECKPOINT_KEYS: CodeInfo(
        _E, "checkpoint keys",
        "Load with strict=True (the default), so that a checkpoint that does not fit fails loudly; to load part of "
        "a model on purpose, load it into that part (model.backbone.load_state_dict(sd)); compare a file with the "
        "model first: modscope checkpoint FILE --run DIR.", event=True),
})


EVENT_CODES = frozenset(code for code, info in CODES.items() if info.event)


def count_text(root_causes: Mapping[str, int], consequences: int) -> str:
    """How findings are counted everywhere (the summary of ``modscope run``, ``modscope findings``, the
    Overview, the Findings page, the report): root causes by severity first, then the findings they explain.
    ``{"error": 2, "warning": 1}, 12`` -> ``'3 root causes (2 errors, 1 warning) and 12 consequences'``."""
    total = sum(root_causes.values())
    if not total and not consequences:
        return "no findings"
    parts = [f"{n} {s}{'s' if n != 1 and s != Severity.INFO else ''}"
             for s in (str(v) for v in Severity) if (n := int(root_causes.get(s, 0)))]
    text = f"{total} root cause{'s' if total != 1 else ''}" + (f" ({', '.join(parts)})" if parts else "")
    if consequences:
        text += f" and {consequences} consequence{'s' if consequences != 1 else ''}"
    return text


def code_label(code: str) -> str:
    """The badge label of a finding code (the code itself for a code this version does not know)."""
    info = CODES.get(code)
    return info.label if info is not None else code


# ---------------------------------------------------------------------------------- paths
# the path grammar: probes/paths.py (imported at the top, part of the contract)

# ---------------------------------------------------------------------------------- histograms
# Fixed signed log-spaced edges shared by every sample (a heat map over time needs no re-binning). Bin i
# counts [EDGES[i-1], EDGES[i]); bin 0 is below EDGES[0], the last at or above EDGES[-1]; zeros have their own.
_POS = [1e-6, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]
HIST_EDGES = [-e for e in reversed(_POS)] + _POS
HIST_BINS = len(HIST_EDGES) + 1
ZERO_BIN = HIST_EDGES.index(1e-6)      # the bin [-1e-6, 1e-6)


def encode_hist(counts: Sequence[int]) -> bytes:
    """A histogram as module_stats.hist stores it: HIST_BINS counts, little-endian uint16 (50 bytes;
    a count saturates at 65,535)."""
    a = array.array("H", (min(int(c), 65535) for c in counts))
    return _little_endian(a).tobytes()


def _little_endian(a: array.array[int]) -> array.array[int]:
    if sys.byteorder == "big":
        a.byteswap()
    return a


def decode_hist(value: bytes | str | None) -> list[int] | None:
    """The counts of a stored histogram: the uint16 blob of schema 2 on, or the JSON list of schema 1."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        a = array.array("H")
        a.frombytes(bytes(value))
        return list(_little_endian(a))
    try:
        counts = json.loads(value)
    except (TypeError, ValueError):
        return None
    return [int(c) for c in counts] if isinstance(counts, list) else None


# ---------------------------------------------------------------------------------- tables
DDL = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL                -- JSON
);
CREATE TABLE IF NOT EXISTS ranks (
    rank            INTEGER PRIMARY KEY,
    world_size      INTEGER NOT NULL DEFAULT 1,
    hostname        TEXT,
    pid             INTEGER,
    model_class     TEXT,
    torch_version   TEXT,
    python_version  TEXT,
    device          TEXT,
    sampling        TEXT,              -- JSON: {"every": int|null, "overhead": float|null, "window": int}
    started_at      REAL,              -- unix seconds
    updated_at      REAL,              -- the writer's heartbeat
    closed_at       REAL,
    status          TEXT,              -- RunStatus: 'running' | 'closed' (a killed process stays 'running')
    step            INTEGER,           -- last step seen
    samples_written INTEGER NOT NULL DEFAULT 0,
    samples_dropped INTEGER NOT NULL DEFAULT 0,
    probe_errors    INTEGER NOT NULL DEFAULT 0,
    overhead        REAL,              -- measured probe time / training time (fraction)
    write_errors    INTEGER NOT NULL DEFAULT 0,   -- v2: commits that failed (disk full, I/O error)
    last_error      TEXT,              -- v2: SQLite's message for the last failed commit
    next_sample     INTEGER            -- v5: the step of the next full sample as the schedule stands (NULL: unknown)
);
CREATE TABLE IF NOT EXISTS modules (
    rank                INTEGER NOT NULL,
    module_id           INTEGER NOT NULL,
    path                TEXT NOT NULL,     -- '' root; 'encoder.blocks[0]' unregistered; 'encoder.<unreachable Linear>'
    parent_id           INTEGER,           -- NULL for the root
    name                TEXT NOT NULL,     -- label under its parent: 'head', '0', 'blocks[0]'
    type                TEXT NOT NULL,     -- class name
    type_module         TEXT,              -- class's python module
    kind                TEXT NOT NULL,     -- ModuleKind
    depth               INTEGER NOT NULL,
    n_children          INTEGER NOT NULL DEFAULT 0,
    params_total        INTEGER NOT NULL DEFAULT 0,   -- numbers in the subtree (each tensor once)
    params_trainable    INTEGER NOT NULL DEFAULT 0,   -- of which requires_grad
    params_in_optimizer INTEGER NOT NULL DEFAULT 0,   -- of which held by a watched optimizer
    first_step          INTEGER,
    removed_step        INTEGER,           -- v4: the step of the first index build it was no longer part of the
                                           -- model at (NULL: current); a new module at its path has a new id
    PRIMARY KEY (rank, module_id)
);
CREATE INDEX IF NOT EXISTS modules_by_parent ON modules(rank, parent_id);
CREATE INDEX IF NOT EXISTS modules_by_path ON modules(rank, path);
CREATE TABLE IF NOT EXISTS params (
    rank          INTEGER NOT NULL,
    param_id      INTEGER NOT NULL,
    path          TEXT NOT NULL,     -- 'encoder.blocks.0.weight' registered; 'encoder.blocks[0].weight' / 'gate'
    module_id     INTEGER,           -- owning module (NULL if unknown)
    name          TEXT NOT NULL,     -- attribute name on its module
    shape         TEXT,              -- JSON list, NULL when uninitialised (lazy)
    numel         INTEGER NOT NULL DEFAULT 0,
    dtype         TEXT,
    device        TEXT,
    kind          TEXT NOT NULL,     -- TensorKind
    requires_grad INTEGER NOT NULL,
    registered    INTEGER NOT NULL,  -- 1: registered parameter or buffer of the model
    is_parameter  INTEGER NOT NULL,  -- 1: an nn.Parameter object (registered or not)
    in_state_dict INTEGER NOT NULL,  -- 1: model.state_dict() holds it (under path and aliases)
    in_optimizer  INTEGER NOT NULL,  -- 1: held by a watched optimizer's param group
    opt_index     INTEGER,           -- which optimizer (position in the list given to watch)
    opt_group     INTEGER,           -- which param group
    lr            REAL,              -- its group's at the index's build (NULL: a tensor on an accelerator)
    aliases       TEXT,              -- JSON list of other names of the same tensor (tied weights)
    moved         INTEGER,           -- 1 once an update changed it, 0 if observed unchanged, NULL unknown
    removed_step  INTEGER,           -- v4: as modules.removed_step (NULL: current); its owner's new module's
                                     -- tensors have new ids
    close_fingerprint REAL,          -- v5: its fingerprint (as param_stats.fingerprint) when the watcher closed, after
                                     -- the optimizer step of ranks.step: replicas compare it however rarely they
                                     -- sampled (NULL: one process, or not closed)
    close_data_norm   REAL,          -- v5: its data norm then
    PRIMARY KEY (rank, param_id)
);
CREATE INDEX IF NOT EXISTS params_by_module ON params(rank, module_id);
CREATE TABLE IF NOT EXISTS steps (
    rank      INTEGER NOT NULL,
    step      INTEGER NOT NULL,
    wall_time REAL NOT NULL,         -- unix seconds at the end of the step
    loss      REAL,
    step_ms   REAL,                  -- wall time of the step
    probe_ms  REAL,                  -- time spent inside modscope during the step
    sampled   INTEGER NOT NULL,      -- 1 when module/param statistics were taken
    compute_ms REAL,                 -- v5: this rank's own time of the step: step_ms less the time its backward
                                     -- waited for the other ranks' gradients and the optimizer step's own time
                                     -- (closure calls in it count); NULL: one process
    PRIMARY KEY (rank, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS module_stats (
    rank          INTEGER NOT NULL,
    module_id     INTEGER NOT NULL,
    step          INTEGER NOT NULL,
    calls         INTEGER NOT NULL,  -- calls in this step (statistics aggregate the measured calls)
    numel         INTEGER,
    mean          REAL,
    std           REAL,
    absmax        REAL,
    zero_frac     REAL,              -- fraction of |x| < 1e-6 in the histogram sample
    dead_frac     REAL,              -- fraction of units with no non-zero value over the window
    sat_frac      REAL,              -- fraction of values in saturated tails (tanh/sigmoid-like only)
    nonfinite     INTEGER,           -- NaN/Inf count in the output(s)
    out_grad_norm REAL,              -- L2 norm of d(loss)/d(output), when backward ran
    training      INTEGER,           -- module.training at call time
    grad_enabled  INTEGER,           -- torch.is_grad_enabled() at call time
    hist          BLOB,              -- HIST_BINS counts, little-endian uint16 (schema 1: a JSON list); see decode_hist
    PRIMARY KEY (rank, module_id, step)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS module_stats_by_step ON module_stats(rank, step);
CREATE TABLE IF NOT EXISTS param_stats (
    rank            INTEGER NOT NULL,
    param_id        INTEGER NOT NULL,
    step            INTEGER NOT NULL,
    grad_norm       REAL,            -- at the optimizer step (after any all-reduce); NULL when .grad is None
    data_norm       REAL,
    update_norm     REAL,            -- ||w_after - w_before|| across the optimizer step
    update_ratio    REAL,            -- update_norm / data_norm
    local_grad_norm REAL,            -- v2: this rank's own gradient as backward produced it (before all-reduce)
    fingerprint     REAL,            -- v2: sum of a few fixed strided values (replicas must agree on it)
    lr              REAL,            -- v3: its param group's learning rate at this optimizer step (schedulers
                                     -- change it; params.lr is the one at the index's build); NULL: no optimizer
    PRIMARY KEY (rank, param_id, step)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS param_stats_by_step ON param_stats(rank, step);
CREATE TABLE IF NOT EXISTS param_series (
    -- v5: the dense tier. Cheap per-tensor norms taken on steps that are not full samples (one fused device
    -- reduction per step, read back with the next full sample, a copy of their own, or at close). A full
    -- sample's own values are in param_stats at its step: a parameter's series is the union of both.
    rank      INTEGER NOT NULL,
    param_id  INTEGER NOT NULL,
    step      INTEGER NOT NULL,
    grad_norm REAL,                  -- at the optimizer step, unscaled, as param_stats.grad_norm; NULL: no .grad
    data_norm REAL,                  -- the weight's norm at the optimizer step (before it), as param_stats.data_norm
    PRIMARY KEY (rank, param_id, step)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS param_series_by_step ON param_series(rank, step);
CREATE TABLE IF NOT EXISTS findings (
    rank       INTEGER NOT NULL,
    code       TEXT NOT NULL,        -- FindingCode
    path       TEXT NOT NULL,
    severity   TEXT NOT NULL,        -- Severity
    module_id  INTEGER,              -- module the finding is drawn on in the tree
    message    TEXT NOT NULL,
    fix        TEXT,
    evidence   TEXT,                 -- JSON object
    first_step INTEGER,
    last_step  INTEGER,
    active     INTEGER NOT NULL,     -- 1 current, 0 resolved
    count      INTEGER NOT NULL DEFAULT 1,   -- v2: sampled steps (or events) in which it was seen
    cause_code TEXT,                 -- v2: the finding that explains this one (NULL: a root cause)
    cause_path TEXT,
    PRIMARY KEY (rank, code, path)
);
CREATE TABLE IF NOT EXISTS probe_errors (
    rank       INTEGER NOT NULL,
    location   TEXT NOT NULL,        -- where in modscope, e.g. 'forward-hook', 'store-write'
    error_type TEXT NOT NULL,
    message    TEXT,
    count      INTEGER NOT NULL,
    first_step INTEGER,
    last_step  INTEGER,
    PRIMARY KEY (rank, location, error_type)
);
"""

TABLES = ("meta", "ranks", "modules", "params", "steps", "module_stats", "param_stats", "param_series", "findings",
          "probe_errors")
# Tables added after version 1: a reader of an older store reads them as empty.
ADDED_TABLES: MappingProxyType[str, int] = MappingProxyType({"param_series": 5})

# Columns added after version 1: readers of an older store read them as NULL (or the default).
ADDED_COLUMNS: MappingProxyType[str, tuple[tuple[str, str], ...]] = MappingProxyType({
    "ranks": (("write_errors", "0"), ("last_error", "NULL"), ("next_sample", "NULL")),
    "modules": (("removed_step", "NULL"),),
    "params": (("removed_step", "NULL"), ("close_fingerprint", "NULL"), ("close_data_norm", "NULL")),
    "steps": (("compute_ms", "NULL"),),
    "param_stats": (("local_grad_norm", "NULL"), ("fingerprint", "NULL"), ("lr", "NULL")),
    "findings": (("count", "1"), ("cause_code", "NULL"), ("cause_path", "NULL")),
})


# ---------------------------------------------------------------------------------- writer health
# the writer's status file: probes/writer_status.py (imported at the top, part of the contract)


# ---------------------------------------------------------------------------------- snapshots
class UntrustedStoreError(ValueError):
    """A store modscope will not read or copy as it is: one line naming the file and the object."""


def snapshot(sources: Sequence[str | os.PathLike[str]], dest: str | os.PathLike[str], *,
             timeout_s: float | None = None) -> Path:
    """The stores of one run as one new file made from ``DDL`` (never a pickle): ``probes/store_copy.py``."""
    from .store_copy import SNAPSHOT_TIMEOUT_S, copy_stores
    return copy_stores(sources, dest, timeout_s=SNAPSHOT_TIMEOUT_S if timeout_s is None else timeout_s)


def guard_reads(conn: sqlite3.Connection, where: object) -> SchemaAudit:
    """Bound a reader's ``conn`` and audit its store's schema (UntrustedStoreError: ``probes/store_copy.py``)."""
    from .store_copy import audit, limit_reads
    limit_reads(conn)
    return audit(conn, where)


def contract_columns() -> Mapping[str, tuple[Column, ...]]:
    """Each table's columns as ``DDL`` declares them (name, type, not null, key, JSON kind)."""
    from .store_copy import contract
    return contract().columns
