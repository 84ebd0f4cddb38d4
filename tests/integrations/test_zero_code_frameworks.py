"""``modscope run`` on a Lightning script and on a Hugging Face Trainer script (no modscope code in them)
finds the same bugs as the callbacks do: the runner adds the framework's callback to the Trainer that
steps the optimizer it discovers (probes.integrations.zero_code)."""
from __future__ import annotations

import json
import os
import runpy
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WAIT = 240

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


def build(owner):
    """Two blocks kept in a plain list, a gate that is a plain tensor: the seeded bugs."""
    owner.stem = nn.Linear(8, 16)
    owner.encoder = nn.Module()
    owner.encoder.blocks = [nn.Linear(16, 16) for _ in range(2)]
    owner.gate = torch.ones(16, requires_grad=True)
    owner.head = nn.Linear(16, 2)


def forward(owner, x):
    h = torch.relu(owner.stem(x))
    for block in owner.encoder.blocks:
        h = torch.relu(block(h))
    return owner.head(h * owner.gate)


def data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] > 0).long()
'''

LIGHTNING = MODEL + '''
import lightning.pytorch as L


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        build(self)

    def forward(self, x):
        return forward(self, x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(callbacks=()):
    torch.manual_seed(0)
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, accumulate_grad_batches=2,
                        callbacks=list(callbacks))
    trainer.fit(Net(), loader, loader)


if __name__ == "__main__":
    main()
'''

TRAINER = MODEL + '''
import sys
import tempfile
import transformers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        build(self)

    def forward(self, x, labels=None):
        logits = forward(self, x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = data()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def main(callbacks=()):
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, report_to="none", use_cpu=True,
                                              per_device_train_batch_size=8, gradient_accumulation_steps=2,
                                              num_train_epochs=2, save_strategy="no", disable_tqdm=True,
                                              logging_strategy="no", seed=0)
        trainer = transformers.Trainer(model=Net(), args=args, train_dataset=Data(), callbacks=list(callbacks))
        trainer.train()


if __name__ == "__main__":
    main()
'''


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error")


def modscope(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashboard.cli", *args], cwd=str(cwd), env=env(),
                          capture_output=True, text=True, timeout=WAIT, check=False)


def zero_code(script: Path, run_dir: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    r = modscope("run", "--run-dir", str(run_dir), "--every", "1", script.name, cwd=script.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    f = modscope("findings", "--run", str(run_dir), "--json", cwd=script.parent)
    assert f.returncode == 0, f.stderr
    return r, json.loads(f.stdout)


def with_callback(script: Path, callback) -> list:
    """The same script in this process, its main() given the callback by hand."""
    runpy.run_path(str(script), run_name="modscope_test_script")["main"](callbacks=[callback])
    return callback.watcher.findings()


def errors(findings) -> set[tuple[str, str]]:
    return {(f["code"], f["path"]) if isinstance(f, dict) else (f.code, f.path)
            for f in findings if (f["severity"] if isinstance(f, dict) else f.severity) == "error"}


def unregistered(findings) -> set[str]:
    return {p for c, p in errors(findings) if c == "unregistered-module"}


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_modscope_run_finds_what_the_callback_finds(framework, tmp_path):
    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    if framework == "transformers":
        pytest.importorskip("accelerate")
    script = tmp_path / "work" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(LIGHTNING if framework == "lightning" else TRAINER))
    run_dir = tmp_path / "runs" / "zero"
    r, found = zero_code(script, run_dir)
    assert r.stderr.count(f"modscope: watching Net -> {run_dir}") == 1
    assert unregistered(found) == {"encoder.blocks"}
    assert ("unregistered-tensor", "gate") in errors(found)
    # the framework's callback watched (a plain watch records no loss: the script passes none)
    (store,) = run_dir.glob("modscope-*-rank0.sqlite")
    con = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        losses = [loss for (loss,) in con.execute("SELECT loss FROM steps ORDER BY step")]
    finally:
        con.close()
    assert losses and all(loss is not None for loss in losses)

    if framework == "lightning":
        from probes.integrations.lightning import ModscopeCallback
    else:
        from probes.integrations.transformers import ModscopeCallback
    by_hand = with_callback(script, ModscopeCallback(run_dir=tmp_path / "runs" / "callback", every=1))
    assert errors(found) == errors(by_hand)
