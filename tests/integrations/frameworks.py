"""Shared pieces of the framework tests: the toy network (healthy, or with the seeded bugs), its data, and
readers of a run's store."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# the seeded bugs: two blocks kept in a plain list, and a requires_grad tensor that is no Parameter
BUG_MODULES = {"encoder.blocks"}             # two layers in a plain list: one finding at the list
BUG_TENSOR = "gate"
# findings a validation loop (eval() + no_grad) must never cause
MODE_CODES = {"train-mode-under-no-grad", "train-step-in-eval-mode", "eval-builds-graph", "training-mode-mismatch"}
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")


def build(owner: nn.Module, bug: bool = False, width: int = 16) -> None:
    """Give ``owner`` (a plain module or a LightningModule) the network's layers: a stem, an encoder of two
    blocks, a gate vector, BatchNorm and Dropout (mode-sensitive: validation in train mode would show) and a
    head. With ``bug``: the blocks in a plain list and the gate a plain tensor that requires grad."""
    owner.stem = nn.Linear(8, width)
    owner.norm = nn.BatchNorm1d(width)
    owner.encoder = nn.Module()
    blocks = [nn.Linear(width, width) for _ in range(2)]
    owner.encoder.blocks = blocks if bug else nn.ModuleList(blocks)
    owner.gate = torch.ones(width, requires_grad=True) if bug else nn.Parameter(torch.ones(width))
    owner.drop = nn.Dropout(0.1)
    owner.head = nn.Linear(width, 2)


def forward(owner: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(owner.norm(owner.stem(x)))
    for block in owner.encoder.blocks:
        h = torch.relu(block(h))
    return owner.head(owner.drop(h * owner.gate))


class Net(nn.Module):
    """The toy network as a plain module (accelerate); ``labels`` gives a dict with the loss (HF Trainer)."""

    def __init__(self, bug: bool = False) -> None:
        super().__init__()
        build(self, bug)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        logits = forward(self, x)
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def loader(n: int = 64, batch_size: int = 8) -> torch.utils.data.DataLoader:
    x, y = data(n)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class DictDataset(torch.utils.data.Dataset):
    """For the HF Trainer: dicts of ``x`` and ``labels``."""

    def __init__(self, n: int = 64) -> None:
        self.x, self.y = data(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


# ------------------------------------------------------------------------------------------- the store
def query(store: str | Path, sql: str, *args):
    con = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def steps(store) -> list[tuple[int, float | None]]:
    """(step, loss) of every step the store recorded."""
    return query(store, "SELECT step, loss FROM steps ORDER BY step")


def status(store) -> str:
    return query(store, "SELECT status FROM ranks")[0][0]


def paths(store) -> list[str]:
    return [p for (p,) in query(store, "SELECT path FROM modules UNION ALL SELECT path FROM params")]


def grad_norms(store, path: str) -> list[float | None]:
    return [g for (g,) in query(store, "SELECT s.grad_norm FROM param_stats s JOIN params p USING (rank, param_id) "
                                       "WHERE p.path = ? ORDER BY s.step", path)]


def codes(findings, severity=None) -> set[tuple[str, str]]:
    return {(f.code, f.path) for f in findings if severity is None or f.severity == severity}


def unregistered(findings) -> set[str]:
    return {f.path for f in findings if f.code == "unregistered-module"}


def assert_user_paths(store) -> None:
    bad = [p for p in paths(store) if p.startswith(WRAPPER_PREFIXES)]
    assert not bad, f"wrapper prefixes in stored paths: {bad[:5]}"


def assert_healthy(findings) -> None:
    """No finding but the informational: the healthy network trained under the framework's machinery."""
    loud = [str(f) for f in findings if f.severity != "info"]
    assert not loud, "\n".join(loud)


def assert_bugs_found(findings) -> None:
    errors = codes(findings, "error")
    assert unregistered(findings) == BUG_MODULES
    assert ("unregistered-module", "encoder.blocks") in errors
    assert ("unregistered-tensor", BUG_TENSOR) in errors


def inject_inf(param: torch.Tensor, at_calls: set[int]):
    """A gradient hook that turns ``param``'s gradient into inf at the given backward calls (0-based): an
    fp16 overflow, which makes a GradScaler skip that optimizer step."""
    calls = [0]

    def hook(grad: torch.Tensor):
        n = calls[0]
        calls[0] += 1
        return torch.full_like(grad, float("inf")) if n in at_calls else None
    return param.register_hook(hook)
