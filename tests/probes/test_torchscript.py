"""A TorchScript submodule (``torch.jit.script``) refuses per-module hooks and runs its children in
TorchScript, where no hook sees them: watching such a model must not fail, must not call the children
bypassed, and must not change the training. A scripted root gets one clear error."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from helpers import stored, train

import probes


def scripted_model() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)      # torch.jit.script is deprecated, still used
        inner = torch.jit.script(nn.Sequential(nn.Linear(16, 16), nn.ReLU()))
    return nn.Sequential(nn.Linear(8, 16), inner, nn.Linear(16, 3))


def batch():
    return torch.randn(8, 8), torch.randint(0, 3, (8,))


def test_a_scripted_submodule_is_watched_and_training_is_unchanged(run_dir):
    torch.manual_seed(0)
    model = scripted_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    bare = train(model, opt, None, 4, batch)
    torch.manual_seed(0)
    model = scripted_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        torch.manual_seed(1)
        watched = train(model, opt, w, 4, batch)
        assert not w.probe_errors
        assert [(f.code, f.path) for f in w.findings() if f.severity != "info"] == []
    assert torch.equal(torch.stack(bare), torch.stack(watched))
    rows = dict(stored(w, "SELECT m.path, COUNT(s.step) FROM modules m LEFT JOIN module_stats s "
                          "ON s.module_id = m.module_id GROUP BY m.path"))
    assert rows["1"] == 4 and rows["0"] == 4           # the scripted module's own calls are measured


def test_a_scripted_model_is_refused_with_one_line():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.script(nn.Sequential(nn.Linear(8, 2)))
    with pytest.raises(TypeError, match=r"^model is a TorchScript module \(RecursiveScriptModule\): .*before "
                                        r"torch\.jit\.script") as info:
        probes.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "\n" not in str(info.value)
