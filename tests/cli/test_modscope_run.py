"""``modscope run``: training scripts with no modscope code in them, run as real processes through
``python -m dashboard.cli run`` from a folder outside the checkout. The script must see what
``python script.py`` gives it, its exit status and Ctrl-C must pass through, every model it trains
must be watched (a GAN's two, a model built later), and no DataLoader worker may write. Then
``modscope findings`` reads what was found."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WAIT = 120          # upper bound of every wait (never a timed assert)

CLASSIFIER = '''
import argparse, os, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F


class Encoder(nn.Module):
    def __init__(self, width=16, depth=3, fixed=False):
        super().__init__()
        blocks = [nn.Linear(width, width) for _ in range(depth)]
        self.blocks = nn.ModuleList(blocks) if fixed else blocks     # the bug: a plain list

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


class Classifier(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        self.stem = nn.Linear(2, 16)
        self.encoder = Encoder(fixed=fixed)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.encoder(torch.relu(self.stem(x))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fixed", action="store_true")
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--raise", dest="raise_", action="store_true")
    ap.add_argument("--forever", action="store_true")
    args = ap.parse_args()
    print("ARGV", sys.argv)
    print("FILE", __file__)
    print("NAME", __name__)
    print("PATH0", sys.path[0])
    print("PID", os.getpid(), flush=True)
    torch.manual_seed(0)
    X = torch.randn(256, 2)
    y = ((X[:, 0] > 0) ^ (X[:, 1] > 0)).long()
    model = Classifier(fixed=args.fixed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    while args.forever or step < args.steps:
        loss = F.cross_entropy(model(X), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if args.forever:
            if step == 4:
                print("READY", flush=True)
            time.sleep(0.02)
    print(f"LOSS {loss.item():.8f}", flush=True)
    if args.raise_:
        raise RuntimeError("boom from the script")
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
'''

GAN = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


if __name__ == "__main__":
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    for step in range(8):
        real = torch.randn(32, 2) * 0.5 + 1.0
        fake = G(torch.randn(32, 4))
        d_loss = F.binary_cross_entropy_with_logits(D(real), ones) + \\
            F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(D(fake), ones)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    print("GAN DONE")
'''

LATER = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class First(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)


class Second(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(16, 4)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    train(First(), 5)
    train(Second(), 5)       # built after the first model trained: watched too
'''

LOADER = '''
import os, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Points(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.X = torch.randn(64, 2, generator=g)
        self.y = (self.X.sum(1) > 0).long()
        self.augment = nn.Linear(2, 2)       # a module called inside the workers

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        with torch.no_grad():
            x = self.augment(self.X[i])
        return x, self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


if __name__ == "__main__":
    print("PID", os.getpid(), flush=True)
    loader = DataLoader(Points(), batch_size=16, num_workers=2, multiprocessing_context=sys.argv[1],
                        persistent_workers=sys.argv[1] == "spawn")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    print("LOADER DONE", flush=True)
'''


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def env() -> dict[str, str]:
    # the checkout on the path as an install would put the packages there; cwd is elsewhere
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def modscope(*args: str, cwd: Path, timeout: float = WAIT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashboard.cli", *args], cwd=str(cwd), env=env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=str(cwd), env=env(), capture_output=True, text=True,
                          timeout=WAIT, check=False)


def lines(out: str, key: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(key + " ")]


def stores(run_dir: Path) -> list[dict]:
    out = []
    for p in sorted(run_dir.glob("modscope-*-rank*.sqlite")):
        con = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT pid, model_class, step FROM ranks").fetchone()
        finally:
            con.close()
        out.append({"path": p, "pid": row[0], "model_class": row[1], "step": row[2]})
    return out


def findings_json(run_dir: Path, cwd: Path) -> list[dict]:
    r = modscope("findings", "--run", str(run_dir), "--json", cwd=cwd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def work(tmp_path) -> Path:
    d = tmp_path / "work"
    write(d / "sub" / "train.py", CLASSIFIER)
    return d


def test_a_plain_script_runs_as_python_runs_it_and_is_watched(work):
    run_dir = work / "runs" / "r1"
    r = modscope("run", "--run-dir", str(run_dir), "--every", "1", "sub/train.py", "--steps", "8", cwd=work)
    assert r.returncode == 0, r.stderr
    # what `python sub/train.py --steps 8` gives the script (compared with python itself below)
    assert lines(r.stdout, "NAME") == ["__main__"]
    assert lines(r.stdout, "ARGV") == [str(["sub/train.py", "--steps", "8"])]
    assert lines(r.stdout, "FILE") == [str(work / "sub" / "train.py")]
    assert lines(r.stdout, "PATH0") == [str(work / "sub")]
    assert "modscope" not in r.stdout                                  # modscope's lines go to stderr
    assert r.stderr.count(f"modscope: watching Classifier -> {run_dir}") == 1
    (store,) = stores(run_dir)
    assert store["pid"] == int(lines(r.stdout, "PID")[0]) and store["model_class"].endswith("Classifier")

    found = findings_json(run_dir, work)
    unregistered = sorted(f["path"] for f in found if f["code"] == "unregistered-module")
    assert unregistered == ["encoder.blocks"]                   # the plain list: one root cause naming its layers
    f = next(f for f in found if f["path"] == "encoder.blocks" and f["code"] == "unregistered-module")
    assert f["severity"] == "error" and f["ranks"] == [0] and f["message"] and f["fix"]
    assert set(f["steps"]) == {"first", "last", "count"} and f["cause"] is None
    assert set(f) >= {"code", "severity", "path", "message", "fix", "ranks", "steps", "cause"}
    caused = [f for f in found if f["cause"] is not None]
    assert caused and all(set(f["cause"]) == {"code", "path"} for f in caused)

    assert modscope("findings", "--run", str(run_dir), "--fail-on", "error", cwd=work).returncode == 1
    text = modscope("findings", "--run", str(run_dir), cwd=work)
    assert text.returncode == 0 and "unregistered-module  encoder.blocks  " in text.stdout
    assert "explains: error not-updating  encoder.blocks[2].weight" in text.stdout
    r = modscope("findings", "--run", str(run_dir), "--rank", "3", cwd=work)
    assert r.returncode == 2 and r.stderr.strip().endswith("--rank 3: no such rank in this run; expected one of 0")
    # a healthy run passes --fail-on error: tests/packaging/test_wheel.py


ECHO = '''
import os, sys
print("ARGV", sys.argv)
print("FILE", __file__)
print("NAME", __name__)
print("PATH0", sys.path[0])
print("SPEC", __spec__)
print("MAIN", sys.modules["__main__"].__dict__ is globals())
sys.exit(int(sys.argv[1]))
'''


def test_the_script_sees_what_python_gives_it_and_its_exit_status_passes(work):
    write(work / "sub" / "echo.py", ECHO)
    (work / "link.py").symlink_to(work / "sub" / "echo.py")      # sys.path[0] is the real directory
    for script in ("sub/echo.py", "link.py"):
        plain = python(script, "3", "x y", cwd=work)
        r = modscope("run", "--run-dir", str(work / "runs" / "x"), script, "3", "x y", cwd=work)
        assert plain.returncode == r.returncode == 3, r.stderr
        assert r.stdout == plain.stdout and "MAIN True" in r.stdout


def test_exceptions_pass_through(work):
    r = modscope("run", "--run-dir", str(work / "runs" / "y"), "sub/train.py", "--steps", "3", "--raise", cwd=work)
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr and "RuntimeError: boom from the script" in r.stderr
    assert f'File "{work / "sub" / "train.py"}"' in r.stderr
    assert "autorun.py" not in r.stderr and "runpy" not in r.stderr      # only the script's frames
    assert lines(r.stdout, "LOSS")                                        # it ran to the raise


def test_ctrl_c_stops_the_training(work):
    proc = subprocess.Popen([sys.executable, "-m", "dashboard.cli", "run", "--run-dir", str(work / "runs" / "c"),
                             "sub/train.py", "--forever"], cwd=str(work), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stdout:                   # blocks until the script prints (bounded by the timeout below)
            seen.append(line)
            if line.startswith("READY"):
                break
        child = int(lines("".join(seen), "PID")[0])
        proc.send_signal(signal.SIGINT)            # to modscope only: it forwards it to the training
        rc = proc.wait(WAIT)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 128 + signal.SIGINT, err
    assert "KeyboardInterrupt" in err
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_a_gan_and_a_model_built_later_are_all_watched(tmp_path):
    write(tmp_path / "gan.py", GAN)
    write(tmp_path / "later.py", LATER)
    r = modscope("run", "--run-dir", "gan-run", "--every", "1", "gan.py", cwd=tmp_path)
    assert r.returncode == 0 and "GAN DONE" in r.stdout, r.stderr
    assert sorted(s["model_class"].rsplit(".", 1)[1] for s in stores(tmp_path / "gan-run")) == \
        ["Discriminator", "Generator"]
    assert all(s["step"] > 0 for s in stores(tmp_path / "gan-run"))
    assert {"modscope: watching Generator -> gan-run", "modscope: watching Discriminator -> gan-run"} <= \
        set(r.stderr.splitlines())

    r = modscope("run", "--run-dir", "later-run", "--every", "1", "later.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(s["model_class"].rsplit(".", 1)[1] for s in stores(tmp_path / "later-run")) == ["First", "Second"]
    # every run of the directory is read, each finding names its run
    runs = {f["run"] for f in findings_json(tmp_path / "later-run", tmp_path)}
    assert runs <= {s["path"].name.split("-rank")[0][len("modscope-"):] for s in stores(tmp_path / "later-run")}


COMPILED = '''
import torch, torch.nn as nn, torch.nn.functional as F
from torch._dynamo.utils import counters

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
called = torch.compile(model, backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(12):
    loss = F.cross_entropy(called(torch.randn(8, 8)), torch.randint(0, 2, (8,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
print("BREAKS", len(counters["graph_break"]), "RECOMPILES", len(counters["recompiles"]))
'''


def test_a_compiled_model_is_watched_by_its_own_name_without_warnings(tmp_path):
    write(tmp_path / "compiled.py", COMPILED)
    r = modscope("run", "--run-dir", "runs", "--every", "2", "compiled.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout, "BREAKS") == ["0 RECOMPILES 0"]
    assert r.stderr.count("modscope: watching Sequential -> runs") == 1     # not "OptimizedModule"
    assert "global hooks" not in r.stderr                  # torch's warning about the hooks modscope holds
    (store,) = stores(tmp_path / "runs")
    assert store["model_class"].endswith("Sequential") and store["step"] > 0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_are_never_watched(tmp_path, method):
    write(tmp_path / "loader.py", LOADER)
    run_dir = tmp_path / "runs"
    r = modscope("run", "--run-dir", str(run_dir), "--every", "1", "loader.py", method, cwd=tmp_path)
    assert r.returncode == 0 and "LOADER DONE" in r.stdout, r.stderr
    (store,) = stores(run_dir)                   # one writer: the training process
    assert store["pid"] == int(lines(r.stdout, "PID")[0]) and store["model_class"].endswith("Net")
    assert r.stderr.count("modscope: watching") == 1 and "not watching" not in r.stderr


def test_module_form_and_the_runner_never_imports_torch(tmp_path):
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "trainmod.py", CLASSIFIER)
    run_dir = tmp_path / "runs"
    code = ("import sys; from dashboard.cli import main; rc = main(['run', '--run-dir', sys.argv[1], '--every', '1', "
            "'-m', 'pkg.trainmod', '--steps', '6']); print('RUNNER-TORCH', 'torch' in sys.modules); sys.exit(rc)")
    r = python("-c", code, str(run_dir), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout, "RUNNER-TORCH") == ["False"]
    # what `python -m pkg.trainmod --steps 6` gives the module
    assert lines(r.stdout, "NAME") == ["__main__"]
    assert lines(r.stdout, "ARGV") == [str([str(tmp_path / "pkg" / "trainmod.py"), "--steps", "6"])]
    assert lines(r.stdout, "FILE") == [str(tmp_path / "pkg" / "trainmod.py")]
    assert lines(r.stdout, "PATH0") == [str(tmp_path)]
    found = findings_json(run_dir, tmp_path)
    assert any(f["path"] == "encoder.blocks" and f["code"] == "unregistered-module" for f in found)  # the plain list
    # --snapshot DIR: the directory's runs, read-only, as serve and export take it
    snap = modscope("findings", "--snapshot", str(run_dir), "--json", cwd=tmp_path)
    assert snap.returncode == 0 and json.loads(snap.stdout) == found, snap.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_follows_the_run_and_stays_up_until_ctrl_c(work):
    port = free_port()
    err = work / "stderr.log"
    with open(err, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "dashboard.cli", "run", "--run-dir", "runs/s", "--every", "1",
                                 "--serve", "--port", str(port), "sub/train.py", "--steps", "6"], cwd=str(work),
                                env=env(), stdout=subprocess.DEVNULL, stderr=fh)
    try:
        deadline = time.monotonic() + WAIT
        while "stays up until Ctrl-C" not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = err.read_text()
        assert "the training exited with status 0" in text, text
        assert f"modscope dashboard: http://127.0.0.1:{port}/" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT) == 0                 # the training's status
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)


def test_findings_usage_errors_exit_2_with_one_line(tmp_path, work):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        ("findings", "--run", str(empty)): "no store yet",
        ("findings", "--run", str(tmp_path / "missing")): "no such file or directory",
        ("findings", "--snapshot", "/dev/null"): "a character device",
        ("findings", "--run", str(empty), "--fail-on", "fatal"): "invalid choice: 'fatal'",
        ("run", "--every", "0", "x.py"): "--every: '0': expected an integer from 1 to 1,000,000",
        ("run", str(tmp_path / "nothere.py")): "no such file",
    }
    for args, problem in cases.items():
        r = modscope(*args, cwd=work)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and problem in r.stderr, (args, r.stderr)
