"""``modscope run`` gives the script the ``sys.path`` Python gives it (``python /abs/train.py``: the script's
folder first, the working folder nowhere; ``-m``: the working folder first), and what the working folder holds
cannot stand in for modscope's own modules: an ``argparse.py``, a ``probes/`` and a ``dashboard/`` package of the
user's, a ``helper.py`` that is not the script's. Real processes, started through a console script as an installed
``modscope`` is (the checkout on ``PYTHONPATH`` stands for site-packages)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WAIT = 120

TRAIN = '''
import json, sys
import torch, torch.nn as nn, torch.nn.functional as F
import helper
print("HELPER", helper.WHO)
print("SYSPATH", json.dumps(sys.path))
torch.manual_seed(0)        # an unlucky draw leaves a ReLU of four units dead: a finding this test does not want
m = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(6):
    loss = F.mse_loss(m(torch.randn(8, 2)), torch.zeros(8, 1))
    opt.zero_grad(); loss.backward(); opt.step()
print("DONE", flush=True)
'''


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def folders(tmp_path) -> tuple[Path, Path, Path]:
    """(the working folder full of look-alikes, the script's folder, the console script)."""
    work, code = tmp_path / "work", tmp_path / "code"
    write(work / "argparse.py", 'raise SystemExit("the working folder\'s argparse.py was imported")\n')
    write(work / "probes" / "__init__.py", 'raise SystemExit("the working folder\'s probes/ was imported")\n')
    write(work / "dashboard" / "__init__.py", 'raise SystemExit("the working folder\'s dashboard/ was imported")\n')
    write(work / "helper.py", 'WHO = "the working folder\'s helper"\n')
    write(code / "helper.py", 'WHO = "the script\'s own helper"\n')
    write(code / "train.py", TRAIN)
    console = tmp_path / "bin" / "modscope"
    write(console, "import sys\nfrom dashboard.cli import main\nsys.exit(main())\n")
    return work, code, console


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def lines(out: str, key: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(key + " ")]


def test_the_script_sees_what_python_gives_it_and_its_own_helper(folders):
    work, code, console = folders
    run_dir = work / "runs" / "r"
    r = subprocess.run([sys.executable, str(console), "run", "--run-dir", str(run_dir), "--every", "1",
                        str(code / "train.py")], cwd=str(work), env=env(), capture_output=True, text=True,
                       timeout=WAIT, check=False)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout, "HELPER") == ["the script's own helper"]
    assert "was imported" not in r.stderr
    assert "modscope: watching Sequential" in r.stderr and list(run_dir.glob("modscope-*-rank0.sqlite"))
    plain = subprocess.run([sys.executable, str(code / "train.py")], cwd=str(work), env=env(), capture_output=True,
                           text=True, timeout=WAIT, check=False)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(lines(r.stdout, "SYSPATH")[0]) == json.loads(lines(plain.stdout, "SYSPATH")[0])
    assert json.loads(lines(r.stdout, "SYSPATH")[0])[0] == str(code)
    found = subprocess.run([sys.executable, str(console), "findings", "--run", str(run_dir)], cwd=str(work),
                           env=env(), capture_output=True, text=True, timeout=WAIT, check=False)
    assert found.returncode == 0 and "no active findings" in found.stdout, found.stderr


def test_the_module_form_keeps_pythons_rule(folders):
    """``-m``: the working folder first, as ``python -m`` puts it; modscope's packages are still its own."""
    work, code, console = folders
    write(work / "pkg" / "__init__.py", "")
    write(work / "pkg" / "train.py", TRAIN)
    r = subprocess.run([sys.executable, str(console), "run", "--run-dir", "runs", "--every", "1", "-m", "pkg.train"],
                       cwd=str(work), env=env(), capture_output=True, text=True, timeout=WAIT, check=False)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout, "HELPER") == ["the working folder's helper"]      # as python -m finds it
    assert "modscope: watching Sequential" in r.stderr and "was imported" not in r.stderr
    # python -m: the working folder, then what every interpreter of this environment has (there, the working
    # folder's argparse.py would break torch's import: modscope imported the standard library's before)
    plain = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                           cwd=str(code), env=env(), capture_output=True, text=True, timeout=WAIT, check=False)
    assert json.loads(lines(r.stdout, "SYSPATH")[0]) == [str(work), *json.loads(plain.stdout)]


def test_the_served_dashboard_is_modscopes_own(folders):
    work, code, console = folders
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = work / "stderr.log"
    with open(err, "w") as fh:
        proc = subprocess.Popen([sys.executable, str(console), "run", "--run-dir", "runs", "--every", "1", "--serve",
                                 "--port", str(port), str(code / "train.py")], cwd=str(work), env=env(),
                                stdout=subprocess.DEVNULL, stderr=fh)
    try:
        deadline = time.monotonic() + WAIT
        while "stays up until Ctrl-C" not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = err.read_text()
        assert "the training exited with status 0" in text and "was imported" not in text, text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
