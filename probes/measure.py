"""Device-side statistics. Everything is reduced where the tensor lives and appended to one
list of small device vectors; ``StepMeasurements.fetch()`` copies them to the host once per
device per sampled step (one host sync), never ``.item()`` per tensor."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import torch

from .schema import HIST_BINS, HIST_EDGES

# layout of a call row: CALL_FIELDS, then HIST_BINS histogram counts
CALL_FIELDS = ("mean", "std", "absmax", "zero_frac", "dead_frac", "sat_frac", "nonfinite")
CALL_WIDTH = len(CALL_FIELDS) + HIST_BINS
HIST_SAMPLE = 1024            # the histogram is taken on at most this many evenly strided values
UPDATE_SAMPLE = 4096          # values per tensor compared across optimizer.step() for the update norm
_FLOAT_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
NOT_APPLICABLE = -1.0


def float_tensors(output: Any, limit: int = 16) -> list[torch.Tensor]:
    """Floating tensors in a module output: tensor, tuple/list, dict/ModelOutput, dataclass, None."""
    found: list[torch.Tensor] = []

    def visit(obj: Any, depth: int) -> None:
        if len(found) >= limit or depth > 3 or obj is None:
            return
        if isinstance(obj, torch.Tensor):
            if obj.dtype in _FLOAT_TYPES and obj.layout == torch.strided and obj.device.type != "meta":
                found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name, None), depth + 1)

    visit(output, 0)
    return found


def primary(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    for t in tensors:
        if t.dim() >= 1 and t.numel() > 0:
            return t
    return tensors[0] if tensors and tensors[0].numel() > 0 else None


class StepMeasurements:
    """Small device vectors gathered during one sampled step, fetched in one copy per device."""

    def __init__(self) -> None:
        self._chunks: list[torch.Tensor] = []
        self._edges: dict[torch.device, torch.Tensor] = {}

    def add(self, vec: torch.Tensor) -> int:
        self._chunks.append(vec.detach().reshape(-1).to(torch.float32))
        return len(self._chunks) - 1

    def edges(self, device: torch.device) -> torch.Tensor:
        """Histogram edges with -inf/+inf ends (HIST_BINS bins), cached per device."""
        e = self._edges.get(device)
        if e is None:
            inf = float("inf")
            e = self._edges[device] = torch.tensor([-inf, *HIST_EDGES, inf], dtype=torch.float32, device=device)
        return e

    def fetch(self) -> list[list[float]]:
        """Host copies of every chunk, in order: one concatenation and one copy per device."""
        if not self._chunks:
            return []
        by_device: dict[torch.device, list[int]] = {}
        for i, c in enumerate(self._chunks):
            by_device.setdefault(c.device, []).append(i)
        out: list[list[float]] = [[] for _ in self._chunks]
        for idx in by_device.values():
            flat = torch.cat([self._chunks[i] for i in idx]).cpu().tolist()
            pos = 0
            for i in idx:
                n = self._chunks[i].numel()
                out[i] = flat[pos:pos + n]
                pos += n
        self._chunks.clear()
        return out


_CONSTS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _const(value: float, device: torch.device) -> torch.Tensor:
    t = _CONSTS.get((value, device))
    if t is None:
        t = _CONSTS[(value, device)] = torch.full((), value, dtype=torch.float32, device=device)
    return t


ZERO_BIN = HIST_EDGES.index(1e-6)     # the bin [-1e-6, 1e-6)


def call_vector(x: torch.Tensor, extra_nonfinite: Sequence[torch.Tensor], udim: int, sat_kind: str | None,
                last_active: torch.Tensor | None, sample_index: int, window: int,
                edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Statistics of one module output as one device vector (CALL_WIDTH), plus the updated
    per-unit 'last active sample' vector used for dead units over the window.

    Chosen for speed: mean and E[x^2] (a dot product) instead of Welford's std_mean (60x slower
    on CPU); std is exactly 0 when min == max; per-unit activity from amax/amin over the
    non-unit dims; the histogram (and from its zero bin, the zero fraction) from <= HIST_SAMPLE evenly strided values;
    the NaN/Inf count only when the mean or E[x^2] is not finite (on the CPU, where reading a
    scalar costs no device sync) and always on accelerators."""
    with torch.no_grad():
        xf = x.detach()
        if xf.dtype not in (torch.float32, torch.float64):
            xf = xf.float()
        flat = xf.reshape(-1)
        n = flat.numel()
        on_cpu = flat.device.type == "cpu"
        mean = flat.mean()
        sq = torch.dot(flat, flat) / n
        if xf.dim() >= 1:
            dims = tuple(d for d in range(xf.dim()) if d != udim)
            if dims:
                unit_max, unit_min = xf.amax(dim=dims), xf.amin(dim=dims)
                amax, amin = unit_max.max(), unit_min.min()
                active = (unit_max > 0) | (unit_min < 0)
            else:
                amin, amax = torch.aminmax(flat)
                active = xf != 0
            if last_active is None or last_active.shape != active.shape or last_active.device != active.device:
                last_active = torch.full(active.shape, -1, dtype=torch.int64, device=active.device)
            new_last = torch.where(active, sample_index, last_active)
            dead = (new_last < max(0, sample_index - window + 1)).to(torch.float32).mean()
        else:
            amin, amax = torch.aminmax(flat)
            new_last = last_active
            dead = _const(NOT_APPLICABLE, xf.device)
        std = torch.where(amax == amin, 0.0, (sq - mean * mean).clamp_min(0.0).sqrt())
        absmax = torch.maximum(amax, -amin)
        finite_known = on_cpu and not extra_nonfinite and bool(torch.isfinite(mean + sq))
        if finite_known:
            nonfinite = _const(0.0, xf.device)
        else:
            nonfinite = (n - torch.isfinite(flat).sum()).to(torch.float32)
            for t in extra_nonfinite:
                nonfinite = nonfinite + (t.numel() - torch.isfinite(t.detach()).sum())
        if sat_kind == "tanh":
            sat = (flat.abs() > 0.99).to(torch.float32).mean()
        elif sat_kind == "sigmoid":
            sat = ((flat < 0.01) | (flat > 0.99)).to(torch.float32).mean()
        else:
            sat = _const(NOT_APPLICABLE, xf.device)
        stride = max(1, n // HIST_SAMPLE)
        sample = flat[::stride][:HIST_SAMPLE].to(torch.float32)
        # the histogram counts finite values only (NaN/Inf are counted in `nonfinite`)
        if on_cpu:
            hist = torch.histogram(sample if finite_known else sample[torch.isfinite(sample)],
                                   bins=edges).hist
        else:
            finite = torch.isfinite(sample)
            ge = ((sample.unsqueeze(1) >= edges[1:-1]) & finite.unsqueeze(1)).sum(0).to(torch.float32)
            m = finite.sum().to(torch.float32)           # deterministic, no atomics, no sync
            hist = torch.cat([(m - ge[:1]), ge[:-1] - ge[1:], ge[-1:]])
        # the zero fraction is read on the host from the histogram's zero bin (|x| < 1e-6)
        zero_frac = _const(NOT_APPLICABLE, xf.device)
        head = torch.stack([mean.to(torch.float32), std.to(torch.float32), absmax.to(torch.float32),
                            zero_frac, dead, sat, nonfinite])
        return torch.cat([head, hist]), new_last


def norm32(t: torch.Tensor) -> torch.Tensor:
    """L2 norm as a float32 scalar, accumulated in at least float32 (any float dtype)."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(t, dtype=torch.float32)
    return torch.linalg.vector_norm(t).to(torch.float32)


def _groups(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    by_key: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        by_key.setdefault((t.device, t.dtype), []).append(i)
    for idx in by_key.values():
        yield idx, [tensors[i] for i in idx]


_INDEX: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _index(idx: list[int], device: torch.device) -> torch.Tensor:
    """Index tensors on the device, made once (a host-to-device copy per step would be a sync)."""
    key = (tuple(idx), device)
    t = _INDEX.get(key)
    if t is None:
        if len(_INDEX) > 256:
            _INDEX.clear()
        t = _INDEX[key] = torch.tensor(idx, device=device)
    return t


def norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """L2 norms of many tensors as one float32 vector on the first tensor's device."""
    if not tensors:
        return None
    device = tensors[0].device
    groups = list(_groups(tensors))
    if len(groups) == 1 and groups[0][1][0].dtype == torch.float32 and hasattr(torch, "_foreach_norm"):
        with torch.no_grad():
            return torch.stack(torch._foreach_norm(groups[0][1]))
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    with torch.no_grad():
        for idx, group in groups:
            if group[0].dtype == torch.float32 and hasattr(torch, "_foreach_norm"):
                vals = torch.stack(torch._foreach_norm(group))
            else:
                vals = torch.stack([norm32(t) for t in group])
            out[_index(idx, device)] = vals.to(device=device, dtype=torch.float32)
    return out


def _strided(t: torch.Tensor, k: int) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat[::max(1, flat.numel() // k)][:k]


def sample_size(numel: int, k: int = UPDATE_SAMPLE) -> int:
    """How many values ``_strided`` takes from a tensor of ``numel`` values."""
    if numel <= 0:
        return 0
    stride = max(1, numel // k)
    return min(k, -(-numel // stride))


def sample_values(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of up to UPDATE_SAMPLE evenly strided values of each tensor (the whole tensor
    when it is that small): enough to estimate an update's norm without cloning the model."""
    with torch.no_grad():
        return [_strided(t, UPDATE_SAMPLE).clone() for t in tensors]


def sampled_delta_norms(after: Sequence[torch.Tensor], before: list[torch.Tensor]) -> torch.Tensor | None:
    """||after - before|| on the sampled values (scale by sqrt(numel / sample_size) for an estimate)."""
    if not before:
        return None
    with torch.no_grad():
        now = [_strided(t, UPDATE_SAMPLE) for t in after]
        for idx, group in _groups(before):
            cur = [now[i] for i in idx]
            if hasattr(torch, "_foreach_sub_"):
                torch._foreach_sub_(group, cur)
            else:
                for b, a in zip(group, cur):
                    b.sub_(a)
        return norms(before)
