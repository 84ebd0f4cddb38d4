"""What the command line does with inputs a user gets wrong, and the demo started as a user starts it:
from a folder of their own, stopped with Ctrl-C or SIGTERM. Every unusable argument is one line on
stderr naming the value, exit status 2, before anything starts, and nothing the user has is lost."""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import synth_store
from probes import schema

REPO = Path(__file__).resolve().parents[2]
WAIT = 90           # upper bound of every wait for the demo (never a timed assert)


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def modscope(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashboard.cli", *args], cwd=str(cwd), env=env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def app(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "app.py"), *args], cwd=str(cwd), env=env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def one_error(r: subprocess.CompletedProcess) -> str:
    """The one line of a usage error (exit status 2, no traceback)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return lines[0]


def free_port() -> int:
    """A free port in 8800-8830 (the range this test suite's servers may use)."""
    for port in range(8800, 8831):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 8800-8830")


def one_rank_run(run_dir: Path, world_size: int = 1) -> Path:
    """A closed run of ``world_size`` ranks; returns its rank-0 store file."""
    synth_store.rank_run(run_dir, run_id="job1", world_size=world_size, steps=4)
    return run_dir / schema.store_filename("job1", 0)


def other_sqlite(path: Path) -> Path:
    """A valid SQLite file that is not a modscope store."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE notes (text TEXT)")
    con.commit()
    con.close()
    return path


# -- export -o onto what it reads ------------------------------------------------------------------------
def test_export_refuses_to_write_the_report_over_a_store_it_reads(tmp_path):
    store = one_rank_run(tmp_path / "run")
    before = store.read_bytes()
    (tmp_path / "link.sqlite").symlink_to(store)
    os.link(store, tmp_path / "hard.sqlite")
    cases = [("--run", "run", f"run/{store.name}"), ("--run", "run", "link.sqlite"),
             ("--run", "run", "hard.sqlite"), ("--run", f"run/{store.name}", f"run/{store.name}-wal"),
             ("--snapshot", f"run/{store.name}", f"run/{store.name}"), ("--snapshot", "run", f"./run/{store.name}")]
    for option, target, output in cases:
        line = one_error(modscope("export", option, target, "-o", output, cwd=tmp_path))
        assert line.startswith(f"modscope: error: -o {output}: is the ") and "being exported" in line, line
        assert store.read_bytes() == before, (option, target, output)
    wal = tmp_path / "run" / f"{store.name}-wal"
    assert not wal.exists() or not wal.read_bytes().startswith(b"<!DOCTYPE")
    # the run is intact, and a report next to it is written
    assert modscope("findings", "--run", "run", cwd=tmp_path).returncode == 0
    r = modscope("export", "--run", "run", "-o", "run/report.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "report.html").read_text().startswith("<!DOCTYPE html>")


# -- export --rank -------------------------------------------------------------------------------------
def test_export_refuses_a_rank_the_run_does_not_have(tmp_path):
    one_rank_run(tmp_path / "one")
    one_rank_run(tmp_path / "two", world_size=2)
    for rank in ("3", "-1"):
        line = one_error(modscope("export", "--run", "one", "--rank", rank, "-o", "x.html", cwd=tmp_path))
        assert line == f"modscope: error: --rank {rank}: no such rank in this run; expected one of 0"
    assert not (tmp_path / "x.html").exists()
    r = modscope("export", "--run", "two", "--rank", "1", "-o", "r1.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Module tree (rank 1)" in (tmp_path / "r1.html").read_text()


def test_a_missing_or_empty_run_is_named_as_the_user_gave_it(tmp_path):
    line = one_error(modscope("export", "--run", "nope", "-o", "x.html", cwd=tmp_path))
    assert "--run nope: no such file or directory" in line and "modscope.sqlite" not in line
    (tmp_path / "empty").mkdir()
    line = one_error(modscope("export", "--run", "empty", "-o", "x.html", cwd=tmp_path))
    assert "--run empty: no store yet" in line and "modscope.sqlite" not in line
    one_rank_run(tmp_path / "run")
    line = one_error(modscope("serve", "--compare", "empty", "run", "--port", str(free_port()), cwd=tmp_path))
    assert line == "modscope: error: empty: no store yet (nothing written to this run)"


# -- --poll-ms, --runs-dir: checked before anything starts -------------------------------------------------
def test_a_bad_poll_interval_is_refused_before_anything_starts(tmp_path):
    one_rank_run(tmp_path / "run")
    port = str(free_port())
    for value in ("0", "-5"):
        line = one_error(modscope("serve", "--run", "run", "--port", port, "--poll-ms", value, cwd=tmp_path))
        assert f"--poll-ms {value}: expected a positive number of milliseconds" in line
        line = one_error(app("--port", port, "--poll-ms", value, "--runs-dir", "demo-runs", cwd=tmp_path))
        assert f"--poll-ms {value}: expected a positive number of milliseconds" in line
        assert not (tmp_path / "demo-runs").exists()            # the demo never started


def test_a_runs_dir_that_cannot_hold_a_run_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("notes\n")
    port = str(free_port())
    for value in ("notes.txt", "/proc/foo", "notes.txt/sub"):
        line = one_error(app("--port", port, "--runs-dir", value, cwd=tmp_path))
        assert line.startswith(f"modscope: error: --runs-dir {value}: cannot create a run directory in it ("), line
    assert (tmp_path / "notes.txt").read_text() == "notes\n"


# -- no option is abbreviated ---------------------------------------------------------------------------
ECHO = "import sys\nprint('ARGV', sys.argv)\n"


def test_options_are_never_abbreviated_and_scripts_get_theirs(tmp_path):
    one_rank_run(tmp_path / "buggy")
    line = one_error(modscope("demo", "--run", "buggy", "--port", "0", cwd=tmp_path))
    assert "unrecognized arguments: --run buggy" in line
    assert [p.name for p in (tmp_path / "buggy").iterdir() if p.is_dir()] == []      # no demo run written into it
    (tmp_path / "train.py").write_text(ECHO)
    line = one_error(modscope("run", "--run", "r2", "train.py", cwd=tmp_path))
    assert "unrecognized arguments: --run" in line and "--run-dir" not in line
    line = one_error(modscope("serve", "--run", "buggy", "--poll", "5", "--port", "0", cwd=tmp_path))
    assert "unrecognized arguments: --poll 5" in line
    # what follows the script is the script's, even options that look like modscope's
    r = modscope("run", "--run-dir", "r3", "train.py", "--lr", "3e-4", "--run", "x", "--every", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ARGV ['train.py', '--lr', '3e-4', '--run', 'x', '--every', '2']" in r.stdout


# -- modscope run: what it cannot run ---------------------------------------------------------------------
def test_run_says_what_it_cannot_run(tmp_path):
    line = one_error(modscope("run", "--run-dir", "r", "-m", "no_such_module_xyz", cwd=tmp_path))
    assert line == "modscope: error: -m no_such_module_xyz: No module named no_such_module_xyz"
    assert not (tmp_path / "r").exists()
    (tmp_path / "proj").mkdir()
    line = one_error(modscope("run", "--run-dir", "r", "proj", cwd=tmp_path))
    assert line == "modscope: error: proj: is a directory; expected a Python script to run"
    assert not (tmp_path / "r").exists()
    # a package that exists, a module in it that does not: found out only in the child, as python -m does (status 1)
    r = modscope("run", "--run-dir", "r", "-m", "json.no_such_module_xyz", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{sys.executable}: No module named json.no_such_module_xyz" in r.stderr.splitlines()


def test_a_script_that_watched_nothing_leaves_no_empty_run_dir(tmp_path):
    (tmp_path / "train.py").write_text(ECHO)
    r = modscope("run", "--run-dir", "r", "train.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "r").exists()
    (tmp_path / "mine").mkdir()                                   # a folder the user had is kept
    assert modscope("run", "--run-dir", "mine", "train.py", cwd=tmp_path).returncode == 0
    assert (tmp_path / "mine").is_dir()


# -- --run FILE that is another SQLite file ----------------------------------------------------------------
def test_a_run_file_that_is_another_sqlite_file_is_refused(tmp_path):
    other_sqlite(tmp_path / "other.sqlite")
    expected = "modscope: error: other.sqlite: not a modscope store (missing tables: meta, ranks, "
    line = one_error(modscope("findings", "--run", "other.sqlite", cwd=tmp_path))
    assert line.startswith(expected), line
    line = one_error(modscope("serve", "--run", "other.sqlite", "--port", str(free_port()), cwd=tmp_path, timeout=30))
    assert line.startswith(expected), line
    line = one_error(modscope("export", "--run", "other.sqlite", "-o", "x.html", cwd=tmp_path))
    assert line.startswith(expected), line
    # a store file of a run that is being written, or a finished one, is still followed
    store = one_rank_run(tmp_path / "run")
    assert modscope("findings", "--run", str(store), cwd=tmp_path).returncode == 0


# -- the demo -------------------------------------------------------------------------------------------
def rank_row(store: Path) -> tuple[str, int] | None:
    try:
        con = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
        try:
            row = con.execute("SELECT status, step FROM ranks").fetchone()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    return None if row is None else (str(row[0]), int(row[1]))


def wait_for_steps(run_dir: Path, proc: subprocess.Popen | None = None) -> Path:
    """The demo's store once it holds a few steps."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        for store in run_dir.glob("modscope-*-rank0.sqlite"):
            row = rank_row(store)
            if row is not None and row[1] >= 3:
                return store
        time.sleep(0.2)
    raise AssertionError(f"no store with steps in {run_dir}: {sorted(p.name for p in run_dir.iterdir())}")


def test_the_demo_writes_where_the_dashboard_reads_from_any_folder(tmp_path, monkeypatch):
    from dashboard.cli import start_demo_config
    from dashboard.commands.demo import stop_demo

    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.chdir(user)
    config, proc = start_demo_config("127.0.0.1", free_port(), "runs", ["--steps", "0", "--delay", "0.05"])
    try:
        run_dir = config.store.where
        assert run_dir.is_absolute() and run_dir.parent == user / "runs", run_dir
        store = wait_for_steps(run_dir, proc)
        deadline = time.monotonic() + WAIT
        while not config.store.ready() and time.monotonic() < deadline:     # the dashboard's own reader
            time.sleep(0.2)
        assert config.store.path == store
    finally:
        stop_demo(proc)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm, sigint ignored"])
def test_stopping_the_demo_closes_its_run(tmp_path, how):
    """Ctrl-C (SIGINT to the dashboard) and SIGTERM (a service manager; the dashboard started in the
    background of a script, where SIGINT is ignored and would stay ignored in the child) both let the
    training close its watcher: the run ends ``closed``, with no lock, -wal or -shm left."""
    runs = tmp_path / "runs"
    ignore_sigint = how.startswith("sigterm")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "app.py"), "--port", str(free_port()), "--runs-dir", str(runs)],
        cwd=str(tmp_path), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as a shell script's background job starts it: SIGINT ignored from the start
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)  # noqa: PLW1509
    try:
        first = proc.stdout.readline()
        m = re.match(r"demo training started \(pid (\d+)\), writing to (.+)$", first.strip())
        assert m, first + proc.stderr.read()
        child, run_dir = int(m.group(1)), Path(m.group(2))
        url = proc.stdout.readline()                  # serving (a stop while it starts: the test below)
        assert url.startswith("modscope dashboard: http://127.0.0.1:"), url + proc.stderr.read()
        store = wait_for_steps(run_dir, proc)
        proc.send_signal(signal.SIGTERM if ignore_sigint else signal.SIGINT)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    left = sorted(p.name[len(store.name):] for p in run_dir.iterdir() if p.name.startswith(store.name))
    assert left == ["", ".status"], left
    assert rank_row(store)[0] == "closed"          # (after the listing: a reader of a WAL file makes a -shm)
    assert "KeyboardInterrupt" in (run_dir / "demo.log").read_text()


SLEEPER = """
import pathlib, sys, time
try:
    print("READY", flush=True)
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    pathlib.Path(sys.argv[1]).write_text("closed")
"""


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit], ids=["ctrl-c", "sigterm"])
def test_a_stop_while_the_app_is_built_still_stops_the_demo(tmp_path, monkeypatch, stop):
    """Building the app takes seconds, and the demo is already training: a Ctrl-C (KeyboardInterrupt)
    or a SIGTERM (serve's handler raises SystemExit) then must still stop it with its SIGINT."""
    from dashboard import cli
    from dashboard.read.store import Store
    from dashboard.web import server
    from dashboard.web.config import AppConfig

    closed = tmp_path / "closed"
    child = subprocess.Popen([sys.executable, "-c", SLEEPER, str(closed)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    previous = signal.getsignal(signal.SIGTERM)

    def build(config):
        raise stop()
    monkeypatch.setattr(server, "create_app", build)
    try:
        assert child.stdout.readline() == "READY\n"
        config = AppConfig(mode="live", store=Store.open_run(tmp_path / "run"))
        try:
            cli.serve(config, "127.0.0.1", free_port(), demo_proc=child)
        except (KeyboardInterrupt, SystemExit):
            pass
        assert child.wait(WAIT) is not None and closed.read_text() == "closed"
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
