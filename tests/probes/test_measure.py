"""The fast statistics agree with straightforward reference computations."""
import math

import pytest
import torch

from probes.capture import host_values as H
from probes.capture import measure as M
from probes.capture import tensor_stats as TS
from probes.schema import HIST_BINS, HIST_EDGES, ZERO_BIN


def stats(x, udim=None, sat=None, activity=None, sample_index=0, window=16, extra=()):
    """One call measured the way the watcher does: raw chunk, one fetch, rows derived on the host."""
    udim = x.dim() - 1 if udim is None else udim
    activity = activity if activity is not None else M.UnitActivity(window)
    m = M.StepMeasurements()
    chunk, layout = M.call_chunk(x, list(extra), udim, sat)
    slot = m.add_call(chunk, layout, "module")
    row = m.fetch(activity, sample_index)[slot]
    assert len(row) == H.CALL_WIDTH
    head = dict(zip(H.CALL_FIELDS, row[:len(H.CALL_FIELDS)], strict=False))
    return head, row[len(H.CALL_FIELDS):], activity


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
    head, hist, _ = stats(x)
    expected = [0] * HIST_BINS
    for v in x.tolist():
        expected[sum(1 for e in HIST_EDGES if v >= e)] += 1
    assert hist == expected
    assert hist[H.ZERO_BIN] == 2
    assert head["zero_frac"] == pytest.approx(0.2)      # the zero bin's share of the sample


def test_constant_output_has_exactly_zero_std():
    head, _, _ = stats(torch.full((32, 8), 1234.5678))
    assert head["std"] == 0.0


def test_nonfinite_count_on_cpu_and_in_extra_outputs():
    x = torch.randn(10, 4)
    x[0, 0], x[3, 2] = float("nan"), float("inf")
    head, _, _ = stats(x)
    assert head["nonfinite"] == 2
    head, _, _ = stats(torch.ones(3), udim=0, extra=[torch.tensor([float("nan")] * 3)])
    assert head["nonfinite"] == 3


def test_dead_units_over_the_window():
    x = torch.randn(32, 4).relu()
    x[:, :2] = 0                                  # two of four units never active
    activity = M.UnitActivity(window=3)
    head, _, _ = stats(x, activity=activity)
    assert head["dead_frac"] == 0.5
    # unit 0 activates once, then stays silent: alive until it leaves the window
    y = x.clone()
    y[0, 0] = 1.0
    head, _, _ = stats(y, activity=activity, sample_index=1)
    assert head["dead_frac"] == 0.25
    for i in range(2, 4):
        head, _, _ = stats(x, activity=activity, sample_index=i)
        assert head["dead_frac"] == 0.25
    head, _, _ = stats(x, activity=activity, sample_index=4)
    assert head["dead_frac"] == 0.5


def test_dead_units_stay_with_their_module_when_the_call_order_changes():
    """Two modules with outputs of one shape, called in the other order at the next sample: the arrangement of
    the step's calls repeats (the plan made for it is reused), its modules do not, and each module's dead units
    stay its own."""
    activity = M.UnitActivity(window=8)
    alive, dead = torch.ones(4, 3), torch.zeros(4, 3)
    column = H.CALL_FIELDS.index("dead_frac")

    def sample(calls: list[tuple[str, torch.Tensor]], index: int) -> dict[str, float]:
        m = M.StepMeasurements()
        slots = {key: m.add_small_call(x, -1, None, key) for key, x in calls}
        rows = m.fetch(activity, index)
        return {key: rows[slot][column] for key, slot in slots.items()}

    assert sample([("a", alive), ("b", dead)], 0) == {"a": 0.0, "b": 1.0}
    assert sample([("b", dead), ("a", alive)], 1) == {"a": 0.0, "b": 1.0}
    assert sample([("a", dead), ("b", alive)], 2) == {"a": 0.0, "b": 0.0}     # a's activity is in its window


def test_conv_units_are_channels():
    x = torch.randn(8, 6, 4, 4).relu()
    x[:, 1] = 0
    head, _, _ = stats(x, udim=1)
    assert head["dead_frac"] == pytest.approx(1 / 6)


@pytest.mark.parametrize("kind,values,expected", [
    ("tanh", [0.999, -0.995, 0.2, 0.5], 0.5), ("sigmoid", [0.001, 0.999, 0.5, 0.995], 0.75)])
def test_saturation(kind, values, expected):
    head, _, _ = stats(torch.tensor(values), sat=kind)
    assert head["sat_frac"] == pytest.approx(expected)


def test_half_precision_and_scalars():
    head, _, _ = stats(torch.randn(16, 8).half())
    assert math.isfinite(head["mean"])
    head, hist, _ = stats(torch.tensor(2.5))
    assert head["mean"] == 2.5 and head["dead_frac"] == H.NOT_APPLICABLE and sum(hist) == 1


def test_float_tensors_of_structured_outputs():
    from dataclasses import dataclass

    @dataclass
    class Out:
        logits: torch.Tensor
        ids: torch.Tensor
    a, b = torch.randn(2), torch.randn(3)
    out = {"x": (a, torch.arange(3)), "y": Out(b, torch.ones(2, dtype=torch.long)), "z": None}
    assert [t is s for t, s in zip(M.float_tensors(out), [a, b], strict=False)] == [True, True]
    assert M.float_tensors(None) == [] and M.primary([]) is None


def test_fetch_copies_once_per_device_in_order():
    m = M.StepMeasurements()
    ia, ib = m.add(torch.tensor([1.0, 2.0])), m.add(torch.tensor(3.0))
    assert m.fetch() == [[1.0, 2.0], [3.0]] and (ia, ib) == (0, 1)
    assert m.fetch() == []


def test_norms_and_sampled_update_norms():
    ts = [torch.randn(5), torch.randn(3, 3), torch.randn(2).double(), torch.randn(100, 1000)]
    n = TS.norms(ts)
    assert torch.allclose(n, torch.stack([t.norm().float() for t in ts]))
    sampler = TS.UpdateSampler()
    before = sampler.take(ts)
    assert [len(lengths) for _, _, lengths in before] == [3, 1]               # float32 and float64 groups
    assert before[0][2] == (5, 9, TS.sample_size(100_000)) and TS.sample_size(100_000) <= 4096
    with torch.no_grad():
        ts[0].add_(1.0)
        ts[3].add_(0.5)
    d = sampler.delta_norms(ts, before).tolist()
    assert d[:3] == pytest.approx([math.sqrt(5), 0.0, 0.0])
    k = TS.sample_size(100_000)
    estimate = d[3] * math.sqrt(100_000 / k)
    assert estimate == pytest.approx(0.5 * math.sqrt(100_000), rel=1e-4)


def test_update_sampler_follows_replaced_storage_and_non_contiguous_tensors():
    """Cached views must see in-place updates, a tensor whose storage was swapped
    (``p.data = ...``) and a transposed (non-contiguous) parameter."""
    p = torch.nn.Parameter(torch.zeros(64, 32))
    t = torch.nn.Parameter(torch.zeros(32, 64).t())              # non-contiguous
    sampler = TS.UpdateSampler()
    for step in range(3):
        before = sampler.take([p, t])
        with torch.no_grad():
            if step == 1:
                p.data = torch.full((64, 32), 5.0)               # new storage: a 5.0 jump everywhere
            else:
                p.add_(1.0)
            t.add_(2.0)
        d = sampler.delta_norms([p, t], before).tolist()
        assert d[0] == pytest.approx((5.0 - step if step == 1 else 1.0) * math.sqrt(TS.sample_size(p.numel())))
        assert d[1] == pytest.approx(2.0 * math.sqrt(TS.sample_size(t.numel())))


def test_histogram_leaves_out_nan_and_inf():
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    head, hist, _ = stats(x)
    assert head["nonfinite"] == 2 and sum(hist) == 2


def test_histogram_bins_by_table_equal_the_binary_search():
    """The histogram's bins come from a table indexed by a float's top 16 bits; every finite float32 prefix,
    at both ends of its range and in between, and the edges with their neighbours, land in the bin a binary
    search over the edges gives."""
    prefixes = torch.arange(1 << 16, dtype=torch.int64) << 16
    low_bits = torch.cat([torch.tensor([0, 1, 0xFFFE, 0xFFFF]), torch.randint(0, 1 << 16, (12,))])
    bits = (prefixes[:, None] | low_bits[None, :]).reshape(-1)
    x = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    edges = torch.tensor(HIST_EDGES)
    x = torch.cat([x, edges, torch.nextafter(edges, edges - 1), torch.nextafter(edges, edges + 1),
                   torch.tensor([0.0, -0.0])])
    x = x[torch.isfinite(x)]
    assert torch.equal(H._bins(x), torch.bucketize(x, edges, right=True))


def reference_row(x, udim):
    """Straightforward statistics of one output, for comparison with the batched path."""
    xf = x.detach().double().reshape(-1)
    finite = xf[torch.isfinite(xf)]
    stride = max(1, xf.numel() // M.HIST_SAMPLE)
    sample = x.detach().float().reshape(-1)[::stride][:M.HIST_SAMPLE]
    sample = sample[torch.isfinite(sample)]
    hist = [0] * HIST_BINS
    for v in sample.tolist():
        hist[sum(1 for e in HIST_EDGES if v >= e)] += 1
    return {"mean": finite.mean().item(), "std": finite.std(correction=0).item(),
            "absmax": finite.abs().max().item(), "nonfinite": xf.numel() - finite.numel(), "hist": hist}


@pytest.mark.parametrize("scalar_reads_free", [True, False], ids=["cpu-layout", "accelerator-layout"])
def test_a_step_of_mixed_calls_matches_references(monkeypatch, scalar_reads_free):
    """One fetch holding calls of every layout, interleaved with plain chunks, twice (the second
    step reuses the cached index plan with new values). The accelerator layout (NaN/Inf count
    taken on the device, into the chunk) is exercised on CPU tensors."""
    monkeypatch.setattr(M, "MAX_UNITS", 64)
    torch.manual_seed(0)
    activity = M.UnitActivity(window=16)
    for step in range(2):
        calls = [(torch.randn(8, 6, 5, 5) * 2 + 1, 1, "conv"),
                 (torch.randn(2, 7, 12).relu(), 2, "seq"),
                 (torch.randn(30), 0, "vector"),
                 (torch.randn(300) * 5, 0, "vector-above-cap"),        # 300 units > MAX_UNITS
                 (torch.randn(4, 100) + 3, 1, "units-above-cap"),      # 100 units > MAX_UNITS
                 (torch.tensor(3.5), 0, "scalar"),
                 (torch.randn(3000, 4).double(), 1, "float64"),
                 (torch.randn(16, 8).half(), 1, "half")]
        calls[1][0][:, :, :3] = 0                                   # 3 of 12 units silent
        calls[2][0][5] = float("nan")
        m = M.StepMeasurements()
        slots, plain = [], []
        for i, (x, udim, key) in enumerate(calls):
            plain.append((m.add(torch.tensor([float(i), -float(i)])), [float(i), -float(i)]))
            chunk, layout = M.call_chunk(x, [], udim, "tanh" if key == "seq" else None, scalar_reads_free)
            assert (layout.nonfinite is None) == (not scalar_reads_free)
            slots.append(m.add_call(chunk, layout, key))
        values = m.fetch(activity, step)
        for slot, expected in plain:
            assert values[slot] == expected
        for slot, (x, udim, key) in zip(slots, calls, strict=False):
            row, ref = values[slot], reference_row(x, udim)
            head = dict(zip(H.CALL_FIELDS, row[:len(H.CALL_FIELDS)], strict=False))
            assert head["nonfinite"] == ref["nonfinite"], key
            assert row[len(H.CALL_FIELDS):] == ref["hist"], key
            assert head["zero_frac"] == pytest.approx(ref["hist"][ZERO_BIN] / sum(ref["hist"])), key
            if ref["nonfinite"]:
                assert math.isnan(head["mean"]), key
                continue
            tol = 2e-3 if x.dtype == torch.float16 else 1e-4
            assert head["mean"] == pytest.approx(ref["mean"], rel=tol, abs=tol), key
            assert head["std"] == pytest.approx(ref["std"], rel=tol, abs=tol), key
            assert head["absmax"] == pytest.approx(ref["absmax"], rel=tol), key
            expected_dead = {"seq": 0.25, "conv": 0.0, "float64": 0.0, "half": 0.0}.get(key, H.NOT_APPLICABLE)
            assert head["dead_frac"] == pytest.approx(expected_dead), key
            expected_sat = (x.abs() > 0.99).float().mean().item() if key == "seq" else H.NOT_APPLICABLE
            assert head["sat_frac"] == pytest.approx(expected_sat), key


def test_calls_of_one_module_fold_their_unit_activity():
    """A module called twice in a step (shared weights): a unit silent in one call but active in
    the other is alive, and both calls report the module's dead fraction after the step."""
    a, b = torch.zeros(4, 3), torch.zeros(4, 3)
    a[0, 0], b[1, 1] = 1.0, -2.0                   # unit 2 silent in both calls
    m = M.StepMeasurements()
    sa = m.add_call(*M.call_chunk(a, [], 1, None), key="shared")
    sb = m.add_call(*M.call_chunk(b, [], 1, None), key="shared")
    other = m.add_call(*M.call_chunk(torch.zeros(4, 3), [], 1, None), key="other")
    values = m.fetch(M.UnitActivity(16), 0)
    dead = H.CALL_FIELDS.index("dead_frac")
    assert values[sa][dead] == values[sb][dead] == pytest.approx(1 / 3)
    assert values[other][dead] == 1.0


@pytest.mark.parametrize("scalar_reads_free", [True, False], ids=["cpu", "nan-forces-the-count"])
def test_small_outputs_reduced_at_the_end_match_the_in_hook_chunks(scalar_reads_free):
    """Small outputs are copied in the hook and reduced together at the end of the step: every row must
    equal what call_chunk's in-hook reductions give, for every layout, twice (the second step reuses the
    cached plan with new values)."""
    torch.manual_seed(0)
    for step in range(2):
        calls = [(torch.randn(2, 6, 4, 4) * 2 + 1, 1, None, "conv"),
                 (torch.randn(2, 7, 12).relu(), 2, "tanh", "seq"),
                 (torch.randn(30), 0, None, "vector"),
                 (torch.tensor(3.5), 0, None, "scalar"),
                 (torch.randn(16, 8).half(), 1, None, "half"),
                 (torch.rand(5, 9), 1, "sigmoid", "probabilities")]
        calls[1][0][:, :, :3] = 0                                   # 3 of 12 units silent
        if not scalar_reads_free:
            calls[2][0][5] = float("nan")                           # the batch then counts NaN/Inf per call
        batched, direct = M.StepMeasurements(), M.StepMeasurements()
        pairs = []
        for x, udim, sat, key in calls:
            pairs.append((batched.add_small_call(x, udim, sat, key),
                          direct.add_call(*M.call_chunk(x, [], udim, sat), key=key), key))
        got, want = batched.fetch(M.UnitActivity(16), step), direct.fetch(M.UnitActivity(16), step)
        for b, d, key in pairs:
            k = len(H.CALL_FIELDS)
            assert got[b][k:] == want[d][k:], key                    # the same histogram sample
            for name, g, w in zip(H.CALL_FIELDS, got[b][:k], want[d][:k], strict=True):
                if isinstance(w, float) and math.isnan(w):
                    assert math.isnan(g), (key, name)
                else:
                    assert g == pytest.approx(w, rel=1e-5, abs=1e-6), (key, name)


@pytest.mark.parametrize("rows", [256, 8], ids=["large-outputs", "small-outputs"])
def test_stored_zero_fraction_is_the_share_of_zeros_in_each_output(tmp_path, rows):
    """The zero fraction of a module called once per step, as stored, for outputs reduced in the hook (large) and
    at the end of the step (small): a ReLU after a Linear whose bias puts a known share of units below zero.
    (It was stored as 0.0 for every module called once: the zero fraction's name was reused for a zero tensor.)"""
    import sqlite3

    import probes
    from probes.capture import batch

    assert (rows * 64 > batch.SMALL_OUTPUT) == (rows == 256)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
        model[0].bias.copy_(torch.where(torch.arange(64) < 48, -1.0, 1.0))     # 48 of 64 units below zero
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    expected = []
    model[1].register_forward_hook(lambda m, a, out: expected.append((out == 0).double().mean().item()))
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(3):
            loss = model(torch.randn(rows, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    con = sqlite3.connect(w.store_path)
    stored = [z for (z,) in con.execute("SELECT s.zero_frac FROM module_stats s JOIN modules m USING(rank, module_id) "
                                        "WHERE m.path = '1' ORDER BY s.step")]
    con.close()
    assert expected == [0.75] * 3
    assert stored == pytest.approx(expected)


def test_a_column_as_floats_with_none_as_nan():
    from probes.capture.decode import floats

    assert floats([1, 2.5, True]).tolist() == [1.0, 2.5, 1.0]
    mixed, empty_column = floats([None, 2.0]), floats([None, None, None])
    assert math.isnan(mixed[0]) and mixed[1] == 2.0 and mixed.dtype == torch.float64
    assert empty_column.shape == (3,) and torch.isnan(empty_column).all() and empty_column.dtype == torch.float64
    assert floats([]).numel() == 0
