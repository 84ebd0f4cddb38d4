"""The run store's schema: the only contract between ``probes`` and ``dashboard``.

Versioned with ``PRAGMA user_version``. Readers refuse a store whose version is newer
than the one they know. Every row carries ``rank`` (0 when not distributed).
See docs/schema.md for the meaning of every column.
"""

SCHEMA_VERSION = 1
STORE_FILENAME = "modscope.sqlite"

# Activation histogram: fixed, signed log-spaced bin edges shared by every sample, so a
# heat map over time needs no re-binning. Bin i counts values in [EDGES[i-1], EDGES[i]);
# bin 0 is (-inf, EDGES[0]) and the last bin is [EDGES[-1], inf). Exact zeros have a bin
# of their own (between -1e-6 and 1e-6).
_POS = [1e-6, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]
HIST_EDGES = [-e for e in reversed(_POS)] + _POS
HIST_BINS = len(HIST_EDGES) + 1

DDL = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
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
    updated_at      REAL,
    closed_at       REAL,
    status          TEXT,              -- 'running' | 'closed'
    step            INTEGER,           -- last step seen
    samples_written INTEGER NOT NULL DEFAULT 0,
    samples_dropped INTEGER NOT NULL DEFAULT 0,
    probe_errors    INTEGER NOT NULL DEFAULT 0,
    overhead        REAL               -- measured probe time / training time (fraction)
);
CREATE TABLE IF NOT EXISTS modules (
    rank                INTEGER NOT NULL,
    module_id           INTEGER NOT NULL,
    path                TEXT NOT NULL,     -- '' root; 'encoder.blocks[0]' unregistered; 'encoder.<unreachable Linear>' runtime
    parent_id           INTEGER,           -- NULL for the root
    name                TEXT NOT NULL,     -- label under its parent: 'head', '0', 'blocks[0]'
    type                TEXT NOT NULL,     -- class name
    type_module         TEXT,              -- class's python module
    kind                TEXT NOT NULL,     -- 'registered' | 'unregistered' | 'runtime'
    depth               INTEGER NOT NULL,
    n_children          INTEGER NOT NULL DEFAULT 0,
    params_total        INTEGER NOT NULL DEFAULT 0,   -- numbers in the subtree (each tensor once)
    params_trainable    INTEGER NOT NULL DEFAULT 0,   -- of which requires_grad
    params_in_optimizer INTEGER NOT NULL DEFAULT 0,   -- of which held by a watched optimizer
    first_step          INTEGER,
    PRIMARY KEY (rank, module_id)
);
CREATE INDEX IF NOT EXISTS modules_by_parent ON modules(rank, parent_id);
CREATE INDEX IF NOT EXISTS modules_by_path ON modules(rank, path);
CREATE TABLE IF NOT EXISTS params (
    rank          INTEGER NOT NULL,
    param_id      INTEGER NOT NULL,
    path          TEXT NOT NULL,     -- 'encoder.blocks.0.weight' registered; 'encoder.blocks[0].weight' / 'gate' otherwise
    module_id     INTEGER,           -- owning module (NULL if unknown)
    name          TEXT NOT NULL,     -- attribute name on its module
    shape         TEXT,              -- JSON list, NULL when uninitialised (lazy)
    numel         INTEGER NOT NULL DEFAULT 0,
    dtype         TEXT,
    device        TEXT,
    kind          TEXT NOT NULL,     -- 'parameter' (registered) | 'buffer' (registered) | 'tensor' (unregistered tensor/Parameter)
    requires_grad INTEGER NOT NULL,
    registered    INTEGER NOT NULL,  -- 1: registered parameter or buffer of the model
    is_parameter  INTEGER NOT NULL,  -- 1: an nn.Parameter object (registered or not)
    in_state_dict INTEGER NOT NULL,  -- 1: model.state_dict() holds it (under path and aliases)
    in_optimizer  INTEGER NOT NULL,  -- 1: held by a watched optimizer's param group
    opt_index     INTEGER,           -- which optimizer (position in the list given to watch)
    opt_group     INTEGER,           -- which param group
    lr            REAL,
    aliases       TEXT,              -- JSON list of other names of the same tensor (tied weights)
    moved         INTEGER,           -- 1 once an update changed it, 0 if observed unchanged, NULL unknown
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
    hist          TEXT,              -- JSON list of HIST_BINS counts (meta 'hist_edges')
    PRIMARY KEY (rank, module_id, step)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS module_stats_by_step ON module_stats(rank, step);
CREATE TABLE IF NOT EXISTS param_stats (
    rank         INTEGER NOT NULL,
    param_id     INTEGER NOT NULL,
    step         INTEGER NOT NULL,
    grad_norm    REAL,               -- NULL when .grad is None
    data_norm    REAL,
    update_norm  REAL,               -- ||w_after - w_before|| across the optimizer step
    update_ratio REAL,               -- update_norm / data_norm
    PRIMARY KEY (rank, param_id, step)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS param_stats_by_step ON param_stats(rank, step);
CREATE TABLE IF NOT EXISTS findings (
    rank       INTEGER NOT NULL,
    code       TEXT NOT NULL,
    path       TEXT NOT NULL,
    severity   TEXT NOT NULL,        -- 'error' | 'warning' | 'info'
    module_id  INTEGER,              -- module the finding is drawn on in the tree
    message    TEXT NOT NULL,
    fix        TEXT,
    evidence   TEXT,                 -- JSON object
    first_step INTEGER,
    last_step  INTEGER,
    active     INTEGER NOT NULL,     -- 1 current, 0 resolved
    PRIMARY KEY (rank, code, path)
);
CREATE TABLE IF NOT EXISTS probe_errors (
    rank       INTEGER NOT NULL,
    location   TEXT NOT NULL,        -- where in modscope, e.g. 'forward-hook'
    error_type TEXT NOT NULL,
    message    TEXT,
    count      INTEGER NOT NULL,
    first_step INTEGER,
    last_step  INTEGER,
    PRIMARY KEY (rank, location, error_type)
);
"""

TABLES = ("meta", "ranks", "modules", "params", "steps", "module_stats",
          "param_stats", "findings", "probe_errors")
