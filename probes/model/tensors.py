"""The model's tensors as the host may read them: which devices' values the host reads without a device sync,
numbers read only where that is free, and a rank's own shard of a distributed tensor."""

from __future__ import annotations

import torch

# device types whose values the host reads without waiting for the device. On these a hook reads a scalar where
# that saves work (a finite E[x^2] means there is no NaN/Inf to count); on every other device nothing of a sampled
# step is read before its one host copy (tests/probes/test_host_reads.py runs that path on CPU tensors by emptying
# this set)
FREE_READ_DEVICES = frozenset({"cpu"})


def reads_free(device: torch.device) -> bool:
    """Whether the host reads a value on ``device`` without a device sync (the CPU)."""
    return device.type in FREE_READ_DEVICES


def host_number(value: object) -> float | None:
    """``value`` (a param group's lr, say) as a float when the host can read it without a device sync: a Python
    number, or a one-value tensor on a device whose reads are free; None for a tensor held on an accelerator and
    for anything that is not a number."""
    if isinstance(value, torch.Tensor) and not reads_free(value.device):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (FSDP2, tensor parallelism), else the
    tensor itself. No communication."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t
