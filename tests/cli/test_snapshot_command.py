"""``modscope snapshot``: the file the dashboard's Snapshot button gives, from the command line, as real processes.
The copy holds only what modscope writes (no trigger, view or foreign table; none of the file's SQL runs: a trigger
that spins forever on meta does nothing), takes memory independent of the store's size (a real process's peak
measured on a 120 MB store), stops at its time limit, and refuses in one line what it will not copy. The dashboard's
button streams the same file from disk."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from browser_helpers import Server
from hostile_stores import HOSTILE, generated_path, long_finding_paths, trigger_on_meta, wrong_values

from bench import synth_store
from dashboard.read.run import RunDir
from dashboard.read.store import snapshot_to
from probes import schema

REPO = Path(__file__).resolve().parents[2]
MB = 2**20

# the real command line in a process that reports its own peak memory (MiB) on its last line of stderr
# (VmHWM: this process's own; ru_maxrss would count the parent's memory at the fork, which Linux keeps across exec)
PEAK = ("import sys; sys.path.insert(0, sys.argv[1]); from dashboard.cli import main\n"
        "try:\n    code = main(sys.argv[2:])\nexcept SystemExit as exc:\n    code = exc.code\n"
        "peak = next(int(l.split()[1]) // 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print(peak, file=sys.stderr); sys.exit(code)")


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def modscope(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "app.py"), *args], env=env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def contents(path: Path) -> dict[str, list[tuple]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: sorted(map(repr, conn.execute(f"SELECT * FROM {t} WHERE {'key' if t == 'meta' else '1'} "
                                                  f"{'!=' if t == 'meta' else '='} {'?' if t == 'meta' else '1'}",
                                                  ("snapshot_at",) if t == "meta" else ()))) for t in schema.TABLES}
    finally:
        conn.close()


def schema_objects(path: Path) -> set[tuple[str, str]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {(t, n) for t, n in conn.execute("SELECT type, name FROM sqlite_master")}
    finally:
        conn.close()


def contract_objects(tmp_path: Path) -> set[tuple[str, str]]:
    fresh = tmp_path / "fresh.sqlite"
    conn = sqlite3.connect(fresh)
    conn.executescript(schema.DDL)
    conn.close()
    return schema_objects(fresh)


def test_the_snapshot_of_a_run_is_the_file_the_button_gives(tmp_path):
    run_dir = tmp_path / "runs"
    synth_store.rank_run(run_dir, "job1", world_size=2, steps=6)
    out = tmp_path / "snap.sqlite"
    r = modscope("snapshot", "--run", str(run_dir), "-o", str(out))
    assert r.returncode == 0 and r.stdout.strip() == f"wrote {out} (2 ranks, step 5)", r.stderr
    run = RunDir.open(run_dir).run()
    button = tmp_path / "button.sqlite"
    assert snapshot_to(run.snapshot_files(), button, 0) == 5          # what the dashboard's Snapshot button calls
    assert contents(out) == contents(button)
    assert contents(out)["ranks"] and len(contents(out)["ranks"]) == 2
    meta = dict(sqlite3.connect(out).execute("SELECT key, value FROM meta").fetchall())
    assert json.loads(meta["snapshot_of"]) == [p.name for p in run.snapshot_files()]       # names, not folders
    again = tmp_path / "again.sqlite"                                 # a snapshot of the snapshot: the same rows
    assert modscope("snapshot", "--snapshot", str(out), "-o", str(again)).returncode == 0
    assert {t: v for t, v in contents(again).items() if t != "meta"} == \
        {t: v for t, v in contents(out).items() if t != "meta"}


def test_a_trigger_on_meta_never_runs_and_nothing_foreign_is_copied(tmp_path):
    store = trigger_on_meta(tmp_path / "modscope-trig-rank0.sqlite")
    out = tmp_path / "snap.sqlite"
    r = modscope("snapshot", "--snapshot", str(store), "-o", str(out), timeout=60)   # (the old copy spun forever)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == (f"{store}: ignored trigger 'spin' on 'meta', trigger 'spin_update' on 'meta', view "
                                "'everything', table 'notes': modscope writes no such object (never read, never "
                                "copied)")
    assert schema_objects(out) == contract_objects(tmp_path)
    assert not list(tmp_path.glob("*.partial"))


def test_what_it_will_not_copy_is_refused_in_one_line(tmp_path):
    gen = generated_path(tmp_path / "gen.sqlite")
    assert one_line(modscope("snapshot", "--snapshot", str(gen), "-o", str(tmp_path / "a.sqlite"))) == (
        f"modscope: error: {gen}: modules.path is a generated column; modscope writes none (reading it would run the "
        "file's own SQL)")
    long = long_finding_paths(tmp_path / "long.sqlite", size=schema.MAX_VALUE_BYTES + 10, count=1)
    assert one_line(modscope("snapshot", "--snapshot", str(long), "-o", str(tmp_path / "b.sqlite"))).endswith(
        "holds a string or blob longer than 1,000,000 bytes (modscope writes none))")
    wrong = wrong_values(tmp_path / "wrong.sqlite")
    assert "NOT NULL constraint failed" in one_line(
        modscope("snapshot", "--snapshot", str(wrong), "-o", str(tmp_path / "c.sqlite")))
    good = synth_store.demo(tmp_path / "run" / "modscope.sqlite", steps=3).path
    assert one_line(modscope("snapshot", "--snapshot", str(good), "-o", str(tmp_path))) == \
        f"modscope: error: -o {tmp_path}: is a directory; expected a file path for the snapshot"
    assert one_line(modscope("snapshot", "--snapshot", str(good), "-o", str(good))) == \
        f"modscope: error: -o {good}: is the store {good} being copied; expected a new file for the snapshot"
    assert "no such file or directory" in one_line(modscope("snapshot", "--run", str(tmp_path / "none"), "-o", "x"))
    assert "--timeout 0: expected a positive number of seconds" in one_line(
        modscope("snapshot", "--snapshot", str(good), "-o", str(tmp_path / "d.sqlite"), "--timeout", "0"))
    assert "--rank 7: no such rank in this run" in one_line(
        modscope("snapshot", "--snapshot", str(good), "-o", str(tmp_path / "d.sqlite"), "--rank", "7"))
    assert not [p.name for p in tmp_path.iterdir() if p.suffix in (".sqlite", ".partial") and p.name[0] in "abcd"]


@pytest.fixture(scope="module")
def big_store(tmp_path_factory) -> Path:
    """A 120 MB store: the demo, and 300 findings whose messages are 420,000 characters each."""
    path = tmp_path_factory.mktemp("big") / "modscope-big-rank0.sqlite"
    synth_store.demo(path, steps=6)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.executemany("INSERT INTO findings (rank, code, path, severity, message, active) "
                     "VALUES (0, 'dead-units', ?, 'warning', ?, 1)",
                     ((f"stem.{i}", f"{i:06d}" + "m" * 420_000) for i in range(300)))
    conn.commit()
    conn.close()
    assert path.stat().st_size > 120 * MB
    return path


def peak_of_snapshot(store: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, int]:
    r = subprocess.run([sys.executable, "-c", PEAK, str(REPO), "snapshot", "--snapshot", str(store), "-o", str(out),
                        *extra], env=env(), capture_output=True, text=True, timeout=300, check=False)
    return r, int(r.stderr.strip().splitlines()[-1])


def test_memory_does_not_grow_with_the_stores_size(tmp_path, big_store):
    small = synth_store.demo(tmp_path / "small" / "modscope-small-rank0.sqlite", steps=6).path
    r_small, peak_small = peak_of_snapshot(small, tmp_path / "small.sqlite")
    r_big, peak_big = peak_of_snapshot(big_store, tmp_path / "big.sqlite")
    assert r_small.returncode == 0 and r_big.returncode == 0, r_big.stderr
    assert (tmp_path / "big.sqlite").stat().st_size > 120 * MB
    # a copy held in memory would take 120 MB or more; streamed, what grows is SQLite's page caches and one row
    print(f"snapshot peak RSS: small store {peak_small} MiB, 120 MB store {peak_big} MiB")
    assert peak_big < peak_small + 40, (peak_small, peak_big)


def test_a_snapshot_that_takes_too_long_is_stopped_and_leaves_nothing(tmp_path, big_store):
    out = tmp_path / "slow.sqlite"
    r, _ = peak_of_snapshot(big_store, out, "--timeout", "0.001")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[0] == f"modscope: error: {big_store}: the snapshot took longer than 0.001 s; stopped"
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_findings_and_export_of_a_hostile_store_print_no_traceback(tmp_path, name):
    store = HOSTILE[name](tmp_path / f"modscope-{name}-rank0.sqlite")
    for args in (["findings", "--snapshot", str(store)], ["export", "--snapshot", str(store), "-o",
                                                             str(tmp_path / "report.html")]):
        r = modscope(*args)
        assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr + r.stdout, r.stderr
        if r.returncode == 2:
            assert len(r.stderr.strip().splitlines()) <= 2, r.stderr      # the refusal (and a note of ignored objects)


def test_the_dashboards_snapshot_button_streams_the_file(big_store, tmp_path):
    """The button's callback writes the snapshot to disk and answers with a one-time URL; the file comes from there,
    in blocks: the server's memory does not grow by the store's size (its peak measured by the kernel)."""
    srv = Server(["--snapshot", str(big_store)])
    try:
        with urllib.request.urlopen(srv.url + "_dash-dependencies", timeout=10) as r:
            dep = next(d for d in json.load(r) if any(i["id"] == "export-snapshot-btn" for i in d["inputs"]))
        outputs = [dict(zip(("id", "property"), o.split(".", 1), strict=True))
                   for o in dep["output"].strip(".").split("...")]
        body = {"output": dep["output"], "outputs": outputs, "changedPropIds": ["export-snapshot-btn.n_clicks"],
                "inputs": [{"id": "export-snapshot-btn", "property": "n_clicks", "value": 1}],
                "state": [{**s, "value": None} for s in dep["state"]]}
        before = hwm(srv.proc.pid)
        req = urllib.request.Request(srv.url + "_dash-update-component", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            link = json.load(r)["response"]["download-snapshot"]["data"]
        assert link["filename"] == "demo-step5.sqlite" and link["url"].endswith("/demo-step5.sqlite")
        got = tmp_path / "got.sqlite"
        with urllib.request.urlopen(srv.url + link["url"].lstrip("/"), timeout=120) as r, open(got, "wb") as fh:
            while block := r.read(MB):
                fh.write(block)
        assert got.stat().st_size > 120 * MB and contents(got)["findings"] == contents(big_store)["findings"]
        time.sleep(0.5)
        grew = hwm(srv.proc.pid) - before
        print(f"server peak RSS grew by {grew / MB:.0f} MiB over the download")
        assert grew < 60 * MB, f"the server's peak grew by {grew / MB:.0f} MiB"
        with pytest.raises(urllib.error.HTTPError) as again:                # one fetch: the file is gone
            urllib.request.urlopen(srv.url + link["url"].lstrip("/"), timeout=30)
        assert again.value.code == 404
    finally:
        srv.stop()
    assert "Traceback" not in srv.output(), srv.output()


def hwm(pid: int) -> int:
    """The peak resident memory of process ``pid`` so far (the kernel's VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")
