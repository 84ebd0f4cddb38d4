"""The store contract, end to end: stores written by the real writer (``probes.watch``) on models of
the zoo, read through every query ``dashboard.read.store`` offers, and rendered by every page builder.

The writer's file name is changing, so a run's store is found by globbing ``modscope*.sqlite``.
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import socket
import sqlite3
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probes
from bench import synth_store
from dashboard.read import store as data_module
from dashboard.read.compare import compare_stores
from dashboard.read.run import RunDir, fold_causes, root_counts
from dashboard.read.store import (
    RunState,
    Store,
    in_wal_mode,
    last_modified,
    resolve_store_path,
    writer_present,
)
from dashboard.web.pages import findings as findings_page
from dashboard.web.pages import modules as modules_page
from dashboard.web.pages import overview as overview_page
from dashboard.web.report import build_report
from probes import schema
from probes.store import rundir
from tests.probes import zoo

STEPS = 12
HERE = Path(__file__)


def store_file(run_dir: Path) -> Path:
    files = sorted(run_dir.glob("modscope*.sqlite"))
    assert len(files) == 1, files
    return files[0]


class Recorded:
    """One real run: where it is, what the training loop saw, and the writer's own findings."""

    def __init__(self, run_dir: Path, losses: list[float], findings: list[probes.Finding]) -> None:
        self.run_dir, self.losses, self.findings = run_dir, losses, findings

    @property
    def store(self) -> Store:
        return Store.open_run(self.run_dir)


def train(run_dir: Path, model: nn.Module, optimizers, step_fn, steps: int = STEPS) -> Recorded:
    torch.manual_seed(0)
    losses: list[float] = []
    with probes.watch(model, optimizers, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            loss = step_fn()
            losses.append(float(loss))
            w.step(loss)
        found = w.findings()
    return Recorded(run_dir, losses, found)


def classifier_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


class FixedXOR(zoo.XORClassifier):
    """The zoo's XOR classifier after the fix: the encoder's blocks in an nn.ModuleList."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__(width, depth)
        self.encoder.blocks = nn.ModuleList(self.encoder.blocks)


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.discriminator(self.generator(z))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Recorded]:
    base = tmp_path_factory.mktemp("runs")
    out = {}
    x, y = zoo.xor_data(256)
    torch.manual_seed(0)
    for name, cls in (("xor", zoo.XORClassifier), ("xor-fixed", FixedXOR)):
        torch.manual_seed(0)
        model = cls()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out[name] = train(base / name, model, opt, classifier_step(model, opt, x, y))

    torch.manual_seed(0)
    gpt = zoo.GPT()
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)

    def gpt_step() -> torch.Tensor:
        logits = gpt(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    out["gpt"] = train(base / "gpt", gpt, opt, gpt_step)

    torch.manual_seed(0)
    dead = zoo.DeadReLU()
    opt_dead = torch.optim.SGD(dead.parameters(), lr=0.01)
    out["dead"] = train(base / "dead", dead, opt_dead,
                        classifier_step(dead, opt_dead, torch.randn(64, 8), torch.randint(0, 2, (64,))))

    torch.manual_seed(0)
    gan = GAN()
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=1e-3)
    real, z = torch.randn(32, 8), torch.randn(32, 4)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)

    def gan_step() -> torch.Tensor:
        fake = gan.generator(z)
        d_loss = (F.binary_cross_entropy_with_logits(gan.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(gan.discriminator(fake.detach()), zeros))
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(gan(z), ones)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        return g_loss.detach()
    out["gan"] = train(base / "gan", gan, [opt_g, opt_d], gan_step)
    return out


def by_path(s: Store, path: str) -> dict:
    m = s.module_by_path(0, path)
    assert m is not None, path
    return m


# -- the run directory and the run ----------------------------------------------------------------------
def test_the_store_is_found_in_the_run_directory(runs):
    r = runs["xor"]
    path = store_file(r.run_dir)
    assert resolve_store_path(r.run_dir) == path
    for opened in (Store.open_run(r.run_dir), Store.open_any(r.run_dir), Store.open_run(path), Store.open_any(path)):
        assert opened.path == path and opened.ready()
    info = Store.open_snapshot(path).validate()
    assert info.schema_version == schema.SCHEMA_VERSION and set(schema.TABLES) <= set(info.tables)


def test_run_level_queries(runs):
    r = runs["xor"]
    s = r.store
    meta = s.meta()
    assert meta["schema_version"] == schema.SCHEMA_VERSION and meta["hist_edges"] == schema.HIST_EDGES
    assert meta["run_name"] == "xor"
    assert s.ranks() == [0]
    assert s.last_step() == STEPS - 1
    ov = s.overview()
    assert ov["path"] == str(store_file(r.run_dir)) and ov["run_name"] == "xor"
    assert ov["model_class"].endswith("XORClassifier") and ov["status"] == schema.RunStatus.CLOSED
    assert ov["steps_recorded"] == STEPS and ov["samples_stored"] == STEPS and ov["step"] == STEPS - 1
    assert ov["world_size"] == 1 and ov["sampling"]["every"] == 1
    assert ov["samples_dropped"] == 0 and ov["probe_errors"] == 0 and ov["write_errors"] == 0
    assert ov["modules"] == {"registered": 4, "unregistered": 3, "runtime": 0}
    assert ov["params"]["total"] == 82 and ov["params"]["in_optimizer"] == 82 and ov["params"]["unregistered"] == 816
    assert ov["findings"]["error"] == sum(1 for f in r.findings if f.severity == "error") >= 3
    assert ov["pid"] == os.getpid() and ov["hostname"] == socket.gethostname()
    assert 0 < ov["overhead"] and ov["started_at"] <= min(ov["updated_at"], ov["closed_at"])
    assert s.probe_errors() == []
    sig = s.change_signature()
    assert (sig.last_step, sig.stats_step, sig.status, sig.structure[0]) == (STEPS - 1, STEPS - 1, "closed", 7)
    beat = s.heartbeat()
    assert (beat.pid, beat.hostname, beat.status) == (os.getpid(), socket.gethostname(), "closed")
    assert beat.median_step_s is not None and beat.median_step_s > 0
    assert s.liveness().state is RunState.CLOSED
    assert s.write_trouble() is None


def test_the_writers_step_counter_is_the_last_step(runs):
    """ranks.step is "the last step seen" (probes/schema.py): the step of the newest steps row."""
    conn = sqlite3.connect(store_file(runs["xor"].run_dir))
    try:
        counter = conn.execute("SELECT step FROM ranks WHERE rank = 0").fetchone()[0]
        newest = conn.execute("SELECT MAX(step) FROM steps WHERE rank = 0").fetchone()[0]
    finally:
        conn.close()
    assert counter == newest == STEPS - 1


def test_losses_are_the_training_loops(runs):
    r = runs["xor"]
    s = r.store
    series = s.loss_series()
    assert series["step"] == list(range(STEPS)) and series["last"] == STEPS - 1
    assert series["loss"] == pytest.approx(r.losses, rel=1e-6)
    assert s.loss_series(since_step=STEPS - 3)["step"] == [STEPS - 2, STEPS - 1]
    assert s.loss_series(max_points=4)["step"][-1] == STEPS - 1 and len(s.loss_series(max_points=4)["step"]) <= 5
    assert s.final_loss() == pytest.approx(r.losses[-1], rel=1e-6)


# -- the tree and the findings of the plain-list bug ------------------------------------------------------
BLOCKS = [f"encoder.blocks[{i}]" for i in range(3)]


def test_tree_of_the_plain_list_bug(runs):
    s = runs["xor"].store
    root = s.root()
    assert root["type"] == "XORClassifier" and root["path"] == "" and root["kind"] == "registered"
    assert s.module(0, root["module_id"]) == root
    top = s.children(0, root["module_id"])
    assert [m["path"] for m in top["items"]] == ["stem", "encoder", "head"] and top["more"] == 0
    enc = by_path(s, "encoder")
    blocks = s.children(0, enc["module_id"])["items"]
    assert [(m["path"], m["name"], m["kind"], m["type"]) for m in blocks] == \
        [(p, p.split(".")[1], "unregistered", "Linear") for p in BLOCKS]
    assert [m["params_total"] for m in blocks] == [272] * 3 and [m["params_in_optimizer"] for m in blocks] == [0] * 3
    assert s.ancestors(0, blocks[2]["module_id"]) == [root["module_id"], enc["module_id"]]
    assert s.module_for_path(0, "encoder.blocks[1].weight")["path"] == "encoder.blocks[1]"
    assert s.module_for_path(0, "no.such.module")["path"] == ""
    assert [m["path"] for m in s.search_modules(0, "blocks")["items"]] == BLOCKS
    # the plain list's one finding is drawn on its first layer
    assert [m["path"] for m in s.search_modules(0, "", "unregistered-module")["items"]] == BLOCKS[:1]
    assert {m["path"] for m in s.all_modules()} == {"", "stem", "encoder", "head", *BLOCKS}
    assert s.default_expanded()[:2] == [root["module_id"], enc["module_id"]]
    inside = s.subtree_finding_counts()
    assert inside[enc["module_id"]]["error"] == sum(inside[b["module_id"]]["error"] for b in blocks)


def test_findings_of_the_plain_list_bug(runs):
    r = runs["xor"]
    s = r.store
    stored = s.findings(active=None)
    # the store holds what the writer found, with the same severity and cause
    assert {(f["code"], f["path"], f["severity"]) for f in stored if f["active"]} == \
        {(f.code, f.path, f.severity) for f in r.findings}
    causes = {f.key: f.cause for f in r.findings}
    fixes = {f.key: f.fix for f in r.findings}            # the code's fix, or one the case needs (its own)
    for f in stored:
        if f["active"]:
            cause = causes[(f["code"], f["path"])]
            assert (f["cause_code"], f["cause_path"]) == (tuple(cause) if cause else (None, None))
            assert f["fix"] == fixes[(f["code"], f["path"])]
        assert 1 <= f["count"] <= STEPS and 0 <= f["first_step"] <= f["last_step"] <= STEPS - 1
        assert f["message"] and f["fix"]
    unreg = [f for f in stored if f["code"] == "unregistered-module"]
    assert [(f["path"], f["severity"], f["module_path"]) for f in unreg] == [("encoder.blocks", "error", BLOCKS[0])]
    assert all("816 numbers" in f["message"] and f["evidence"]["reachable_from"] == "encoder"
               and f["evidence"]["layers"] == BLOCKS for f in unreg)
    severities = [schema.SEVERITY_ORDER[schema.Severity(f["severity"])] for f in stored]
    assert severities == sorted(severities)
    assert s.count_findings(0, active=None) == len(stored)          # what caps.py compares with the read's limit
    assert s.count_findings(0) == sum(1 for f in stored if f["active"])
    assert {"unregistered-module", "not-updating"} <= set(s.finding_codes())
    blk = by_path(s, BLOCKS[0])
    own = s.findings_for_modules(0, [blk["module_id"]])[blk["module_id"]]
    assert {f["code"] for f in own} >= {"unregistered-module", "not-updating"}
    assert [f["path"] for f in s.findings(module_id=blk["module_id"]) if f["code"] == "not-updating"] == \
        [f"{BLOCKS[0]}.bias", f"{BLOCKS[0]}.weight"]


def test_module_series_histograms_and_params(runs):
    s = runs["xor"].store
    for m in s.all_modules():
        series = s.module_series(0, m["module_id"])
        assert series["step"] == list(range(STEPS)), m["path"]           # every step was sampled
        assert all(c == 1 for c in series["calls"]) and series["last"] == STEPS - 1
        assert all(v is not None and math.isfinite(v) for v in series["std"])
    blk = by_path(s, BLOCKS[0])
    assert s.module_series(0, blk["module_id"], since_step=STEPS - 2)["step"] == [STEPS - 1]
    small = s.module_series(0, blk["module_id"], max_points=5)
    assert 1 < len(small["step"]) <= 6 and small["step"][-1] == STEPS - 1
    hist = s.module_hist(0, blk["module_id"])
    assert hist["step"] == list(range(STEPS)) and hist["edges"] == schema.HIST_EDGES
    assert all(len(c) == schema.HIST_BINS and sum(c) > 0 for c in hist["counts"])
    params = {p["name"]: p for p in s.module_params(0, blk["module_id"])}
    w = params["weight"]
    assert (w["path"], w["shape"], w["kind"], w["in_optimizer"], w["in_state_dict"], w["moved"]) == \
        (f"{BLOCKS[0]}.weight", [16, 16], "tensor", 0, 0, 0)
    assert w["grad_norm"] > 0 and w["update_norm"] == 0 and w["stat_step"] == STEPS - 1 and w["lr"] is None
    stem = {p["name"]: p for p in s.module_params(0, by_path(s, "stem")["module_id"])}["weight"]
    assert (stem["kind"], stem["in_optimizer"], stem["opt_index"], stem["opt_group"], stem["lr"], stem["moved"]) == \
        ("parameter", 1, 0, 0, pytest.approx(0.1), 1)
    assert stem["update_ratio"] > 0
    latest = s.latest_module_stats()
    assert {m["module_id"] for m in s.all_modules()} == set(latest)
    assert all(row["step"] == STEPS - 1 for row in latest.values())
    assert s.state_dict_keys() == ["head.bias", "head.weight", "stem.bias", "stem.weight"]
    # what `modscope checkpoint` compares a file with: the registered tensors and the plain list's, by their modules
    tensors = {t.path: t for t in s.checkpoint_tensors()}
    stem_w = tensors["stem.weight"]
    assert (stem_w.registered, stem_w.in_state_dict, stem_w.shape, stem_w.module_kind) == \
        (True, True, (16, 2), "registered")
    block = tensors[f"{BLOCKS[0]}.weight"]
    assert (block.registered, block.in_state_dict, block.module_path, block.module_kind, block.module_type,
            block.numel) == (False, False, BLOCKS[0], "unregistered", "Linear", 256)
    assert len(tensors) == 10


def test_the_series_over_time(runs):
    """The series queries (the Layers page, the module detail, ``modscope series``) on a real store: every
    step of this run is a full sample and it has no dense tier, so each tensor has a value at every step."""
    s = runs["xor"].store
    tensors = {t.path: t for t in s.series_tensors(0)}
    assert {"stem.weight", "head.bias", f"{BLOCKS[0]}.weight"} <= set(tensors)
    assert all(t.kind != "buffer" and t.current and t.numel > 0 for t in tensors.values())
    stem = tensors["stem.weight"]
    grads = s.tensor_series(0, ["grad_norm", "data_norm"], param_ids=[stem.param_id])
    assert [v.step for v in sorted(grads, key=lambda v: v.step)] == list(range(STEPS))
    assert all(v.full and v.param_id == stem.param_id and v.values[0] > 0 and v.values[1] > 0 for v in grads)
    latest = {p["name"]: p for p in s.module_params(0, by_path(s, "stem")["module_id"])}["weight"]
    (last,) = s.tensor_series(0, ["update_ratio"], dense=False, steps=[STEPS - 1], param_ids=[stem.param_id])
    assert last.values[0] == pytest.approx(latest["update_ratio"])
    assert {v.step for v in s.tensor_series(0, ["grad_norm"], after=STEPS - 3)} == {STEPS - 2, STEPS - 1}
    with pytest.raises(ValueError, match="not tensor series columns"):
        s.tensor_series(0, ["path"])
    paths = s.module_paths(0)
    blk = by_path(s, BLOCKS[0])["module_id"]
    assert paths[blk] == BLOCKS[0] and set(paths.values()) >= {"", "stem", "encoder", "head", *BLOCKS}
    acts = s.module_stat_series(0, "std", module_ids=[blk])
    assert sorted(v.step for v in acts) == list(range(STEPS)) and all(v.module_id == blk for v in acts)
    assert [v.value for v in sorted(acts, key=lambda v: v.step)] == s.module_series(0, blk)["std"]
    for kind in ("tensor", "full", "module"):
        assert s.series_steps(0, kind) == list(range(STEPS)), kind
    assert s.series_steps(0, "dense") == [] and s.series_steps(0, "module", after=STEPS - 2) == [STEPS - 1]
    counts = s.step_counts(0)
    assert (counts.full, counts.dense, counts.text()) == (STEPS, 0, f"{STEPS} full samples")
    assert s.sample_schedule(0).budget_text() == "every step"
    assert [p.step for p in s.loss_points(0)] == list(range(STEPS))
    assert [p.loss for p in s.loss_points(0)] == pytest.approx(runs["xor"].losses, rel=1e-6)


def test_snapshot_round_trip(runs, tmp_path):
    r = runs["xor"]
    s = r.store
    snap = tmp_path / "snap.sqlite"
    snap.write_bytes(s.snapshot_bytes())
    copy = Store.open_snapshot(snap)
    assert not copy.live and copy.meta()["snapshot_of"] == s.path.name
    ignore = {"path", "live"}
    assert {k: v for k, v in copy.overview().items() if k not in ignore} == \
        {k: v for k, v in s.overview().items() if k not in ignore}
    assert copy.findings(active=None) == s.findings(active=None)
    blk = by_path(s, BLOCKS[1])["module_id"]
    assert copy.module_series(0, blk) == s.module_series(0, blk)
    assert copy.module_params(0, blk) == s.module_params(0, blk)
    assert copy.liveness().state is RunState.CLOSED


def test_the_writers_snapshot_opens_in_the_dashboard(runs, tmp_path):
    """w.snapshot(path) while training: the dashboard opens it (review mode) and sees the run so far."""
    x, y = zoo.xor_data(64)
    torch.manual_seed(0)
    model = zoo.XORClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = classifier_step(model, opt, x, y)
    with probes.watch(model, opt, run_dir=tmp_path / "run", every=1) as w:
        for _ in range(3):
            w.step(step())
        snap = w.snapshot(tmp_path / "during.sqlite")
        live = Store.open_run(tmp_path / "run")
        assert live.liveness().state is RunState.RUNNING and live.last_step() == 2
        assert writer_present(live.path)                  # its .lock: never read as immutable while written
        w.step(step())
    s = Store.open_snapshot(snap)
    assert s.last_step() == 2 and s.overview()["status"] == "running"
    assert s.liveness().state is RunState.COPIED_RUNNING
    assert [f["path"] for f in s.findings() if f["code"] == "unregistered-module"] == ["encoder.blocks"]
    assert Store.open_run(tmp_path / "run").liveness().state is RunState.CLOSED


def test_compare_before_and_after_the_fix(runs):
    cmp = compare_stores(runs["xor"].store, runs["xor-fixed"].store)
    summary = {row["metric"]: (row["a"], row["b"]) for row in cmp["summary"]}
    assert summary["unregistered modules"] == (3, 0) and summary["registered modules"] == (4, 8)
    assert summary["parameters (registered)"] == (82, 898) and summary["held by optimizer"] == (82, 898)
    assert summary["checkpoint keys"] == (4, 10)
    assert ("unregistered-module", "encoder.blocks") in {(f["code"], f["path"]) for f in cmp["findings_resolved"]}
    assert not [f for f in cmp["findings_appeared"] if f["severity"] == "error"]
    assert cmp["keys_added"] == sorted(f"encoder.blocks.{i}.{n}" for i in range(3) for n in ("bias", "weight"))
    row = next(m for m in cmp["modules"] if m["key"] == "encoder.blocks.0")
    assert (row["path_a"], row["path_b"], row["kind_a"], row["kind_b"]) == \
        ("encoder.blocks[0]", "encoder.blocks.0", "unregistered", "registered")
    assert (row["in_opt_a"], row["in_opt_b"]) == (0, 272) and row["changed"]
    # errors and warnings are root causes, as the Overview, the Findings tab and the report count them
    roots = root_counts(fold_causes(runs["xor"].store.findings()))
    assert (summary["errors"][0], summary["warnings"][0]) == (roots["error"], roots["warning"])
    assert summary["errors"][0] < len([f for f in runs["xor"].store.findings() if f["severity"] == "error"])


# -- other models of the zoo --------------------------------------------------------------------------------
def test_tied_weights_of_a_gpt(runs):
    s = runs["gpt"].store
    shared = [f for f in s.findings() if f["code"] == "shared-parameter"]
    assert [(f["path"], f["severity"]) for f in shared] == [("wte.weight", "info")]
    wte = {p["name"]: p for p in s.module_params(0, by_path(s, "wte")["module_id"])}["weight"]
    assert wte["aliases"] == ["head.weight"] and wte["in_state_dict"] == 1
    assert (wte["primary"], wte["shared_with"]) == (True, ["head.weight"])
    # the head owns the same tensor by its alias: listed there too, with the same statistics
    [head] = s.module_params(0, by_path(s, "head")["module_id"])
    assert (head["name"], head["path"], head["primary"], head["shared_with"]) == \
        ("weight", "head.weight", False, ["wte.weight"])
    assert (head["param_id"], head["grad_norm"], head["numel"]) == (wte["param_id"], wte["grad_norm"], wte["numel"])
    keys = s.state_dict_keys()
    assert {"wte.weight", "head.weight"} <= set(keys) and not [k for k in keys if k.endswith(".mask")]
    mask = {p["name"]: p for p in s.module_params(0, by_path(s, "blocks.0.attn")["module_id"])}["mask"]
    assert (mask["kind"], mask["in_state_dict"], mask["requires_grad"]) == ("buffer", 0, 0)
    ov = s.overview()
    assert ov["modules"]["unregistered"] == 0 and ov["params"]["total"] == ov["params"]["in_optimizer"] > 0
    assert s.module_series(0, by_path(s, "blocks.1.mlp")["module_id"])["step"] == list(range(STEPS))


def test_dead_relu(runs):
    s = runs["dead"].store
    act = by_path(s, "act")
    assert [(f["code"], f["severity"], f["module_path"]) for f in s.findings() if f["code"].startswith("dead")] == \
        [("dead-layer", "error", "act")]
    assert s.module_series(0, act["module_id"])["dead_frac"] == [1.0] * STEPS
    assert [m["path"] for m in s.search_modules(0, "", "dead-layer")["items"]] == ["act"]
    assert act["module_id"] in s.default_expanded() or s.root()["module_id"] in s.default_expanded()


def test_two_optimizers_of_a_gan(runs):
    r = runs["gan"]
    s = r.store
    for prefix, index in (("generator", 0), ("discriminator", 1)):
        for layer in (0, 2):
            params = s.module_params(0, by_path(s, f"{prefix}.{layer}")["module_id"])
            assert {(p["name"], p["opt_index"], p["in_optimizer"], p["moved"]) for p in params} == \
                {("weight", index, 1, 1), ("bias", index, 1, 1)}
    assert s.module_series(0, by_path(s, "generator")["module_id"])["calls"] == [2] * STEPS
    assert s.module_series(0, by_path(s, "discriminator")["module_id"])["calls"] == [3] * STEPS
    assert s.loss_series()["loss"] == pytest.approx(r.losses, rel=1e-6)
    assert s.last_step() == STEPS - 1 and s.overview()["params"]["in_optimizer"] == 377
    assert s.optimizer_count(0) == 2 and runs["xor"].store.optimizer_count(0) == 1


# -- a version-1 store of the real writer ---------------------------------------------------------------------
def test_a_real_store_as_version_1(runs, tmp_path):
    copy = tmp_path / schema.LEGACY_STORE_FILENAME
    shutil.copy(store_file(runs["xor"].run_dir), copy)
    synth_store.as_version_1(copy)
    old, new = Store.open_run(tmp_path), runs["xor"].store
    assert old.path == copy and old.validate().schema_version == 1
    assert [(f["code"], f["path"], f["count"], f["cause_code"]) for f in old.findings(active=None)] == \
        [(f["code"], f["path"], 1, None) for f in new.findings(active=None)]
    assert old.overview()["findings"] == new.overview()["findings"] and old.overview()["write_errors"] == 0
    blk = by_path(old, BLOCKS[0])["module_id"]
    assert [p["local_grad_norm"] for p in old.module_params(0, blk)] == [None, None]
    stem = by_path(old, "stem")["module_id"]        # no lr per step: the one the index was built with
    assert [p["lr"] for p in old.module_params(0, stem)] == [pytest.approx(0.1)] * 2


def test_a_real_store_as_version_3(runs, tmp_path):
    """A store written before modules and tensors that leave the model were marked (schema version 3) opens: every
    module and tensor reads as part of the model (removed_step NULL), and a writer appending to it adds the column."""
    copy = tmp_path / "old" / store_file(runs["xor"].run_dir).name
    copy.parent.mkdir()
    shutil.copy(store_file(runs["xor"].run_dir), copy)
    con = sqlite3.connect(copy)
    try:
        for table in ("modules", "params"):
            con.execute(f"ALTER TABLE {table} DROP COLUMN removed_step")
        con.execute("PRAGMA user_version = 3")
        con.commit()
    finally:
        con.close()
    old, new = Store.open_run(copy.parent), runs["xor"].store
    assert old.validate().schema_version == 3
    assert old.all_modules() == new.all_modules() and all(m["removed_step"] is None for m in old.all_modules())
    assert old.all_modules(removed=True) == []
    assert old.overview()["modules"] == new.overview()["modules"] and old.overview()["modules_removed"] == 0
    assert old.overview()["params"] == new.overview()["params"] and old.state_dict_keys() == new.state_dict_keys()
    root = old.root()["module_id"]
    assert old.children(0, root) == new.children(0, root)
    assert old.search_modules(0, "blocks") == new.search_modules(0, "blocks")
    blk = by_path(old, BLOCKS[0])["module_id"]
    assert [p["path"] for p in old.module_params(0, blk)] == [p["path"] for p in new.module_params(0, blk)]
    assert old.change_signature().structure[0] == 7
    tree, _ = modules_page.build_tree(old, 0, [m["module_id"] for m in old.all_modules()], None)
    assert {r["kind"] for r in tree["rows"]} == {"registered", "unregistered"}
    from probes.store.writer import connect_writer
    conn = connect_writer(copy)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION
        assert conn.execute("SELECT COUNT(*) FROM modules WHERE removed_step IS NULL").fetchone()[0] == 7
    finally:
        conn.close()


class Swapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h)


SWAP_AT = 6


@pytest.fixture(scope="module")
def swapped(tmp_path_factory) -> Recorded:
    """A run whose model changes at step SWAP_AT: its last block is deleted (ModuleList.pop) and its head replaced
    by a new one (the optimizer, built before, still holds the old head's parameters)."""
    torch.manual_seed(0)
    model = Swapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    calls = iter(range(STEPS))

    def step() -> torch.Tensor:
        if next(calls) == SWAP_AT:
            model.blocks.pop(2)
            model.head = nn.Linear(16, 2)
        return classifier_step(model, opt, x, y)()
    return train(tmp_path_factory.mktemp("swapped"), model, opt, step)


def test_a_changed_model_is_read_as_it_is_now(swapped, runs, tmp_path):
    """The tree, the counts, the checkpoint keys, the search, a module's detail, the report, a snapshot and Compare
    of a run whose model changed: the model as it is now; what left it readable (its history and tensors), marked
    with the step it left at, and never counted as part of the model."""
    s = swapped.store
    now = {m["path"]: m for m in s.all_modules()}
    assert set(now) == {"", "stem", "blocks", "blocks.0", "blocks.1", "head"}
    gone = {m["path"]: m for m in s.all_modules(removed=True)}
    assert set(gone) == {"blocks.2", "head"} and {m["removed_step"] for m in gone.values()} == {SWAP_AT}
    old_head, new_head = gone["head"], now["head"]
    assert old_head["module_id"] != new_head["module_id"] and new_head["first_step"] == SWAP_AT
    assert s.module_by_path(0, "head") == new_head and s.module_for_path(0, "head.weight") == new_head
    # another rank's module in the same state: the one removed at that step, else the one there now
    assert s.module_like(0, "head", SWAP_AT) == old_head and s.module_like(0, "head", None) == new_head
    assert s.module_like(0, "head", SWAP_AT + 1) == new_head
    assert s.modules_for_paths(0, ["head.bias", "blocks.2"]) == {"head.bias": new_head, "blocks.2": gone["blocks.2"]}
    root = s.root()
    assert root["params_total"] == 16 * 8 + 16 + 2 * (16 * 16 + 16) + 16 * 2 + 2
    assert [m["path"] for m in s.children(0, root["module_id"])["items"]] == ["stem", "blocks", "head"]
    assert [m["path"] for m in s.children(0, now["blocks"]["module_id"])["items"]] == ["blocks.0", "blocks.1"]
    # the tree: the model now; a removed module drawn (as "removed") only where it was, when it is the one selected
    every = [m["module_id"] for m in (*now.values(), *gone.values())]
    tree, _ = modules_page.build_tree(s, 0, every, None)
    assert [r["path"] for r in tree["rows"]] == ["", "stem", "blocks", "blocks.0", "blocks.1", "head"]
    assert {r["kind"] for r in tree["rows"]} == {"registered"}
    tree, _ = modules_page.build_tree(s, 0, every, old_head["module_id"])
    rows = [(r["path"], r["kind"], r["kind_title"]) for r in tree["rows"]]
    assert rows[-2:] == [("head", "registered", ""), ("head", "removed", modules_page.removed_title(old_head))]
    assert rows[-1][2].startswith(f"removed at step {SWAP_AT}")
    found = modules_page.build_results(s, 0, "head", None, None)[0]["rows"]
    assert [(r["path"], r["kind"]) for r in found] == [("head", "registered"), ("head", "removed")]
    # counts: the model now (each tensor once), the removed apart
    ov = s.overview()
    assert ov["modules"] == {"registered": 6, "unregistered": 0, "runtime": 0} and ov["modules_removed"] == 2
    assert ov["params"]["total"] == root["params_total"] and ov["params"]["state_dict_tensors"] == 8
    assert s.state_dict_keys() == sorted(f"{m}.{p}" for m in ("stem", "blocks.0", "blocks.1", "head")
                                         for p in ("weight", "bias"))
    # what left the model keeps its history and its own tensors; the new head has its own
    assert s.module_series(0, old_head["module_id"])["step"] == list(range(SWAP_AT))
    assert s.module_series(0, new_head["module_id"])["step"][-1] == STEPS - 1
    assert s.module_series(0, new_head["module_id"])["step"][0] >= SWAP_AT
    old_params = s.module_params(0, old_head["module_id"])
    new_params = s.module_params(0, new_head["module_id"])
    assert [p["path"] for p in old_params] == [p["path"] for p in new_params] == ["head.weight", "head.bias"]
    assert {p["param_id"] for p in old_params}.isdisjoint(p["param_id"] for p in new_params)
    assert [p["in_optimizer"] for p in old_params] == [1, 1] and [p["in_optimizer"] for p in new_params] == [0, 0]
    assert {f["module_id"] for f in s.findings(active=True) if f["path"].startswith("head.")} == \
        {new_head["module_id"]}
    # the module's detail says it left the model
    run = RunDir.open(swapped.run_dir).run()
    detail = modules_page.detail_full(run, 0, old_head["module_id"])
    assert f"removed at step {SWAP_AT}" in str(detail.header)
    assert "removed at step" not in str(modules_page.detail_full(run, 0, new_head["module_id"]).header)
    # the report: the tree of the model now, and what was removed below it
    report = build_report(run)
    assert "<th>Modules removed during the run</th><td>2</td>" in report
    assert "Modules removed during the run" not in build_report(RunDir.open(runs["xor"].run_dir).run())
    tree_html = report.split('id="tree"', 1)[1].split("</section>", 1)[0]
    now_html, _, gone_html = tree_html.partition("Removed during the run (2)")
    assert "blocks.2" not in now_html and "removed at step" not in now_html
    assert "blocks.2" in gone_html and gone_html.count(f"removed at step {SWAP_AT}") == 4      # badge and title
    # a snapshot keeps it all
    snap = schema.snapshot([store_file(swapped.run_dir)], tmp_path / "snap.sqlite")
    copy = Store.open_snapshot(snap)
    assert copy.all_modules(removed=True) == s.all_modules(removed=True) and copy.overview()["modules_removed"] == 2
    # Compare matches the models as they are now
    cmp = compare_stores(copy, s)
    assert sorted(m["key"] for m in cmp["modules"]) == sorted(now) and not any(m["changed"] for m in cmp["modules"])
    assert cmp["keys_added"] == cmp["keys_removed"] == []


def test_a_module_that_moved_is_read_as_the_module_it_was(tmp_path):
    """``model.blocks.pop(0)`` at step SWAP_AT: the blocks after it only move up (the same objects, now at
    ``blocks.0`` and ``blocks.1``). Read as the model now: each is the module it was, at its new path, with its whole
    history and its own tensors; only the block popped is removed, under the path it had."""
    torch.manual_seed(0)
    model = Swapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    calls = iter(range(STEPS))

    def step() -> torch.Tensor:
        if next(calls) == SWAP_AT:
            model.blocks.pop(0)
        return classifier_step(model, opt, x, y)()
    s = train(tmp_path / "moved", model, opt, step).store
    now = {m["path"]: m for m in s.all_modules()}
    assert set(now) == {"", "stem", "blocks", "blocks.0", "blocks.1", "head"}
    (gone,) = s.all_modules(removed=True)
    assert (gone["path"], gone["removed_step"], gone["first_step"]) == ("blocks.0", SWAP_AT, 0)
    moved = [now["blocks.0"], now["blocks.1"]]
    assert gone["module_id"] < moved[0]["module_id"] < moved[1]["module_id"]          # ids given at step 0
    for m in moved:
        assert m["first_step"] == 0 and m["removed_step"] is None
        assert s.module_series(0, m["module_id"])["step"] == list(range(STEPS))      # one history, never split
        assert [p["path"] for p in s.module_params(0, m["module_id"])] == [f"{m['path']}.weight", f"{m['path']}.bias"]
        assert all(p["stat_step"] == STEPS - 1 for p in s.module_params(0, m["module_id"]))
    assert s.module_series(0, gone["module_id"])["step"] == list(range(SWAP_AT))
    assert [p["path"] for p in s.module_params(0, gone["module_id"])] == ["blocks.0.weight", "blocks.0.bias"]
    assert s.module_by_path(0, "blocks.0") == now["blocks.0"] and s.module_by_path(0, "blocks.2") is None
    assert s.module_for_path(0, "blocks.1.weight") == now["blocks.1"]
    assert [m["path"] for m in s.children(0, now["blocks"]["module_id"])["items"]] == ["blocks.0", "blocks.1"]
    tree, _ = modules_page.build_tree(s, 0, [m["module_id"] for m in now.values()], None)
    assert [r["path"] for r in tree["rows"]] == ["", "stem", "blocks", "blocks.0", "blocks.1", "head"]
    assert s.overview()["modules_removed"] == 1
    assert s.state_dict_keys() == sorted(f"{m}.{p}" for m in ("stem", "blocks.0", "blocks.1", "head")
                                         for p in ("weight", "bias"))


def test_the_learning_rate_a_scheduler_sets_is_stored_per_step(tmp_path):
    """The params table holds the lr its param group had when the model was indexed; a scheduler changes it every
    step (a warmup from 0), so each sampled step stores its own, and the parameter table shows the latest."""
    torch.manual_seed(0)
    model = zoo.MLP(din=8, hidden=16, dout=2, depth=1)
    opt = torch.optim.SGD([{"params": model.net[0].parameters(), "lr": 0.1},
                           {"params": model.net[2].parameters(), "lr": 0.01}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    used: list[list[float]] = []                    # each step's lr per group, as the optimizer step read it

    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        used.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
        return loss.detach()
    train(tmp_path, model, opt, step, steps=6)
    assert [lrs[0] for lrs in used] == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1])
    s = Store.open_run(tmp_path)
    con = sqlite3.connect(store_file(tmp_path))
    try:
        stored = con.execute("SELECT p.path, s.step, s.lr FROM param_stats s JOIN params p USING (rank, param_id) "
                             "ORDER BY s.step, p.path").fetchall()
        indexed = dict(con.execute("SELECT path, lr FROM params").fetchall())
    finally:
        con.close()
    group = {"net.0.weight": 0, "net.0.bias": 0, "net.2.weight": 1, "net.2.bias": 1}
    assert stored == [(path, step, pytest.approx(used[step][group[path]]))
                      for step in range(6) for path in sorted(group)]
    assert indexed == {"net.0.weight": 0.0, "net.0.bias": 0.0, "net.2.weight": 0.0, "net.2.bias": 0.0}
    shown = {p["path"]: p["lr"] for m in ("net.0", "net.2") for p in s.module_params(0, by_path(s, m)["module_id"])}
    assert shown == {"net.0.weight": pytest.approx(0.1), "net.0.bias": pytest.approx(0.1),
                     "net.2.weight": pytest.approx(0.01), "net.2.bias": pytest.approx(0.01)}


# -- the queries behind a run of several ranks, on a real store ------------------------------------------------
def test_cross_rank_queries_on_a_real_store(runs):
    """What dashboard.read.run and dashboard.read.crossrank read of each rank, against the real writer's store."""
    r = runs["xor"]
    s = r.store
    assert s.sampled_steps(0) == list(range(STEPS))[::-1] and s.sampled_steps(0, 3) == [STEPS - 1, STEPS - 2, STEPS - 3]
    times = s.step_times(0)
    assert [step for step, _ in times] == list(range(STEPS))[::-1] and all(ms > 0 for _, ms in times)
    values = s.tensor_values(0, STEPS - 1)
    tensors = {p["path"] for m in s.all_modules() for p in s.module_params(0, m["module_id"])}
    assert set(values) <= tensors and "stem.weight" in values
    assert all(dn is not None and dn > 0 for _, dn in values.values())
    history = s.tensor_history(0, ["stem.weight", "no.such.tensor"], STEPS - 4)
    assert list(history) == ["stem.weight"]
    assert [row[0] for row in history["stem.weight"]] == list(range(STEPS - 4, STEPS))
    assert history["stem.weight"][-1][1:] == values["stem.weight"]
    sig = s.findings_signature(0)
    assert sig[0] == len(s.findings(active=None)) and sig == s.findings_signature(0)
    row = s.rank_summary(0)
    assert (row["rank"], row["step"], row["samples_stored"], row["samples_dropped"], row["status"]) == \
        (0, STEPS - 1, STEPS, 0, "closed")
    assert row["median_step_ms"] > 0 and row["hostname"] == socket.gethostname() and row["world_size"] == 1
    found = s.modules_for_paths(0, ["encoder.blocks[1].weight", "stem", "no.such.thing"])
    assert {k: v["path"] for k, v in found.items()} == \
        {"encoder.blocks[1].weight": "encoder.blocks[1]", "stem": "stem", "no.such.thing": ""}
    assert in_wal_mode(store_file(r.run_dir)) is True          # a local filesystem, one host: WAL
    assert last_modified(store_file(r.run_dir)) >= s.overview()["closed_at"] - 1


def test_replica_queries_on_stores_of_two_real_ranks(tmp_path, monkeypatch):
    """What the writer of a rank of a data-parallel job adds (each step's own time, the replicated tensors at
    close), read back: two ranks of one run written in this process (RANK / WORLD_SIZE as torchrun sets them)."""
    monkeypatch.setenv("MODSCOPE_RUN_ID", "pair")
    monkeypatch.setenv("WORLD_SIZE", "2")
    x, y = zoo.xor_data(64)
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr(rundir, "_explicit_uses", {})      # each "rank" is the run's first watch()
        torch.manual_seed(0)
        model = zoo.XORClassifier()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(tmp_path, model, opt, classifier_step(model, opt, x, y), steps=6)
    run = RunDir.open(tmp_path).run()
    assert run.ranks() == [0, 1]
    for rank in (0, 1):
        s = run.at(rank)
        times = s.compute_times(rank)
        assert [step for step, _ in times] == list(range(6))[::-1] and all(ms > 0 for _, ms in times)
        closing = s.close_values(rank)
        assert closing is not None and closing.after_step == 5
        assert {"stem.weight", "head.bias"} <= set(closing.values)
        assert all(fp is not None and dn > 0 for fp, dn in closing.values.values())
        assert closing.values["stem.weight"][1] == pytest.approx(float(model.stem.weight.detach().norm()), rel=1e-5)
    # the same data on both "ranks": identical replicas, nothing cross-rank to say
    assert run.at(0).close_values(0).values == run.at(1).close_values(1).values
    assert run.cross_rank_findings() == []


def test_a_real_run_read_as_a_run(runs, tmp_path):
    """The run directory of a real (one-rank) run through dashboard.read.run: one run, its findings once,
    consequences folded under the root causes the writer named."""
    r = runs["xor"]
    source = RunDir.open(r.run_dir)
    [entry] = source.entries()
    assert entry.files == (store_file(r.run_dir),) and entry.file_ranks == (0,)
    run = source.run()
    assert run.ranks() == [0] and run.run_id() == entry.run_id == s_meta_run_id(r)
    merged = run.findings_merged()
    assert {(f["code"], f["path"]) for f in merged} == {(f.code, f.path) for f in r.findings}
    assert all(f["ranks"] == [0] and not f["cross_rank"] for f in merged)
    roots = fold_causes(merged)
    folded = [c for root in roots for c in root["consequences"]]
    assert len(roots) + len(folded) == len(merged)
    causes = {f.key: f.cause for f in r.findings}
    for root in roots:
        for c in root["consequences"]:
            assert causes[(c["code"], c["path"])] is not None      # only a consequence is folded
    assert [info.ranks for info in source.runs()] == [(0,)]
    assert run.cross_rank_findings() == [] and run.rank_rows()[0]["state"] == "closed"
    snap = tmp_path / "run.sqlite"
    snap.write_bytes(run.snapshot_bytes())
    assert Store.open_snapshot(snap).findings(active=None) == r.store.findings(active=None)
    data, step = run.snapshot_with_step(0)          # the step a download's name gives: the copy's own
    assert step == STEPS - 1 and data[:16] == b"SQLite format 3\x00"
    streamed = tmp_path / "streamed.sqlite"         # the Snapshot button's and `modscope snapshot`'s: written to disk
    assert data_module.snapshot_to(run.snapshot_files(), streamed, 0) == STEPS - 1
    assert Store.open_snapshot(streamed).findings(active=None) == r.store.findings(active=None)


def s_meta_run_id(r: Recorded) -> str:
    return r.store.meta()["run_id"]


# -- every page renders every real store ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["xor", "gpt", "dead", "gan"])
def test_every_page_builder_renders_a_real_store(runs, name):
    s = runs[name].store
    run = RunDir.open(runs[name].run_dir).run()
    ov = run.overview(0)
    assert overview_page.overview_cards(ov)
    assert overview_page.top_findings(run.folded_findings())
    tree, info = modules_page.build_tree(s, 0, s.default_expanded(), None)
    assert tree["rows"] and info.endswith("nodes shown")
    for m in s.all_modules():
        detail = modules_page.detail_full(run, 0, m["module_id"])
        called = bool(s.module_series(0, m["module_id"])["step"])        # a ModuleList is never called
        assert detail.state["module_id"] == m["module_id"] and detail.state["has_data"] == called, m["path"]
        assert detail.state["last"] == (STEPS - 1 if called else None)
    assert findings_page.finding_list(run.folded_findings(active=None), ["error", "warning", "info"])
    report = build_report(run)
    assert ov["run_name"] in report and "<script src" not in report


# -- the contract test covers every query ----------------------------------------------------------------------
def test_every_public_query_is_exercised_here():
    """A query added to the read side (dashboard.read.store) must be read here against real stores too."""
    source = HERE.read_text()
    queries = {name for name, member in inspect.getmembers(Store) if not name.startswith("_") and callable(member)}
    # the read side's functions: those its front door exports, and the comparison of two stores
    functions = {name for name in data_module.__all__ if inspect.isfunction(getattr(data_module, name))}
    functions.add(compare_stores.__name__)
    not_queries = {"one_line", "check_header", "severity_rank", "liveness", "process_alive", "duration_text",
                   "status_text", "snapshot_liveness"}
    assert {"findings", "module_series", "compare_stores", "resolve_store_path"} <= queries | functions
    missing = sorted(n for n in (queries | functions) - not_queries if f"{n}(" not in source)
    assert not missing, f"not exercised against a real store: {missing}"
