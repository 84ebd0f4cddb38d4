"""bench.overhead runs end to end (a smoke run: the figures themselves are checked by running
the benchmark, never by timed asserts)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_overhead_benchmark_runs_and_reports_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    configs = "bare,modscope-default,modscope-every1,ideal,floor"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.overhead", "--models", "mlp", "--configs", configs,
         "--rounds", "2", "--steps", "1", "--warmup", "1", "--threads", "1", "--phases", "--rss",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["mlp"]
    names = configs.split(",")
    assert sorted(result["overhead"]) == sorted(names) and result["overhead"]["bare"] == 0.0
    assert sorted(result["overhead_total_time"]) == sorted(names)
    assert all(len(result["phases_ms"][c]) == 3 and min(result["phases_ms"][c]) > 0 for c in names)
    assert result["rss_mb"]["bare"] > 0 and result["rss_mb"]["modscope-every1"] > 0
    assert result["self_reported"]["modscope-every1"] > 0
    assert "modscope-every1" in proc.stdout and "by phase" in proc.stdout


def test_overhead_benchmark_names_an_unknown_configuration():
    proc = subprocess.run([sys.executable, "-m", "bench.overhead", "--configs", "bare,wandbb"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "wandbb" in proc.stderr and "modscope-every1" in proc.stderr
