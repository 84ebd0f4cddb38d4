"""The distribution: a wheel built from the checkout, installed into a folder of its own, used from
a folder outside the checkout as a new user would: a training script that imports probes, a
script with no modscope code run through ``modscope run``, ``modscope findings`` failing a CI job,
``modscope serve`` with its assets, and ``import probes`` without torch."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
import wheel_site

from probes import TORCH_HINT

WAIT = 120

USER_SCRIPT = '''
import sys
import torch
import torch.nn.functional as F
import probes
import dashboard

model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with probes.watch(model, opt, run_dir="user-run", every=1) as w:
    for _ in range(5):
        x = torch.randn(16, 4)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        w.step(loss)
    w.snapshot("user.sqlite")
print("PROBES", probes.__file__)
print("DASHBOARD", dashboard.__file__)
print("STEPS", w.step_count)
print("PATH", sys.path)
'''

# no modscope code: the encoder keeps its Linear layers in a plain list (--fixed: an nn.ModuleList)
PLAIN_SCRIPT = '''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F


class Encoder(nn.Module):
    def __init__(self, fixed):
        super().__init__()
        blocks = [nn.Linear(16, 16) for _ in range(3)]
        self.blocks = nn.ModuleList(blocks) if fixed else blocks

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


class Classifier(nn.Module):
    def __init__(self, fixed):
        super().__init__()
        self.stem, self.encoder, self.head = nn.Linear(2, 16), Encoder(fixed), nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.encoder(torch.relu(self.stem(x))))


if __name__ == "__main__":
    torch.manual_seed(0)
    X = torch.randn(256, 2)
    y = ((X[:, 0] > 0) ^ (X[:, 1] > 0)).long()
    model = Classifier(fixed="--fixed" in sys.argv)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(8):
        loss = F.cross_entropy(model(X), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("TRAINED")
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> wheel_site.Site:
    return wheel_site.build_and_install(tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    d = tmp_path / "user"
    d.mkdir()
    (d / "train.py").write_text(textwrap.dedent(PLAIN_SCRIPT))
    (d / "user_train.py").write_text(textwrap.dedent(USER_SCRIPT))
    return d


def run(cmd: list[str], site: wheel_site.Site, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=str(cwd), env=site.env(**env), capture_output=True, text=True, timeout=WAIT,
                          check=False)


def test_the_wheel_holds_both_packages_the_assets_and_the_console_script(site):
    with zipfile.ZipFile(site.wheel) as zf:
        names = set(zf.namelist())
        dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist}/entry_points.txt").decode()
        metadata = zf.read(f"{dist}/METADATA").decode()
    for name in ("probes/__init__.py", "probes/schema.py", "probes/launch/autorun.py", "probes/launch/autowatch.py",
                 "probes/findings/rules/__init__.py", "probes/notebook.py", "dashboard/cli.py",
                 "dashboard/commands/findings.py", "dashboard/web/pages/__init__.py",
                 "dashboard/assets/modscope.css", "dashboard/assets/modscope.js", "dashboard/assets/report.css",
                 "dashboard/demo_train.py"):
        assert name in names, name
    assert not [n for n in names if n.startswith(("tests/", "examples/", "bench/"))]
    assert "modscope = dashboard.cli:main" in entry_points
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.startswith("Requires-Dist: dash") for r in requires)
    # torch is no hard dependency: only an extra
    assert all("torch" not in r or "extra ==" in r for r in requires), requires


def test_a_user_script_elsewhere_imports_probes_from_the_wheel(site, elsewhere):
    r = run([sys.executable, "user_train.py"], site, elsewhere)
    assert r.returncode == 0, r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert out["PROBES"] == str(site.root / "probes" / "__init__.py")
    assert out["DASHBOARD"] == str(site.root / "dashboard" / "__init__.py")
    assert str(wheel_site.REPO) not in out["PATH"]
    assert out["STEPS"] == "5"
    assert len(list((elsewhere / "user-run").glob("modscope-*-rank0.sqlite"))) == 1

    # serve the snapshot: the page and the assets come from the installed package
    port = free_port()
    proc = subprocess.Popen([*site.modscope(), "serve", "--snapshot", "user.sqlite", "--port", str(port)],
                            cwd=str(elsewhere), env=site.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(base + "/", proc)
        for path in ("/", "/assets/modscope.css", "/assets/modscope.js"):
            with urllib.request.urlopen(base + path, timeout=10) as resp:
                assert resp.status == 200, path
                assert resp.read(), path
    finally:
        proc.terminate()
        proc.wait(15)

    r = run([*site.modscope(), "export", "--snapshot", "user.sqlite", "-o", "report.html"], site, elsewhere)
    assert r.returncode == 0, r.stderr
    css = (site.root / "dashboard" / "assets" / "report.css").read_text()
    assert css.strip().splitlines()[0] in (elsewhere / "report.html").read_text()


def test_modscope_run_and_findings_fail_a_ci_job(site, elsewhere):
    modscope = site.modscope()
    r = run([*modscope, "run", "--run-dir", "buggy", "--every", "1", "train.py"], site, elsewhere)
    assert r.returncode == 0 and "TRAINED" in r.stdout, r.stderr
    assert "modscope: watching Classifier -> buggy" in r.stderr

    r = run([*modscope, "findings", "--run", "buggy", "--json"], site, elsewhere)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert sorted(f["path"] for f in found if f["code"] == "unregistered-module") == ["encoder.blocks"]
    assert run([*modscope, "findings", "--run", "buggy", "--fail-on", "error"], site, elsewhere).returncode == 1

    r = run([*modscope, "run", "--run-dir", "fixed", "--every", "1", "train.py", "--fixed"], site, elsewhere)
    assert r.returncode == 0, r.stderr
    r = run([*modscope, "findings", "--run", "fixed", "--fail-on", "error"], site, elsewhere)
    assert r.returncode == 0, r.stdout + r.stderr


BLOCK_TORCH = "import sys; sys.modules['torch'] = None; "


def test_without_torch_probes_says_how_to_install_it_and_the_dashboard_works(site, elsewhere):
    code = BLOCK_TORCH + textwrap.dedent('''
        try:
            import probes
        except ModuleNotFoundError as exc:
            print(repr(str(exc)))
        import probes.schema
        print(probes.schema.SCHEMA_VERSION)
    ''')
    r = run([sys.executable, "-c", code], site, elsewhere)
    assert r.returncode == 0, r.stderr
    hint, version = r.stdout.splitlines()
    assert hint == repr(TORCH_HINT) and "\n" not in TORCH_HINT and "pip install torch" in TORCH_HINT
    assert version.isdigit()

    r = run([sys.executable, "user_train.py"], site, elsewhere)      # a snapshot to read
    assert r.returncode == 0, r.stderr
    code = BLOCK_TORCH + ("from dashboard.cli import main; rc = main(['findings', '--snapshot', 'user.sqlite']); "
                          "assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]; sys.exit(rc)")
    r = run([sys.executable, "-c", code], site, elsewhere)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("user.sqlite: ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the dashboard exited with {proc.returncode}: {proc.stdout.read().decode()}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer")
