"""The model changes while it is watched: a head added (progressive growing, a new task), a block swapped for
another, a module deleted. The index is rebuilt and everything goes on: no probe error, no false finding, the new
module measured under its own path, and what the change really broke (an optimizer still holding the deleted
module's parameters) reported.

Each case runs with every step sampled and with every=5, and on the accelerator's path too (the sample read at a
later step boundary, so more steps run on the old index)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import codes, stored

import probes
from probes.capture import host_values
from probes.model import tensors
from probes.watcher import _lost_writes


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.1)
        self.heads = nn.ModuleList([nn.Linear(16, 2)])
        self.aux = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        h = self.drop(h) if hasattr(self, "drop") else h
        out = sum(head(h) for head in self.heads)
        return out + self.aux(h) if hasattr(self, "aux") else out


def steps(model, opt, w, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)


@pytest.fixture(params=["cpu", "accelerator"])
def read_path(request, monkeypatch):
    if request.param == "accelerator":
        monkeypatch.setattr(tensors, "FREE_READ_DEVICES", frozenset())
        monkeypatch.setattr(host_values, "DEFERRED_COPY_DEVICES", {"cpu", "cuda"})
    return request.param


def serious(w):
    return codes(w.findings(), "error") | codes(w.findings(), "warning")


@pytest.mark.parametrize("every", [1, 5])
def test_a_head_added_mid_run_is_indexed_and_measured(tmp_path, read_path, every):
    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=every) as w:
        steps(model, opt, w, 5)                                      # steps 0-4
        model.heads.append(nn.Linear(16, 2))
        opt.add_param_group({"params": model.heads[1].parameters()})
        steps(model, opt, w, 16, seed=1)                             # steps 5-20
        assert w.probe_errors == {}
        assert serious(w) == set()
        with torch.no_grad():
            model.body.weight[0, 0] = float("nan")                  # findings are still evaluated, and located
        steps(model, opt, w, 5, seed=2)                              # steps 21-25 (one sampled at every=5)
        (nan,) = [f for f in w.findings() if f.code == "non-finite"]
        # every step sampled: located at its origin; at every=5 the first NaN came in an unsampled step (at the
        # loss), the modules it reached are named
        assert nan.path == "body" if every == 1 else "body" in nan.evidence["later"]
    assert stored(w, "SELECT path, kind FROM modules WHERE path LIKE 'heads.%' OR kind = 'runtime' ORDER BY path") \
        == [("heads.0", "registered"), ("heads.1", "registered")]
    assert stored(w, "SELECT COUNT(*) FROM findings WHERE code = 'unregistered-module'") == [(0,)]
    measured = [s for s, in stored(w, "SELECT s.step FROM module_stats s JOIN modules m USING (rank, module_id) "
                                      "WHERE m.path = 'heads.1' ORDER BY s.step")]
    sampled = [s for s, in stored(w, "SELECT step FROM steps WHERE sampled = 1 AND step > 5 ORDER BY step")]
    assert measured and measured == [s for s in sampled if s >= measured[0]] and measured[0] <= 10
    assert stored(w, "SELECT in_optimizer, opt_group FROM params WHERE path = 'heads.1.weight'") == [(1, 1)]


def test_a_module_swapped_for_another_is_the_same_path(tmp_path, read_path):
    """A Dropout replaced by another (no parameters: the index's signature of parameters does not change)."""
    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        steps(model, opt, w, 5)
        model.drop = nn.Dropout(0.3)
        steps(model, opt, w, 10, seed=1)
        assert w.probe_errors == {} and serious(w) == set()
    assert stored(w, "SELECT COUNT(*) FROM modules WHERE kind = 'runtime'") == [(0,)]
    assert stored(w, "SELECT COUNT(*) FROM findings WHERE code = 'unregistered-module'") == [(0,)]
    drop = [s for s, in stored(w, "SELECT s.step FROM module_stats s JOIN modules m USING (rank, module_id) "
                                  "WHERE m.path = 'drop' ORDER BY s.step")]
    assert drop[:5] == [0, 1, 2, 3, 4] and drop[-1] == 14          # measured before and after, under one path


def test_modules_deleted_while_the_optimizer_holds_parameters_of_one(tmp_path, read_path):
    """Two modules deleted, one in the middle of the tree: the modules after it move up in the walk's order but
    keep their ids."""
    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        steps(model, opt, w, 5)
        del model.drop, model.aux
        steps(model, opt, w, 10, seed=1)
        assert w.probe_errors == {}
        found = serious(w)
    assert {code for code, _ in found} == {"stale-optimizer-param"} and len(found) == 2     # aux.weight, aux.bias


def test_a_deleted_module_leaves_the_stored_model_and_keeps_its_history(tmp_path, read_path):
    """The deleted modules and their tensors are marked with the step the index was rebuilt without them: the rows,
    their statistics and findings stay (what a user investigates), but they are no longer the model."""
    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        steps(model, opt, w, 5)
        del model.drop, model.aux
        steps(model, opt, w, 10, seed=1)
    gone = stored(w, "SELECT path, removed_step FROM modules WHERE removed_step IS NOT NULL ORDER BY path")
    assert [p for p, _ in gone] == ["aux", "drop"] and {s for _, s in gone} <= {5, 6}
    assert stored(w, "SELECT path FROM params WHERE removed_step IS NOT NULL ORDER BY path") == \
        [("aux.bias",), ("aux.weight",)]
    assert stored(w, "SELECT path FROM modules WHERE removed_step IS NULL ORDER BY path") == \
        [("",), ("body",), ("heads",), ("heads.0",)]
    history = stored(w, "SELECT s.step FROM module_stats s JOIN modules m USING (rank, module_id) "
                        "WHERE m.path = 'aux' ORDER BY s.step")
    assert [s for s, in history] == [0, 1, 2, 3, 4]                 # measured until it left
    assert stored(w, "SELECT params_total FROM modules WHERE path = ''") == [(16 * 8 + 16 + 16 * 2 + 2,)]


def test_a_module_replaced_at_its_path_is_a_new_module(tmp_path, read_path):
    """``model.aux = nn.Linear(...)``: the same path, another module (the head swapped after the optimizer was
    built). The one replaced keeps its id, rows and history, marked removed; the new one has a new id, its own
    first step, tensors and findings."""
    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        steps(model, opt, w, 5)
        model.aux = nn.Linear(16, 2)
        steps(model, opt, w, 10, seed=1)
        found = {(f.code, f.path) for f in w.findings()}
    rows = stored(w, "SELECT module_id, first_step, removed_step FROM modules WHERE path = 'aux' ORDER BY module_id")
    assert len(rows) == 2
    (old, old_first, old_gone), (new, new_first, new_gone) = rows
    assert old_first == 0 and old_gone in (5, 6) and new_first == old_gone and new_gone is None
    history = {mid: [s for s, in stored(w, f"SELECT step FROM module_stats WHERE module_id = {mid} ORDER BY step")]
               for mid in (old, new)}
    assert history[old] == [0, 1, 2, 3, 4] and history[new][-1] == 14 and history[new][0] >= 5
    tensors = stored(w, "SELECT module_id, in_optimizer, removed_step IS NULL FROM params WHERE path = 'aux.weight' "
                        "ORDER BY param_id")
    assert tensors == [(old, 1, 0), (new, 0, 1)]
    assert ("not-in-optimizer", "aux.weight") in found
    assert stored(w, "SELECT module_id FROM findings WHERE code = 'not-in-optimizer' AND path = 'aux.weight'") == \
        [(new,)]


def test_a_module_put_back_is_part_of_the_model_again(tmp_path):
    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        steps(model, opt, w, 3)
        aux = model.aux
        del model.aux
        steps(model, opt, w, 3, seed=1)
        w._writer.flush()
        assert stored(w, "SELECT removed_step FROM modules WHERE path = 'aux'") == [(3,)]
        # what a failed commit held is written again: the removal too
        assert any(sql.startswith("UPDATE modules SET removed_step") for sql, _ in _lost_writes(w))
        model.aux = aux
        steps(model, opt, w, 3, seed=2)
    assert stored(w, "SELECT removed_step FROM modules WHERE path = 'aux'") == [(None,)]
    assert stored(w, "SELECT COUNT(*) FROM params WHERE removed_step IS NOT NULL") == [(0,)]


def test_a_truncated_walk_removes_no_unregistered_module():
    """A walk over the model's attributes that stopped early (too many objects) did not see every unregistered module
    or tensor: those it missed are not taken for removed; registered ones (model.modules()) still are."""
    from types import SimpleNamespace as NS

    from probes.model.index import Presence

    def index(modules, tensors, truncated=False):
        return NS(structure=NS(walk_truncated=truncated), modules={i: NS(kind=k) for i, k in modules.items()},
                  tensors={i: NS(registered=r) for i, r in tensors.items()})
    p = Presence()
    assert p.update(index({0: "registered", 1: "unregistered", 2: "registered"}, {0: False, 1: True}), 3) == ({}, {})
    assert p.update(index({0: "registered"}, {}, truncated=True), 7) == ({2: 7}, {1: 7})
    assert p.update(index({0: "registered"}, {}), 9) == ({1: 9}, {0: 9})           # a full walk: gone indeed
    assert p.removed_modules == {1: 9, 2: 7} and p.removed_tensors == {0: 9, 1: 7}
    assert p.update(index({0: "registered", 2: "registered"}, {1: True}), 12) == ({}, {})      # back
    assert p.removed_modules == {1: 9} and p.removed_tensors == {0: 9}


class Blocks(nn.Module):
    """Residual blocks in a ModuleList; ``dead``: the last one's units 0-7 dead (a bias far below zero before its
    ReLU)."""

    def __init__(self, n: int = 4, dead: bool = True) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(n)])
        self.head = nn.Linear(16, 2)
        if dead:
            with torch.no_grad():
                self.blocks[n - 1][0].bias[:8] = -100.0

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def ids_by_path(w, table="modules", key="module_id"):
    """The ids of the rows that are part of the model now, by path (what the writer has committed)."""
    w._writer.flush()
    return dict(stored(w, f"SELECT path, {key} FROM {table} WHERE removed_step IS NULL"))


def test_a_module_that_only_moved_keeps_its_id_and_history(tmp_path, read_path):
    """``model.blocks.pop(2)``: the block popped leaves the model; the block after it only moves (the same object,
    from ``blocks.3`` to ``blocks.2``) and stays the module it was: its id, first step and statistics go on under its
    new path, and so do its submodules' and its tensors'. Its dead units are reported at its new path."""
    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        steps(model, opt, w, 40)
        assert ("dead-units", "blocks.3.1") in codes(w.findings())
        before, tensors_before = ids_by_path(w), ids_by_path(w, "params", "param_id")
        model.blocks.pop(2)
        steps(model, opt, w, 20, seed=1)
        found = codes(w.findings())
        assert w.probe_errors == {}
    moved = {p: before[p.replace("blocks.2", "blocks.3", 1)] for p in ("blocks.2", "blocks.2.0", "blocks.2.1")}
    popped = {before[p] for p in ("blocks.2", "blocks.2.0", "blocks.2.1")}
    after = ids_by_path(w)
    assert {p: after[p] for p in moved} == moved
    assert not [p for p in after if p.startswith("blocks.3")]
    assert stored(w, "SELECT path FROM modules WHERE path LIKE 'blocks.3%'") == []      # its row says where it is
    # only what was popped is removed, at the step the index was rebuilt without it
    gone = stored(w, "SELECT module_id, path, removed_step FROM modules WHERE removed_step IS NOT NULL")
    assert {mid for mid, _, _ in gone} == popped and {s for _, _, s in gone} <= {40, 41}
    assert sorted(p for _, p, _ in gone) == ["blocks.2", "blocks.2.0", "blocks.2.1"]
    # its history goes on under one id: every step measured, first seen at step 0
    for mid in moved.values():
        assert [s for s, in stored(w, f"SELECT step FROM module_stats WHERE module_id = {mid} ORDER BY step")] == \
            list(range(60))
        assert stored(w, f"SELECT first_step FROM modules WHERE module_id = {mid}") == [(0,)]
    # its tensors moved with it: the same ids, their paths the new ones
    assert {p: ids_by_path(w, "params", "param_id")[p] for p in ("blocks.2.0.weight", "blocks.2.0.bias")} == \
        {p: tensors_before[p.replace("blocks.2", "blocks.3", 1)] for p in ("blocks.2.0.weight", "blocks.2.0.bias")}
    assert sorted(p for p, in stored(w, "SELECT path FROM params WHERE removed_step IS NOT NULL")) == \
        ["blocks.2.0.bias", "blocks.2.0.weight"]
    tid = tensors_before["blocks.3.0.weight"]
    assert [s for s, in stored(w, f"SELECT step FROM param_stats WHERE param_id = {tid} ORDER BY step")] == \
        list(range(60))
    # the finding about its dead units is about it at its new path now; the one at the old path is resolved
    assert ("dead-units", "blocks.2.1") in found and ("dead-units", "blocks.3.1") not in found
    assert stored(w, "SELECT module_id, active FROM findings WHERE code = 'dead-units' AND path = 'blocks.2.1'") == \
        [(moved["blocks.2.1"], 1)]
    assert stored(w, "SELECT active FROM findings WHERE code = 'dead-units' AND path = 'blocks.3.1'") == [(0,)]


def test_modules_shifted_by_an_insert_keep_their_ids(tmp_path, read_path):
    """``ModuleList.insert(0, ...)`` moves every block one place down: each keeps its id and history; only the one
    inserted is new. Two blocks that trade places keep theirs too."""
    torch.manual_seed(0)
    model = Blocks(3, dead=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        steps(model, opt, w, 5)
        before = ids_by_path(w)
        model.blocks.insert(0, nn.Sequential(nn.Linear(16, 16), nn.ReLU()))
        opt.add_param_group({"params": model.blocks[0].parameters()})
        steps(model, opt, w, 5, seed=1)
        shifted = ids_by_path(w)
        model.blocks[1], model.blocks[2] = model.blocks[2], model.blocks[1]
        steps(model, opt, w, 5, seed=2)
        assert w.probe_errors == {} and serious(w) == set()
    for i in range(3):
        for sub in ("", ".0", ".1"):
            assert shifted[f"blocks.{i + 1}{sub}"] == before[f"blocks.{i}{sub}"]
    new = {shifted[p] for p in ("blocks.0", "blocks.0.0", "blocks.0.1")}
    assert new.isdisjoint(before.values())
    assert stored(w, "SELECT COUNT(*) FROM modules WHERE removed_step IS NOT NULL") == [(0,)]
    assert stored(w, "SELECT COUNT(*) FROM params WHERE removed_step IS NOT NULL") == [(0,)]
    first = dict(stored(w, "SELECT module_id, first_step FROM modules"))
    assert {first[mid] for mid in before.values()} == {0} and {first[mid] for mid in new} <= {5, 6}
    assert len(first) == len(before) + 3
    swapped = ids_by_path(w)
    assert (swapped["blocks.1"], swapped["blocks.2"]) == (shifted["blocks.2"], shifted["blocks.1"])
    assert (swapped["blocks.1.0"], swapped["blocks.2.0"]) == (shifted["blocks.2.0"], shifted["blocks.1.0"])
    mid = before["blocks.0"]
    assert [s for s, in stored(w, f"SELECT step FROM module_stats WHERE module_id = {mid} ORDER BY step")] == \
        list(range(15))


@pytest.mark.parametrize("every", [1, 2])
def test_parameters_frozen_between_steps_break_no_sample(tmp_path, every):
    """The backbone frozen before step 3 (progressive freezing, TENT after supervised steps): the step armed with
    the index of before attaches no gradient hook to a tensor that no longer requires grad (which raised, and lost
    the sample); the frozen layers are then reported frozen."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=tmp_path / "run", every=every) as w:
        for step in range(8):
            if step == 3:
                model[0].requires_grad_(False)
                model[2].requires_grad_(False)
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert w.probe_errors == {}
        assert {f.path for f in w.findings() if f.code == "frozen-parameter"} == {"0", "2"}
