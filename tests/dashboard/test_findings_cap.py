"""A rank's findings are read 2,000 at most (the most severe first); when a store holds more, ``modscope findings``
(text and JSON), the Findings page and the HTML report say how many more there were. A real SQLite store with
2,350 active findings (written with the schema's DDL), read by a real ``modscope`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import synth_store
from dashboard.read.caps import findings_cap
from dashboard.read.run import RunDir
from dashboard.read.store import MAX_FINDINGS
from dashboard.web.pages import findings as findings_page
from dashboard.web.report import build_report

REPO = Path(__file__).resolve().parents[2]
MORE = 350


@pytest.fixture(scope="module")
def capped(tmp_path_factory) -> Path:
    return synth_store.many_findings(tmp_path_factory.mktemp("cap") / "modscope.sqlite", MAX_FINDINGS + MORE)


def modscope(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashboard.cli", *args], cwd=str(REPO), capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)


NOTE = f"{MORE} more findings not shown: only the {MAX_FINDINGS:,} most severe of each rank are read"


def test_the_cli_says_how_many_more_there_were(capped):
    text = modscope("findings", "--snapshot", str(capped))
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[1] == f"note: {NOTE}"
    as_json = modscope("findings", "--snapshot", str(capped), "--json")
    assert as_json.returncode == 0 and len(json.loads(as_json.stdout)) == MAX_FINDINGS
    assert as_json.stderr.strip() == f"modscope: note: {NOTE}"
    assert modscope("findings", "--snapshot", str(capped), "--rank", "0").stdout.splitlines()[1] == f"note: {NOTE}"


def test_no_note_when_everything_was_read(tmp_path):
    store = synth_store.many_findings(tmp_path / "modscope.sqlite", 50)
    r = modscope("findings", "--snapshot", str(store))
    assert r.returncode == 0 and "note:" not in r.stdout and not r.stderr
    assert findings_cap(RunDir.open(store, live=False).run()) is None


def test_the_findings_page_and_the_report_say_it(capped):
    run = RunDir.open(capped, live=False).run()
    cap = findings_cap(run)
    assert cap is not None and cap.more == MORE and cap.text() == NOTE
    items = run.folded_findings(active=True)
    first = findings_page.finding_list(items, ["error", "warning", "info"], cap=cap)[0]
    assert first.children == NOTE and "findings-cap" in first.className
    assert f'<p class="muted findings-cap">{NOTE}</p>' in build_report(run)
