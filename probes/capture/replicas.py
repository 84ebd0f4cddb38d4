"""What replicas must agree on, taken when a watcher of one rank of a data-parallel job closes.

Sampled steps carry a fingerprint of every replicated parameter and buffer (``param_stats.fingerprint``), but
under the default budget the samples thin out fast: a replica that drifts apart after the first few steps
would only be compared at the next sample, maybe never. At close every rank stores the same values once more
(``params.close_fingerprint``, ``params.close_data_norm``): taken after the last optimizer step, the step all
ranks of the job have finished (``ranks.step``), read to the host once (a sync, at close only).
"""

from __future__ import annotations

import torch

from ..model.index import ModelIndex
from . import tensor_stats

__all__ = ["close_values"]

ReplicaValues = dict[int, tuple[float | None, float | None]]    # param id -> (fingerprint, data norm)


def close_values(index: ModelIndex) -> ReplicaValues:
    """Every replicated tensor's fingerprint and data norm now, by param id."""
    ids = index.fingerprint_tensors()
    by_device: dict[torch.device, list[int]] = {}
    for tid in ids:
        by_device.setdefault(index.tensor(tid).device, []).append(tid)
    out: ReplicaValues = {}
    for group in by_device.values():
        tensors = [index.tensor(t) for t in group]
        fps, norms = tensor_stats.fingerprints(tensors), tensor_stats.norms(tensors)
        if fps is None or norms is None:
            continue
        values = torch.stack([fps.float(), norms.float()]).cpu().tolist()
        out.update(zip(group, zip(values[0], values[1], strict=True), strict=True))
    return out
