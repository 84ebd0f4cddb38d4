"""bench.overhead runs end to end (a smoke run: the figures themselves are checked by running
the benchmark, never by timed asserts)."""
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_overhead_benchmark_runs_and_reports_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    configs = "bare,modscope-default,modscope-every1,ideal,floor,floor-every1"
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
    # point 2 of the figures: every=1 against both floors, printed side by side (as a multiple where the floor
    # measured an overhead at all: a 2-round run may find it at or below bare)
    every1 = next(line for line in proc.stdout.splitlines() if line.strip().startswith("modscope-every1"))
    for floor in ("floor", "floor-every1"):
        assert (f"x {floor}'s overhead" if result["overhead"][floor] > 0 else f"({floor}'s overhead ") in every1, every1
    for floor in ("floor", "floor-every1"):     # in the JSON too, wherever the floor measured an overhead
        if result["overhead"][floor] > 0:
            assert result[f"x_{floor}"]["modscope-every1"] == result["overhead"]["modscope-every1"] / \
                result["overhead"][floor]


def test_the_floor_of_every1s_statistics_does_the_exact_passes_and_removes_its_hooks(monkeypatch):
    """StoredFloorProbe: the four passes once per distinct output of every module (a wrapper returning its
    child's output is measured once), one pass over each output's gradient, then the parameters' norms."""
    from torch import nn

    from bench.overhead import StoredFloorProbe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    probe = StoredFloorProbe(model)
    dots, real_dot = [], torch.dot
    monkeypatch.setattr(torch, "dot", lambda a, b: dots.append(a.numel()) or real_dot(a, b))
    model(torch.randn(3, 4)).sum().backward()
    probe.step()
    monkeypatch.undo()
    # forward: Linear, ReLU, the inner Linear (the root and the inner Sequential return that very tensor);
    # backward: the gradients of the same three outputs
    assert sorted(dots) == sorted([24, 24, 6] * 2)
    assert not probe.seen
    probe.close()
    assert not any(m._forward_hooks for m in model.modules())


def test_a_floor_measured_at_or_below_bare_gives_no_multiple():
    from bench.overhead import floor_ratio

    assert floor_ratio(0.2, 0.05, "floor") == "   4.00x floor's overhead"
    assert floor_ratio(0.2, -0.01, "floor") == "  (floor's overhead -1.00%: no multiple)"
    assert "no multiple" in floor_ratio(0.2, 0.0, "floor-every1")
