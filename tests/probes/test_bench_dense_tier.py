"""bench.dense_tier and bench.gpu_dense_sync run end to end (smoke runs: the figures themselves come from running the
benchmark, never from timed asserts)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_dense_tier_benchmark_reports_both_configurations_side_by_side(tmp_path):
    out = tmp_path / "dense.json"
    proc = subprocess.run([sys.executable, "-m", "bench.dense_tier", "--models", "tanh-mlp", "--steps", "12",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["tanh-mlp"]
    on, off = result["dense on"], result["dense off"]
    assert on["dense_steps"] > 0 and off["dense_steps"] == 0
    assert on["full_samples"][:3] == off["full_samples"][:3] == [0, 1, 2]
    assert on["schedule"]["dense"] >= 1 and off["schedule"]["dense"] == 0
    assert "dense on" in proc.stdout and "dense off" in proc.stdout


def test_dense_tier_benchmark_refuses_an_unknown_model():
    proc = subprocess.run([sys.executable, "-m", "bench.dense_tier", "--models", "nope"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "unknown model(s) ['nope']" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it counts for real (minutes): docs/benchmarks.md")
def test_gpu_sync_count_says_it_needs_cuda():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_dense_sync"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("needs a CUDA device (torch.cuda.is_available() is "
                                                                 "False)")
