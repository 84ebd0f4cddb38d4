"""``modscope checkpoint FILE --run DIR``: a saved state dict against the model a real run describes (a real training
loop under probes.watch, a real SQLite store, real torch.save / safetensors / Lightning files), the command run as a
user runs it (a subprocess). Exit 0 when the file restores the model, 1 when it does not, 2 when a file cannot be read
(one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import probes

REPO = Path(__file__).resolve().parents[2]


def modscope(*args: str, cwd: Path, via_app: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "app.py")] if via_app else [sys.executable, "-m", "dashboard.cli"]
    return subprocess.run([*cmd, "checkpoint", *args], cwd=str(cwd), env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120, check=False)


class PlainListNet(nn.Module):
    """The classic silent bug: three blocks in a plain list run and train, but state_dict() never sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = [nn.Linear(8, 8) for _ in range(3)]
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


class Net(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.body(x))


def train(model: nn.Module, run_dir: Path, steps: int = 3) -> None:
    params = list(model.parameters()) + [p for b in getattr(model, "blocks", []) for p in b.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(steps):
            loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


@pytest.fixture
def net_run(tmp_path):
    model = Net()
    train(model, tmp_path / "run")
    return model, tmp_path / "run"


def test_a_matching_state_dict_loads_completely(net_run, tmp_path):
    model, run = net_run
    torch.save(model.state_dict(), tmp_path / "ok.pt")
    r = modscope(str(tmp_path / "ok.pt"), "--run", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "a state dict, 9 keys" in r.stdout and "9 state_dict keys" in r.stdout     # 6 parameters, 3 buffers
    assert "result: the file loads the model completely" in r.stdout
    r = modscope(str(tmp_path / "ok.pt"), "--run", str(run), cwd=tmp_path, via_app=True)     # python app.py too
    assert r.returncode == 0 and "loads the model completely" in r.stdout, r.stderr


def test_a_plain_list_model_has_weights_no_file_can_hold(tmp_path):
    model = PlainListNet()
    train(model, tmp_path / "run")
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    r = modscope(str(tmp_path / "plain.pt"), "--run", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    # every key state_dict() has is in the file: nothing missing, and still the model cannot be restored
    assert "keys the model needs" not in out
    assert "weights no file can hold: 6 tensors (216 numbers) in 3 unregistered modules" in out
    for i in range(3):
        assert f"blocks[{i}].weight  [8, 8]  in blocks[{i}] (Linear, unregistered)" in out
    assert "result: the file does not restore the model: 6 tensors live outside state_dict()" in out


def test_a_module_prefix_is_named_with_its_fix(net_run, tmp_path):
    model, run = net_run
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "ddp.pt")   # DDP's state_dict
    r = modscope(str(tmp_path / "ddp.pt"), "--run", str(run), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "keys the model needs that the file lacks: 9 (6 trained parameters)" in out
    assert "  head.weight  [4, 16]" in out
    assert "keys the file has that the model lacks: 9" in out and "  module.head.weight" in out
    assert "prefix 'module.': 9 keys of the file are the model's with 'module.' in front (added by " \
           "DistributedDataParallel or DataParallel: the wrapper's state_dict())" in out
    assert "consume_prefix_in_state_dict_if_present(sd, 'module.')" in out and "model.module.state_dict()" in out
    assert "with the prefix fixed, the file loads every key of the model" in out


def test_a_file_without_the_models_prefix(tmp_path):
    """The run watched a wrapper holding the net as .model (a LightningModule); the file is the bare net's."""
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Net()

        def forward(self, x):
            return self.model(x)
    holder = Holder()
    train(holder, tmp_path / "run")
    torch.save(holder.model.state_dict(), tmp_path / "bare.pt")
    r = modscope(str(tmp_path / "bare.pt"), "--run", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 1
    assert "prefix 'model.': 9 keys of the model are the file's with 'model.' in front" in r.stdout
    assert "model.model.load_state_dict(sd)" in r.stdout


def test_shapes_that_differ_show_both_shapes(net_run, tmp_path):
    _, run = net_run
    torch.save(Net(classes=10).state_dict(), tmp_path / "ten.pt")
    r = modscope(str(tmp_path / "ten.pt"), "--run", str(run), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "shapes that differ: 2" in r.stdout
    assert "  head.weight  model [4, 16]  file [10, 16]" in r.stdout
    assert "  head.bias  model [4]  file [10]" in r.stdout
    assert "result: the file does not restore the model: 2 shapes differ" in r.stdout


def test_missing_and_unexpected_keys_of_a_wrapped_checkpoint(net_run, tmp_path):
    """{"model": ..., "optimizer": ..., "epoch": ...}, as training scripts save it; a head renamed."""
    model, run = net_run
    sd = {("fc" + k[4:] if k.startswith("head") else k): v for k, v in model.state_dict().items()}
    torch.save({"model": sd, "optimizer": {}, "epoch": 3}, tmp_path / "ckpt.pth")
    r = modscope(str(tmp_path / "ckpt.pth"), "--run", str(run), cwd=tmp_path)
    assert r.returncode == 1
    assert "a checkpoint's state dict under ['model'], 9 keys" in r.stdout
    assert "keys the model needs that the file lacks: 2 (2 trained parameters)" in r.stdout
    assert "keys the file has that the model lacks: 2\n  fc.bias\n  fc.weight" in r.stdout
    assert "prefix " not in r.stdout


def test_unreadable_files_are_one_line_and_exit_2(net_run, tmp_path):
    _, run = net_run
    (tmp_path / "junk.pt").write_bytes(b"this is not a checkpoint at all")
    torch.save(Net(), tmp_path / "whole_model.pt")                       # a pickled module, not a state dict
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "no_weights.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    (tmp_path / "broken.pt").write_bytes(b"PK\x03\x04 a zip archive cut short")
    cases = {"junk.pt": "junk.pt: not a checkpoint: neither a torch.save file (a zip archive or a pickle) nor a "
                        "safetensors file",
             "broken.pt": "broken.pt: not a checkpoint torch.load can read (RuntimeError: ",
             "whole_model.pt": "whole_model.pt: torch.load(weights_only=True) refuses it",
             "no_weights.pt": "no_weights.pt: holds no state dict: a dict with keys 'epoch', 'lr'",
             "bad.safetensors": "bad.safetensors: not a safetensors file (its header is not JSON)",
             "absent.pt": "absent.pt: no such file"}
    for name, expected in cases.items():
        r = modscope(str(tmp_path / name), "--run", str(run), cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (name, r.stderr)
        assert expected in lines[0], (name, lines[0])
    r = modscope(str(tmp_path / "junk.pt"), "--run", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert r.returncode == 2 and "nowhere" in r.stderr.strip().splitlines()[0]


def test_safetensors_read_from_its_header(net_run, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, run = net_run
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    sd["head.weight"] = torch.zeros(5, 16)
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"))
    r = modscope(str(tmp_path / "model.safetensors"), "--run", str(run), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "model.safetensors: safetensors, 9 keys" in r.stdout
    assert "  head.weight  model [4, 16]  file [5, 16]" in r.stdout


def test_the_command_never_imports_torch(net_run, tmp_path):
    """The dashboard's side runs without torch: a .safetensors file is read from its header, a .pt file by a child
    process (probes/checkpoint_file.py); where that child has no torch, one line says torch is needed."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, run = net_run
    safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                str(tmp_path / "m.safetensors"))
    torch.save(model.state_dict(), tmp_path / "m.pt")
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); "
            "from dashboard.cli import main; sys.exit(main(sys.argv[2:]))")
    for name in ("m.safetensors", "m.pt"):
        r = subprocess.run([sys.executable, "-c", code, str(REPO), "checkpoint", str(tmp_path / name), "--run",
                            str(run)], capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0 and "the file loads the model completely" in r.stdout, (name, r.stdout, r.stderr)
    child = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); "
             "from probes.checkpoint_file import main; sys.exit(main(sys.argv[2:]))")
    r = subprocess.run([sys.executable, "-c", child, str(REPO), str(tmp_path / "m.pt")], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 2 and len(r.stdout.strip().splitlines()) == 1
    assert "m.pt: reading a PyTorch checkpoint needs torch (pip install torch)" in json.loads(r.stdout)["error"]


def test_a_lightning_checkpoint(tmp_path):
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    from probes.integrations.lightning import ModscopeCallback
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,))),
                                       batch_size=8)
    trainer = L.Trainer(max_steps=3, callbacks=[ModscopeCallback(run_dir=tmp_path / "run", every=1)],
                        default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(Module(), data)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    r = modscope(str(tmp_path / "last.ckpt"), "--run", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "a Lightning checkpoint's state dict under ['state_dict'], 9 keys" in r.stdout
    assert "loads the model completely" in r.stdout
    # the bare net's weights against the LightningModule's run: its keys carry 'net.'
    torch.save(trainer.lightning_module.net.state_dict(), tmp_path / "net.pt")
    r = modscope(str(tmp_path / "net.pt"), "--run", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 1 and "prefix 'net.': 9 keys of the model are the file's with 'net.' in front" \
        in r.stdout


def test_a_rank_that_does_not_exist(net_run, tmp_path):
    model, run = net_run
    torch.save(model.state_dict(), tmp_path / "ok.pt")
    r = modscope(str(tmp_path / "ok.pt"), "--run", str(run), "--rank", "3", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "modscope: error: --rank 3: no such rank in this run; " \
                                                     "expected one of 0"


def test_a_sharded_checkpoint_against_a_snapshot(tmp_path):
    """A Hugging Face style sharded checkpoint (model.safetensors.index.json naming two shards), against a snapshot."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    import json
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path / "run", every=1) as w:
        loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
        loss.backward()
        opt.step()
        snap = w.snapshot(tmp_path / "snap.sqlite")
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.bias"}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for shard, keys in shards.items():
        safetensors_torch.save_file({k: sd[k] for k in keys}, str(tmp_path / shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    r = modscope(str(tmp_path / "model.safetensors.index.json"), "--snapshot", str(snap), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "a sharded checkpoint of 2 files, 8 keys" in r.stdout
    assert "keys the model needs that the file lacks: 1 (1 trained parameters)\n  head.bias  [4]" in r.stdout
