"""The fast statistics agree with straightforward reference computations."""
import math

import pytest
import torch

from probes import measure as M
from probes.schema import HIST_BINS, HIST_EDGES


def stats(x, udim=None, sat=None, last=None, sample_index=0, window=16):
    edges = M.StepMeasurements().edges(x.device)
    udim = x.dim() - 1 if udim is None else udim
    vec, new_last = M.call_vector(x, [], udim, sat, last, sample_index, window, edges)
    head = dict(zip(M.CALL_FIELDS, vec[:len(M.CALL_FIELDS)].tolist()))
    hist = vec[len(M.CALL_FIELDS):].tolist()
    return head, hist, new_last


@pytest.mark.parametrize("shape,udim", [((64, 32), 1), ((4, 8, 16), 2), ((2, 6, 5, 5), 1), ((7,), 0)])
def test_moments_and_extremes(shape, udim):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 1
    head, hist, _ = stats(x, udim)
    std, mean = torch.std_mean(x, correction=0)
    assert head["mean"] == pytest.approx(mean.item(), rel=1e-4, abs=1e-5)
    assert head["std"] == pytest.approx(std.item(), rel=1e-3)
    assert head["absmax"] == pytest.approx(x.abs().max().item())
    assert head["nonfinite"] == 0
    assert sum(hist) == min(x.numel(), M.HIST_SAMPLE) and len(hist) == HIST_BINS


def test_histogram_bins_and_zero_bin():
    x = torch.tensor([0.0, 1e-9, -5.0, 200.0, 1.0, 2.0, 3.0, 4.0, 5.0, -0.5])
    _, hist, _ = stats(x)
    expected = [0] * HIST_BINS
    for v in x.tolist():
        expected[sum(1 for e in HIST_EDGES if v >= e)] += 1
    assert hist == expected
    assert hist[M.ZERO_BIN] == 2


def test_constant_output_has_exactly_zero_std():
    head, _, _ = stats(torch.full((32, 8), 1234.5678))
    assert head["std"] == 0.0


def test_nonfinite_count_on_cpu_and_in_extra_outputs():
    x = torch.randn(10, 4)
    x[0, 0], x[3, 2] = float("nan"), float("inf")
    head, _, _ = stats(x)
    assert head["nonfinite"] == 2
    edges = M.StepMeasurements().edges(x.device)
    vec, _ = M.call_vector(torch.ones(3), [torch.tensor([float("nan")] * 3)], 0, None, None, 0, 16, edges)
    assert vec[6].item() == 3


def test_dead_units_over_the_window():
    x = torch.randn(32, 4).relu()
    x[:, :2] = 0                                  # two of four units never active
    head, _, last = stats(x)
    assert head["dead_frac"] == 0.5
    # unit 0 activates once, then stays silent: alive until it leaves the window
    y = x.clone()
    y[0, 0] = 1.0
    head, _, last = stats(y, last=last, sample_index=1, window=3)
    assert head["dead_frac"] == 0.25
    for i in range(2, 4):
        head, _, last = stats(x, last=last, sample_index=i, window=3)
        assert head["dead_frac"] == 0.25
    head, _, last = stats(x, last=last, sample_index=4, window=3)
    assert head["dead_frac"] == 0.5


def test_conv_units_are_channels():
    x = torch.randn(8, 6, 4, 4).relu()
    x[:, 1] = 0
    head, _, last = stats(x, udim=1)
    assert head["dead_frac"] == pytest.approx(1 / 6) and last.shape == (6,)


@pytest.mark.parametrize("kind,values,expected", [
    ("tanh", [0.999, -0.995, 0.2, 0.5], 0.5), ("sigmoid", [0.001, 0.999, 0.5, 0.995], 0.75)])
def test_saturation(kind, values, expected):
    head, _, _ = stats(torch.tensor(values), sat=kind)
    assert head["sat_frac"] == pytest.approx(expected)


def test_half_precision_and_scalars():
    head, _, _ = stats(torch.randn(16, 8).half())
    assert math.isfinite(head["mean"])
    head, hist, _ = stats(torch.tensor(2.5))
    assert head["mean"] == 2.5 and head["dead_frac"] == M.NOT_APPLICABLE and sum(hist) == 1


def test_float_tensors_of_structured_outputs():
    from dataclasses import dataclass

    @dataclass
    class Out:
        logits: torch.Tensor
        ids: torch.Tensor
    a, b = torch.randn(2), torch.randn(3)
    out = {"x": (a, torch.arange(3)), "y": Out(b, torch.ones(2, dtype=torch.long)), "z": None}
    assert [t is s for t, s in zip(M.float_tensors(out), [a, b])] == [True, True]
    assert M.float_tensors(None) == [] and M.primary([]) is None


def test_fetch_copies_once_per_device_in_order():
    m = M.StepMeasurements()
    ia, ib = m.add(torch.tensor([1.0, 2.0])), m.add(torch.tensor(3.0))
    assert m.fetch() == [[1.0, 2.0], [3.0]] and (ia, ib) == (0, 1)
    assert m.fetch() == []


def test_norms_and_sampled_update_norms():
    ts = [torch.randn(5), torch.randn(3, 3), torch.randn(2).double(), torch.randn(100, 1000)]
    n = M.norms(ts)
    assert torch.allclose(n, torch.stack([t.norm().float() for t in ts]))
    before = M.sample_values(ts)
    assert [b.numel() for b in before] == [5, 9, 2, M.sample_size(100_000)] and before[3].numel() <= 4096
    with torch.no_grad():
        ts[0].add_(1.0)
        ts[3].add_(0.5)
    d = M.sampled_delta_norms(ts, before).tolist()
    assert d[:3] == pytest.approx([math.sqrt(5), 0.0, 0.0])
    k = M.sample_size(100_000)
    estimate = d[3] * math.sqrt(100_000 / k)
    assert estimate == pytest.approx(0.5 * math.sqrt(100_000), rel=1e-4)


def test_histogram_leaves_out_nan_and_inf():
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    head, hist, _ = stats(x)
    assert head["nonfinite"] == 2 and sum(hist) == 2
