"""The dashboard's token without a command line: from ``MODSCOPE_TOKEN`` or ``--token-file FILE``, for
``modscope serve``, ``modscope run --serve`` and ``probes.show()`` / ``w.show()``. Real processes: the token must be
absent from ``/proc/<pid>/cmdline`` of the server and of every child ``modscope run --serve`` starts (any user of
the machine can read those), and the server must require it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOKEN = "file-token-0123456789abcdef"
WAIT = 120

SCRIPT = '''
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
m = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(100000):
    loss = F.mse_loss(m(torch.randn(8, 2)), torch.zeros(8, 1))
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 5:
        print("TRAINING", flush=True)
    time.sleep(0.01)
'''

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc/<pid>/cmdline")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "MODSCOPE_TOKEN"}
    return dict(base, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **extra)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def status(url: str, **headers: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_for(path: Path, text: str, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        out = path.read_text(errors="replace") if path.exists() else ""
        if text in out:
            return out
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not printed: {path.read_text(errors='replace') if path.exists() else ''}")


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C until it exits: ``run --serve``'s first stops the training, the next its dashboard."""
    for _ in range(6):
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(3)
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait(10)


def assert_requires_token(port: int) -> None:
    url = f"http://127.0.0.1:{port}/_dash-layout"
    assert status(url) == 401
    assert status(url, **{"X-Modscope-Token": "wrong-token-0123456789"}) == 401
    assert status(url, **{"X-Modscope-Token": TOKEN}) == 200


@pytest.fixture
def token_file(tmp_path) -> Path:
    f = tmp_path / "secret" / "token"
    f.parent.mkdir()
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    return f


@pytest.mark.parametrize("source", ["--token-file", "MODSCOPE_TOKEN"])
def test_serve_takes_the_token_from_a_file_or_the_environment(tmp_path, token_file, source):
    port = free_port()
    args = ["--token-file", str(token_file)] if source == "--token-file" else []
    out = tmp_path / "out.log"
    with open(out, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "dashboard.cli", "serve", "--run", str(tmp_path / "run"),
                                 "--port", str(port), *args], cwd=str(tmp_path), stdout=fh, stderr=subprocess.STDOUT,
                                env=env(**({} if args else {"MODSCOPE_TOKEN": TOKEN})))
    try:
        text = wait_for(out, "modscope dashboard:", proc)
        assert f"http://127.0.0.1:{port}/?token={TOKEN}" in text        # printed once, for the user to open
        assert TOKEN not in cmdline(proc.pid)
        assert_requires_token(port)
    finally:
        stop(proc)


def test_run_serve_passes_the_token_to_no_command_line(tmp_path, token_file):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    port = free_port()
    out = tmp_path / "out.log"
    with open(out, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "dashboard.cli", "run", "--run-dir", "runs", "--every", "1",
                                 "--serve", "--port", str(port), "--token-file", str(token_file), "train.py"],
                                cwd=str(tmp_path), stdout=fh, stderr=subprocess.STDOUT, env=env())
    try:
        wait_for(out, "TRAINING", proc)
        text = wait_for(out, "modscope dashboard:", proc)
        assert f"?token={TOKEN}" in text
        kids = children(proc.pid)
        assert len(kids) == 2                                    # the dashboard and the training
        lines = [cmdline(pid) for pid in [proc.pid, *kids]]
        assert all(TOKEN not in line for line in lines), lines
        assert any("dashboard.cli" in line and "serve" in line for line in lines)
        assert any("probes.launch.autorun" in line and "train.py" in line for line in lines)
        # the training child gets no token it did not have: only the dashboard's environment holds it
        training = next(pid for pid in kids if "probes.launch.autorun" in cmdline(pid))
        assert b"MODSCOPE_TOKEN=" not in Path(f"/proc/{training}/environ").read_bytes()
        assert_requires_token(port)
    finally:
        stop(proc)


def test_show_gives_its_dashboard_the_token_in_the_environment(tmp_path):
    run = tmp_path / "runs" / "r"
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        import probes
        from probes import notebook
        url = probes.show({str(run)!r}, token=sys.argv[1])
        (server,) = notebook._servers.values()
        print("URL", url)
        print("PID", server.proc.pid, flush=True)
        os.environ["MODSCOPE_TOKEN"] = sys.argv[1]
        again = probes.show({str(run)!r})            # the same token, from the environment: the same server
        print("SAME", again == url and next(iter(notebook._servers.values())) is server, flush=True)
        sys.stdin.readline()
        notebook.stop_all()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, TOKEN], cwd=str(tmp_path), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    try:
        lines: dict[str, str] = {}
        while "SAME" not in lines:
            line = proc.stdout.readline()
            assert line, proc.stdout.read()
            key, _, value = line.strip().partition(" ")
            lines[key] = value
        port = int(lines["URL"].split(":")[2].split("/")[0])
        assert lines["URL"] == f"http://127.0.0.1:{port}/?token={TOKEN}" and lines["SAME"] == "True"
        assert TOKEN not in cmdline(int(lines["PID"]))
        assert_requires_token(port)
    finally:
        proc.communicate("\n", timeout=WAIT)


def test_show_refuses_a_short_token_at_once(tmp_path):
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import probes; probes.show('runs', token='short')"
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=WAIT, env=env(), check=False)
    assert "ValueError: token: 5 characters; expected at least 16" in r.stderr and "short'" not in r.stderr


@pytest.mark.parametrize("case, problem", [
    ("missing", "cannot open (No such file or directory)"),
    ("empty", "empty; expected the token on its first line"),
    ("short", "5 characters, too short; expected at least 16"),
    ("both", "--token and --token-file: give one of them"),
    ("pipe", "not a regular file"),
])
def test_an_unusable_token_file_exits_2_with_one_line(tmp_path, case, problem):
    f = tmp_path / "token"
    if case == "empty":
        f.write_text("\n\n")
    elif case in ("short", "both"):
        f.write_text("short\n")
    elif case == "pipe":
        os.mkfifo(f)
    extra = ["--token", TOKEN] if case == "both" else []
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "serve", "--run", str(tmp_path / "run"),
                        "--token-file", str(f), *extra, "--port", str(free_port())], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=WAIT, env=env(), check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert problem in lines[0] and "short" not in lines[0].replace("too short", "")
    if case != "both":
        assert f"--token-file {f}" in lines[0]


def test_a_short_token_in_the_environment_is_named_as_such(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "serve", "--run", str(tmp_path / "run")],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=WAIT,
                       env=env(MODSCOPE_TOKEN="tiny"), check=False)
    assert r.returncode == 2 and r.stderr.strip() == ("modscope: error: MODSCOPE_TOKEN: 4 characters, too short; "
                                                      "expected at least 16 (or leave --token out and a 43-character "
                                                      "one is generated)")


def test_a_token_file_others_can_read_is_warned_about(tmp_path, token_file):
    token_file.chmod(0o644)
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "serve", "--run", "run", "--token-file",
                        str(token_file), "--host", "not a host!"], cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=WAIT, env=env(), check=False)
    assert f"modscope: warning: {token_file} can be read by other users (mode 644)" in r.stderr
    assert r.returncode == 2 and "--host 'not a host!'" in r.stderr


def test_token_options_need_serve(tmp_path, token_file):
    (tmp_path / "x.py").write_text("")
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "run", "--token-file", str(token_file), "x.py"],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=WAIT, env=env(), check=False)
    assert r.returncode == 2 and r.stderr.strip() == ("modscope: error: --token-file: only with --serve "
                                                      "(the dashboard's token)")
