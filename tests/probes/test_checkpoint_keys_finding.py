"""A watched model's ``load_state_dict(strict=False)`` that leaves keys of the model unloaded or keys of the file
unused is the ``checkpoint-keys`` finding (an error when trained weights are missing), made from a real load in a real
training loop, stored, and resolved by a later complete load."""

from __future__ import annotations

import copy
import json
import sqlite3

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import probes


class PlainList(nn.Module):
    """Its blocks in a plain list: state_dict() holds the head alone."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = [nn.Linear(8, 8) for _ in range(2)]
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


class Fixed(PlainList):
    """The same model, fixed: the blocks are registered."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(self.blocks)


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.body(x))


def train(model, opt, w, steps=2):
    for _ in range(steps):
        loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)


def keys_findings(w):
    return [f for f in w.findings() if f.code == "checkpoint-keys"]


def test_a_checkpoint_of_the_plain_list_model_loaded_into_the_fixed_one(run_dir):
    """The seeds' warning where it bites: the old checkpoint lacks the blocks; strict=False loads the head alone and
    the trained blocks keep their random initialisation."""
    old = PlainList()
    saved = old.state_dict()                                   # head.weight, head.bias only
    model = Fixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w)
        result = model.load_state_dict(saved, strict=False)
        assert sorted(result.missing_keys) == ["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight"]
        [f] = keys_findings(w)
        assert (f.severity, f.path, f.step, f.count) == ("error", "", 2, 1)
        assert f.evidence["n_missing"] == 4 and f.evidence["n_trained_missing"] == 4 and f.evidence["unexpected"] == []
        assert f.message.startswith("load_state_dict() at step 2 left 4 keys of the model unloaded (4 of them "
                                    "trained parameters that keep the values they had")
        assert "blocks.0.weight" in f.message and "strict=True" in f.fix
        train(model, opt, w, 1)
        assert len(keys_findings(w)) == 1                      # an event: it stays
        model.load_state_dict(model.state_dict())              # a complete load: the evidence of the fix
        assert keys_findings(w) == []
        assert not w.probe_errors
    con = sqlite3.connect(w.store_path)
    rows = con.execute("SELECT severity, active, evidence FROM findings WHERE code = 'checkpoint-keys'").fetchall()
    assert [(s, a) for s, a, _ in rows] == [("error", 0)]      # stored, then resolved
    assert json.loads(rows[0][2])["n_missing"] == 4


def test_a_ddp_checkpoint_loaded_into_the_bare_model_names_the_prefix(run_dir):
    model = WithNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {f"module.{k}": v for k, v in WithNorm().state_dict().items()}
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w)
        model.load_state_dict(saved, strict=False)             # loads nothing at all
        [f] = keys_findings(w)
    # BatchNorm fills a missing num_batches_tracked itself: 8 of the 9 keys are missing
    assert f.severity == "error" and f.evidence["n_missing"] == 8 and f.evidence["n_unexpected"] == 9
    assert f.evidence["prefix"] == "module." and f.evidence["prefix_in_file"] is True
    assert "A prefix explains it: 8 keys of the file are the model's with 'module.' in front" in f.message
    assert "consume_prefix_in_state_dict_if_present(sd, 'module.')" in f.fix


def test_missing_running_statistics_are_a_warning(run_dir):
    model = WithNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {k: v for k, v in WithNorm().state_dict().items() if "running" not in k}
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w)
        model.load_state_dict(saved, strict=False)
        [f] = keys_findings(w)
    assert f.severity == "warning" and f.evidence["missing"] == ["body.1.running_mean", "body.1.running_var"]
    assert "buffers or frozen parameters that keep the values they had" in f.message


def test_unused_keys_of_the_file_alone_are_a_warning(run_dir):
    model = WithNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {**WithNorm().state_dict(), "old_head.weight": torch.zeros(10, 8)}
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        model.load_state_dict(saved, strict=False)             # before the first step: found at step 0
        train(model, opt, w)
        [f] = keys_findings(w)
    assert (f.severity, f.step, f.evidence["unexpected"]) == ("warning", 0, ["old_head.weight"])
    assert "did not use 1 keys of the state dict (old_head.weight)" in f.message


def test_a_strict_load_that_raised_and_was_caught_is_found(run_dir):
    model = Fixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        with pytest.raises(RuntimeError, match="Missing key"):
            model.load_state_dict(PlainList().state_dict())    # strict: raises, after loading the head
        [f] = keys_findings(w)
        assert f.severity == "error"


def test_healthy_loads_give_nothing(run_dir):
    """A complete load, a load through a wrapper, tied weights saved under one name, a part loaded on purpose, and a
    copy of the model (an EMA) loaded: no finding, no probe error."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.out = nn.Linear(8, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(self.emb(x).mean(1))
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(2):
            loss = F.cross_entropy(model(torch.randint(0, 10, (4, 3))), torch.randint(0, 10, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.load_state_dict(model.state_dict())
        model.load_state_dict({"emb.weight": torch.randn(10, 8)}, strict=False)     # "out.weight" is the same tensor
        model.emb.load_state_dict({"weight": torch.randn(10, 8)})                     # a part, loaded on purpose
        ema = copy.deepcopy(model)
        ema.load_state_dict({}, strict=False)                                       # the copy is not watched
        assert keys_findings(w) == []
        assert not w.probe_errors
    assert dict(model._load_state_dict_post_hooks) == {}                            # removed at close


def test_a_load_through_a_wrapper(run_dir):
    """The model is watched inside a wrapper (as DDP holds it in .module); loading the wrapper with the bare model's
    state dict names the wrapper's prefix the other way round."""
    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)
    model = Fixed()
    wrapped = Wrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(wrapped, opt, w)
        wrapped.load_state_dict(Fixed().state_dict(), strict=False)
        [f] = keys_findings(w)
    assert f.severity == "error" and f.evidence["n_trained_missing"] == 6
    assert f.evidence["prefix"] == "module." and f.evidence["prefix_in_file"] is False
    assert "model.module.load_state_dict(sd)" in f.fix
