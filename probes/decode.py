"""Decoding a sampled step: pure functions from the fetched host values of a :class:`~probes.capture.StepRecord`
to per-module and per-tensor samples (what the detectors read) and to store rows. No hooks, no I/O."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence

from . import measure
from .capture import StepRecord, TensorSlot
from .detectors import ModuleSample, TensorSample
from .records import finite_or_none

Values = Sequence[Sequence[float]]      # one host list per fetched vector, in slot order

_FIELD = {name: i for i, name in enumerate(measure.CALL_FIELDS)}
_K = len(measure.CALL_FIELDS)


@dataclasses.dataclass(frozen=True)
class ModuleStep:
    """A module's statistics in one sampled step, and the modes of its first measured call."""

    sample: ModuleSample
    hist: list[int]
    training: bool | None
    grad_enabled: bool | None


def module_samples(step: int, rec: StepRecord, values: Values) -> dict[int, ModuleStep]:
    """One sample per module measured in the step; several calls are aggregated (mean of means, max of
    abs-max, sum of non-finite counts and histograms; the dead fraction is the window's, so the latest)."""
    out: dict[int, ModuleStep] = {}
    for mid, calls in rec.rows.items():
        first = calls[0]
        if len(calls) == 1:                                  # the common case: one call
            row = values[first.slot]
            agg, hist = list(row[:_K]), list(row[_K:])
        else:
            vecs = [values[c.slot] for c in calls]
            agg = [sum(v[i] for v in vecs) / len(vecs) for i in range(_K)]
            agg[_FIELD["absmax"]] = max(v[_FIELD["absmax"]] for v in vecs)
            agg[_FIELD["dead_frac"]] = vecs[-1][_FIELD["dead_frac"]]
            agg[_FIELD["nonfinite"]] = sum(v[_FIELD["nonfinite"]] for v in vecs)
            hist = [sum(col) for col in zip(*(v[_K:] for v in vecs), strict=True)]
        total = sum(hist)
        zero_frac = hist[measure.ZERO_BIN] / total if total else None
        og = [values[s][0] for s in rec.out_grads.get(mid, [])]
        dead, sat, nonfinite = agg[_FIELD["dead_frac"]], agg[_FIELD["sat_frac"]], agg[_FIELD["nonfinite"]]
        sample = ModuleSample(
            step=step, calls=rec.calls.get(mid, len(calls)), numel=first.numel,
            mean=agg[_FIELD["mean"]], std=agg[_FIELD["std"]], absmax=agg[_FIELD["absmax"]], zero_frac=zero_frac,
            dead_frac=None if dead < 0 else dead, sat_frac=None if sat < 0 else sat,
            nonfinite=int(nonfinite) if not math.isnan(nonfinite) else first.numel,
            out_grad_norm=(sum(og) / len(og)) if og else None, order=first.order)
        out[mid] = ModuleStep(sample, [int(c) for c in hist], first.training, first.grad_enabled)
    return out


def tensor_samples(step: int, rec: StepRecord, values: Values,
                   numel_of: Callable[[int], int]) -> dict[int, TensorSample]:
    """One sample per tensor measured in the step. The update norm measured on the sampled values is
    scaled to the whole tensor; when the sample saw no change but the data norm did, the change of the
    norm is a lower bound of the update."""
    def pick(slots: Mapping[int, TensorSlot], tid: int) -> float | None:
        sp = slots.get(tid)
        return values[sp.slot][sp.pos] if sp is not None else None

    out: dict[int, TensorSample] = {}
    for tid in set(rec.grads) | set(rec.data) | rec.arrived | set(rec.fingerprints):
        stale = values[rec.stale[tid]][0] if tid in rec.stale else None
        data, update, post = pick(rec.data, tid), pick(rec.updates, tid), pick(rec.post, tid)
        if update is not None:
            numel = numel_of(tid)
            k = measure.sample_size(numel)
            update *= math.sqrt(numel / k) if k else 0.0
            if update == 0.0 and post is not None and data is not None and post != data:
                update = abs(post - data)
        out[tid] = TensorSample(step=step, grad_norm=pick(rec.grads, tid), data_norm=data, update_norm=update,
                                stale_grad_norm=stale, arrived=tid in rec.arrived, lr=rec.lrs.get(tid),
                                fingerprint=pick(rec.fingerprints, tid),
                                local_grad_norm=values[rec.local_grads[tid]][0] if tid in rec.local_grads else None)
    return out


def module_stat_rows(rank: int, step: int, modules: Mapping[int, ModuleStep]) -> list[tuple[object, ...]]:
    """Rows of ``module_stats`` (records.MSTAT_COLS), non-finite floats as NULL."""
    rows = []
    for mid, m in modules.items():
        s = m.sample
        rows.append(_finite_row((rank, mid, step, s.calls, s.numel, s.mean, s.std, s.absmax, s.zero_frac,
                                 s.dead_frac, s.sat_frac, s.nonfinite, s.out_grad_norm,
                                 None if m.training is None else int(m.training),
                                 None if m.grad_enabled is None else int(m.grad_enabled),
                                 json.dumps(m.hist))))
    return rows


def param_stat_rows(rank: int, step: int, tensors: Mapping[int, TensorSample]) -> list[tuple[object, ...]]:
    """Rows of ``param_stats`` (records.PSTAT_COLS), non-finite floats as NULL."""
    return [_finite_row((rank, tid, step, s.grad_norm, s.data_norm, s.update_norm,
                         (s.update_norm / s.data_norm) if s.update_norm is not None and s.data_norm else None,
                         s.local_grad_norm, s.fingerprint))
            for tid, s in tensors.items()]


def moved_changes(tensors: Mapping[int, TensorSample], known: Mapping[int, int]) -> dict[int, int]:
    """The tensors whose 'moved' flag changes with this step: 1 once an update changed it (for good),
    0 while every observed update left it unchanged."""
    changes: dict[int, int] = {}
    for tid, s in tensors.items():
        if s.update_norm is None or not s.arrived:
            continue
        moved = 1 if s.update_norm > 0 else 0
        previous = known.get(tid)
        if previous not in (1, moved):
            changes[tid] = max(moved, previous or 0)
    return changes


def _finite_row(row: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(finite_or_none(v) if isinstance(v, float) else v for v in row)
