"""``modscope export -o FILE`` writes a new file and renames it into place: a link planted at ``FILE`` (in a folder
others can write to) is replaced, never followed, and its target is unchanged."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from bench import synth_store

REPO = Path(__file__).resolve().parents[2]


def test_a_link_at_the_output_is_replaced_not_followed(tmp_path):
    store = tmp_path / "run" / "modscope.sqlite"
    synth_store.demo(store, steps=5)
    victim = tmp_path / "home" / "notes.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    out = tmp_path / "shared" / "report.html"
    out.parent.mkdir()
    out.symlink_to(victim)
    r = subprocess.run([sys.executable, "-m", "dashboard.cli", "export", "--snapshot", str(store), "-o", str(out)],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious"
    assert not out.is_symlink() and out.read_text().startswith("<!DOCTYPE html>")
    assert stat.S_IMODE(out.stat().st_mode) & 0o044           # readable as an ordinary new file is
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.html"]      # no partial file left
