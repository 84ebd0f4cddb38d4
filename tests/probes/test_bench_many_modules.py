"""bench.many_modules runs end to end, alone and side by side with a git revision's probes (smoke runs: the
figures themselves are checked by running the benchmark, never by timed asserts)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_per_call_cost_side_by_side_with_a_revision(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.many_modules", "--blocks", "3", "--rounds", "2", "--start", "",
         "--against", "HEAD", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (pair,) = json.loads(out.read_text())["against"]
    assert pair["blocks"] == 3 and pair["against"] == "HEAD"
    for side in (pair["this_tree"], pair["revision"]):
        # 3 blocks of 3 modules; the root, the Sequential, the unregistered block (3) and the head
        assert side["calls"] == 3 * 3 + 6 and side["bare_ms"] > 0 and side["sampled_ms"] > 0
        assert side["self_per_call_us"] > 0
    assert "side by side" in proc.stdout and "HEAD" in proc.stdout


def test_an_unknown_revision_is_named_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.many_modules", "--blocks", "3", "--start", "",
                           "--against", "no-such-revision"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("--against 'no-such-revision': not a git revision")
