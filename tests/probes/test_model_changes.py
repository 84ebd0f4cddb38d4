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
from probes import measure


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
        monkeypatch.setattr(measure, "FREE_READ_DEVICES", frozenset())
        monkeypatch.setattr(measure, "DEFERRED_COPY_DEVICES", {"cpu", "cuda"})
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
