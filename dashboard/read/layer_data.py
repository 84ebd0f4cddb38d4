"""The Layers page's data: how each layer trains, over time, as plain values (no Dash; tested without a browser).

Rows are the model's modules in its order (``model.modules()``: the order of the forward in most models), grouped
by the module tree: a module is either *open* (its children are rows) or one row for its whole subtree (a block
such as ``blocks.3``). The default opens the tree level by level while the rows stay at most ``MAX_ROWS``, so a
model of 1,000+ tensors shows one row per block, not per tensor; one row per tensor is there when asked.

A row's value at a step, from the tensors under it (``dashboard.read.series``: full samples and the dense tier):
gradient and weight norms are the norm of the whole row's tensors (the square root of the sum of the squares,
exact), the update-to-data ratio is ``sqrt(sum update_norm^2) / sqrt(sum data_norm^2)`` (the ratio of the row
as one tensor); activation statistics are the row's module's own (its output). Columns are the real step numbers,
thinned evenly to ``MAX_COLUMNS`` (the newest step always kept).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from probes.schema import display_path

from .series import METRICS, Level, Metric
from .series_queries import Tensor
from .store import Store

MAX_ROWS = 48                 # rows the default view opens the tree to, at most
MAX_SHOWN_ROWS = 400          # rows drawn at once (one row per tensor of a large model is cut here)
MAX_COLUMNS = 500             # steps drawn (thinned evenly above that)
GUIDE_RATIO = 1e-3            # the usual update-to-data ratio (Karpathy's "about 1e-3")
RATIO_LOG_RANGE = (-6.0, 0.0)  # the colours of log10(update/data): the guide, -3, in the middle
PAGE_METRICS = ("grad_norm", "update_ratio", "weight_norm", "act_mean", "act_std", "dead_fraction",
                "saturated_fraction")
MAX_FILTER_IDS = 2000         # tensors named in one query (more: read them all)


@dataclass(frozen=True)
class Node:
    module_id: int
    parent_id: int | None
    path: str
    type: str
    children: tuple[int, ...]         # in the model's order
    tensors: tuple[int, ...]          # its own (param ids)


@dataclass
class ModelTree:
    """The model as it is now (a rank's current modules and tensors), in its order."""

    nodes: dict[int, Node]
    root: int | None
    tensors: dict[int, Tensor]
    _under: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def order(self) -> list[int]:
        """Module ids in depth-first pre-order (``model.modules()``'s)."""
        out: list[int] = []
        stack = [self.root] if self.root is not None else []
        while stack:
            mid = stack.pop()
            out.append(mid)
            stack.extend(reversed(self.nodes[mid].children))
        return out

    def tensors_under(self, mid: int) -> tuple[int, ...]:
        """The param ids of ``mid``'s subtree, in the model's order."""
        got = self._under.get(mid)
        if got is None:
            node = self.nodes[mid]
            got = node.tensors + tuple(t for c in node.children for t in self.tensors_under(c))
            self._under[mid] = got
        return got

    def layers_under(self, mid: int, relevant: Collection[int]) -> int:
        """How many rows ``mid`` would be when opened all the way down."""
        kids = [c for c in self.nodes[mid].children if c in relevant]
        return sum(self.layers_under(c, relevant) for c in kids) if kids else 1


def load_tree(store: Store, rank: int) -> ModelTree:
    """The rank's model as it is now: its modules (registered, unregistered, found at run time) and tensors."""
    mods = store.all_modules(rank)
    by_id = {int(m["module_id"]): m for m in mods}
    kids: dict[int, list[int]] = {}
    for mid, m in by_id.items():
        if m["parent_id"] is not None and int(m["parent_id"]) in by_id:
            kids.setdefault(int(m["parent_id"]), []).append(mid)
    top = store.root(rank)
    root = int(top["module_id"]) if top is not None else None
    ts = {t.param_id: t for t in store.series_tensors(rank) if t.current}
    own: dict[int, list[int]] = {}
    for t in ts.values():
        if t.module_id is not None:
            own.setdefault(t.module_id, []).append(t.param_id)
    nodes = {mid: Node(mid, None if m["parent_id"] is None else int(m["parent_id"]), str(m["path"]), str(m["type"]),
                       tuple(sorted(kids.get(mid, []))), tuple(sorted(own.get(mid, []))))
             for mid, m in by_id.items()}
    return ModelTree(nodes, root, ts)


@dataclass(frozen=True)
class LayerRow:
    """One row of the heat map."""

    key: str                      # stable over redraws: "m<module id>" or "t<param id>"
    label: str                    # what the row says: the path; a closed block "blocks.3 (4 layers)"
    path: str
    module_id: int                # the module a click opens
    kind: str                     # "block" (closed, with layers under it), "layer", "tensor"
    param_ids: tuple[int, ...]    # the tensors it aggregates (tensor metrics)

    def to_data(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "module_id": self.module_id, "kind": self.kind}


def relevant_modules(tree: ModelTree, spec: Metric, measured: Collection[int]) -> set[int]:
    """The modules that can be a row for ``spec``: those with tensors under them (tensor metrics), or with
    module statistics at or under them (activation metrics)."""
    out: set[int] = set()
    for mid in reversed(tree.order()):
        node = tree.nodes[mid]
        if spec.level is Level.TENSOR:
            if node.tensors or any(c in out for c in node.children):
                out.add(mid)
        elif mid in measured or any(c in out for c in node.children):
            out.add(mid)
    return out


def openable(tree: ModelTree, relevant: Collection[int], mid: int) -> bool:
    return any(c in relevant for c in tree.nodes[mid].children)


def default_opened(tree: ModelTree, spec: Metric, measured: Collection[int], max_rows: int = MAX_ROWS) -> set[int]:
    """Open the tree level by level (the root first) while the rows stay at most ``max_rows``; a module with no
    statistics of its own (a ``ModuleList`` nobody calls) is always open for an activation metric."""
    if tree.root is None:
        return set()
    relevant = relevant_modules(tree, spec, measured)
    opened = {tree.root} | must_open(tree, spec, measured, relevant)
    while True:
        rows = layer_rows(tree, spec, opened, measured)
        closed = [r.module_id for r in rows if r.kind == "block"]
        if not closed:
            return opened
        trial = opened | set(closed)
        trial |= must_open(tree, spec, measured, relevant)
        if len(layer_rows(tree, spec, trial, measured)) > max_rows:
            return opened
        opened = trial


def must_open(tree: ModelTree, spec: Metric, measured: Collection[int], relevant: Collection[int]) -> set[int]:
    """Modules that cannot be one row of an activation metric: no statistics of their own."""
    if spec.level is not Level.MODULE:
        return set()
    return {m for m in relevant if m not in measured and openable(tree, relevant, m)}


def layer_rows(tree: ModelTree, spec: Metric, opened: Collection[int], measured: Collection[int], *,
               per_tensor: bool = False) -> list[LayerRow]:
    """The rows: every relevant module under an open one, in the model's order; an open module's own tensors
    (a parameter of the module itself, next to its children) are rows of their own for a tensor metric.
    ``per_tensor``: each layer's tensors as rows of their own (tensor metrics)."""
    if tree.root is None:
        return []
    relevant = relevant_modules(tree, spec, measured)
    forced = must_open(tree, spec, measured, relevant)
    out: list[LayerRow] = []

    def tensor_row(pid: int, mid: int) -> LayerRow:
        t = tree.tensors[pid]
        return LayerRow(f"t{pid}", display_path(t.path), t.path, mid, "tensor", (pid,))

    def visit(mid: int) -> None:
        node = tree.nodes[mid]
        kids = [c for c in node.children if c in relevant]
        if kids and (mid in opened or mid in forced):
            if spec.level is Level.TENSOR:
                out.extend(tensor_row(p, mid) for p in node.tensors)
            for c in kids:
                visit(c)
            return
        under = tree.tensors_under(mid)
        if per_tensor and spec.level is Level.TENSOR:
            out.extend(tensor_row(p, tree.tensors[p].module_id or mid) for p in under)
            return
        n = tree.layers_under(mid, relevant) if kids else 0
        label = display_path(node.path) + (f" ({n} layers)" if n > 1 else "")
        out.append(LayerRow(f"m{mid}", label, node.path, mid, "block" if kids else "layer", under))

    if tree.root in relevant:
        visit(tree.root)
    return out


def open_choices(tree: ModelTree, spec: Metric, opened: Collection[int],
                 measured: Collection[int]) -> list[dict[str, Any]]:
    """What the "open blocks" control offers: the open modules and the closed blocks that are rows now."""
    relevant = relevant_modules(tree, spec, measured)
    rows = {r.module_id for r in layer_rows(tree, spec, opened, measured) if r.kind == "block"}
    return [{"label": display_path(tree.nodes[m].path), "value": m} for m in tree.order()
            if m in relevant and openable(tree, relevant, m) and (m in opened or m in rows)]


def measured_modules(store: Store, rank: int, spec: Metric) -> set[int]:
    """The modules with ``spec``'s statistic at the newest full samples (activation metrics)."""
    if spec.level is not Level.MODULE:
        return set()
    recent = store.sampled_steps(rank, limit=3)
    return {v.module_id for v in store.module_stat_series(rank, spec.column, steps=recent)} if recent else set()


# -- the values ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerHeat:
    """The heat map's values: ``values[i][j]`` of row ``i`` at ``steps[j]`` (None: no value)."""

    metric: str
    steps: list[int]
    values: list[list[float | None]]

    def shown(self) -> list[list[float | None]]:
        """What the colours show: log10 of a metric drawn as such; a zero (a layer that does not update: the thing
        to see) one decade below the smallest value, in the scale's first colour."""
        if not METRICS[self.metric].log:
            return self.values
        if self.metric == "update_ratio":
            floor = RATIO_LOG_RANGE[0]           # a fixed scale: the guide in its middle, every redraw alike
        else:
            logs = [math.log10(v) for row in self.values for v in row if v is not None and v > 0]
            floor = (min(logs) if logs else 0.0) - 1.0
        return [[None if v is None or v < 0 else math.log10(v) if v > 0 else floor for v in row]
                for row in self.values]


def thin(steps: Sequence[int], max_columns: int = MAX_COLUMNS) -> list[int]:
    """At most ``max_columns`` of ``steps``, evenly spread, the first and the newest kept."""
    if len(steps) <= max_columns:
        return list(steps)
    n = len(steps) - 1
    picks = sorted({round(i * n / (max_columns - 1)) for i in range(max_columns)})
    return [steps[i] for i in picks]


def metric_steps(store: Store, rank: int, spec: Metric, after: int | None = None) -> list[int]:
    """The steps that have ``spec``: the dense tier's and the full samples' for gradient and weight norms, the
    full samples' for the others."""
    if spec.level is Level.MODULE:
        return store.series_steps(rank, "module", after=after)
    return store.series_steps(rank, "tensor" if spec.dense_column is not None else "full", after=after)


def _norm(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return math.sqrt(sum(v * v for v in vals)) if vals else None


def layer_heat(store: Store, rank: int, rows: Sequence[LayerRow], spec: Metric, *, after: int | None = None,
               max_columns: int = MAX_COLUMNS) -> LayerHeat:
    """Each row's value at the steps of ``spec`` (only those after ``after``: a live increment)."""
    steps = thin(metric_steps(store, rank, spec, after), max_columns)
    if not steps or not rows:
        return LayerHeat(spec.name, steps if rows else [], [[None] * len(steps) for _ in rows])
    col = {s: j for j, s in enumerate(steps)}
    values: list[list[float | None]] = [[None] * len(steps) for _ in rows]
    if spec.level is Level.MODULE:
        at = {(v.module_id, v.step): v.value for v in store.module_stat_series(
            rank, spec.column, steps=steps, module_ids=[r.module_id for r in rows])}
        for i, r in enumerate(rows):
            for j, s in enumerate(steps):
                v = at.get((r.module_id, s))
                values[i][j] = float(v) if v is not None else None
        return LayerHeat(spec.name, steps, values)
    wanted = sorted({p for r in rows for p in r.param_ids})
    ratio = spec.name == "update_ratio"
    columns = ["update_norm", "data_norm", "update_ratio"] if ratio else [spec.column]
    got: dict[tuple[int, int], tuple[Any, ...]] = {
        (tv.param_id, tv.step): tv.values
        for tv in store.tensor_series(rank, columns, dense=spec.dense_column is not None, steps=steps,
                                      param_ids=wanted if len(wanted) <= MAX_FILTER_IDS else None)}
    for i, r in enumerate(rows):
        for s, j in col.items():
            per = [got[(p, s)] for p in r.param_ids if (p, s) in got]
            if not per:
                continue
            values[i][j] = row_value(spec, per, single=len(r.param_ids) == 1)
    return LayerHeat(spec.name, steps, values)


def row_value(spec: Metric, per_tensor: Sequence[tuple[Any, ...]], *, single: bool) -> float | None:
    """One row's value at one step from its tensors' values (``columns`` of :func:`layer_heat`)."""
    if spec.name == "update_ratio":
        if single:
            v = per_tensor[0][2]
            return float(v) if v is not None else None
        both = [(u, d) for u, d, _ in per_tensor if u is not None and d is not None]
        upd, data = _norm(u for u, _ in both), _norm(d for _, d in both)
        return upd / data if upd is not None and data else None
    if spec.name in ("grad_norm", "weight_norm", "update_norm"):
        return _norm(v[0] for v in per_tensor)
    vals = [float(v[0]) for v in per_tensor if v[0] is not None]
    return max(vals) if vals else None           # lr: the largest of the row's groups


def default_picks(rows: Sequence[LayerRow], n: int = 6) -> list[str]:
    """The rows the line chart shows first: all of a few, else ``n`` spread evenly (the first and last among them)."""
    if len(rows) <= n:
        return [r.key for r in rows]
    last = len(rows) - 1
    return [rows[i].key for i in sorted({round(k * last / (n - 1)) for k in range(n)})]


def picks_of(keys: Sequence[str], chosen: object) -> list[str]:
    """The chosen keys that are rows now (in row order)."""
    if not isinstance(chosen, list):
        return []
    want = {str(k) for k in chosen}
    return [k for k in keys if k in want]


def values_by_key(rows: Sequence[LayerRow], heat: LayerHeat) -> Mapping[str, list[float | None]]:
    return {r.key: heat.values[i] for i, r in enumerate(rows)}


# -- the module detail's parameter history ------------------------------------------------------------------------
MAX_HISTORY_TENSORS = 24      # tensors of one module drawn over time (a module owning more: the first ones)


@dataclass(frozen=True)
class ParamHistory:
    """One tensor of a module over time: its gradient norm at every step that has one (full samples and the dense
    tier) and its update-to-data ratio at the full samples, oldest step first."""

    name: str
    steps: list[int] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    update_steps: list[int] = field(default_factory=list)
    update_ratio: list[float] = field(default_factory=list)

    def has_values(self) -> bool:
        return bool(self.steps or self.update_steps)


def param_history(store: Store, rank: int, params: Sequence[Mapping[str, Any]],
                  limit: int = MAX_HISTORY_TENSORS) -> list[ParamHistory]:
    """The history of each tensor in ``params`` (``Store.module_params`` rows; buffers left out), in their order."""
    tensors_ = [p for p in params if p.get("kind") != "buffer" and p.get("param_id") is not None][:limit]
    if not tensors_:
        return []
    ids = [int(p["param_id"]) for p in tensors_]
    grads = sorted(store.tensor_series(rank, ["grad_norm"], param_ids=ids), key=lambda v: v.step)
    ratios = sorted(store.tensor_series(rank, ["update_ratio"], dense=False, param_ids=ids), key=lambda v: v.step)
    out = {int(p["param_id"]): ParamHistory(str(p["name"])) for p in tensors_}
    for v in grads:
        if v.values[0] is not None:
            out[v.param_id].steps.append(v.step)
            out[v.param_id].grad_norm.append(float(v.values[0]))
    for v in ratios:
        if v.values[0] is not None:
            out[v.param_id].update_steps.append(v.step)
            out[v.param_id].update_ratio.append(float(v.values[0]))
    return list(out.values())
