"""A checkpoint file's state dict as ``modscope checkpoint`` reads it: run as a child process of the command
(``python -m probes.checkpoint_file FILE``), so that the dashboard's process never imports torch. Prints one JSON
object on stdout: ``{"form": how it was found, "tensors": {key: [shape or null, dtype or null]}}``, or
``{"error": one line naming the file}`` with exit status 2.

``torch.load(FILE, weights_only=True, map_location="cpu")``: plain containers and tensors only, never code from the
file; memory-mapped (no tensor data read) where the format allows it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["WRAPPER_KEYS", "CheckpointError", "find_state_dict", "main", "read_state_dict"]

# where training scripts put the model's state dict inside a checkpoint: Lightning's "state_dict", the PyTorch
# tutorial's "model_state_dict", {"model": ...}, DeepSpeed's "module"
WRAPPER_KEYS = ("state_dict", "model_state_dict", "model", "module")


class CheckpointError(Exception):
    """A file that cannot be read as a checkpoint: one line naming it."""


def read_state_dict(path: Path) -> dict[str, Any]:
    """``{"form": ..., "tensors": {key: [shape, dtype]}}`` of the state dict in ``path``."""
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path}: reading a PyTorch checkpoint needs torch (pip install torch); a .safetensors "
                              "file needs nothing") from None
    obj = _torch_load(torch, path)
    state, where = find_state_dict(obj, torch.Tensor)
    if state is None:
        raise CheckpointError(f"{path}: holds no state dict: {where} (expected a dict of tensors, or one under "
                              f"{', '.join(repr(k) for k in WRAPPER_KEYS)})")
    tensors = {str(k): [list(v.shape), str(v.dtype).removeprefix("torch.")] if isinstance(v, torch.Tensor)
               else [None, None] for k, v in state.items()}
    return {"form": where, "tensors": tensors}


def _torch_load(torch: Any, path: Path) -> Any:
    """``torch.load(weights_only=True)``: plain containers and tensors only, never code from the file. Memory-mapped
    (no tensor data read) when the format allows it."""
    import pickle
    try:
        try:
            return torch.load(path, weights_only=True, map_location="cpu", mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, weights_only=True, map_location="cpu")     # the legacy (non-zip) format
    except pickle.UnpicklingError as exc:
        reason = _first_line(exc).removeprefix("Weights only load failed. ")
        raise CheckpointError(f"{path}: torch.load(weights_only=True) refuses it (a pickled object, such as "
                              f"torch.save(model), not a state dict): {reason[:200]}") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: not a checkpoint torch.load can read ({type(exc).__name__}: "
                              f"{_first_line(exc)[:200]})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def find_state_dict(obj: Any, tensor_type: type) -> tuple[Mapping[str, Any] | None, str]:
    """The state dict in a loaded checkpoint, and where it was: the object itself, or under one of WRAPPER_KEYS
    (nested at most 3 deep). (None, what the object is) when there is none."""
    where: list[str] = []
    lightning = isinstance(obj, Mapping) and "pytorch-lightning_version" in obj
    for _ in range(4):
        if not isinstance(obj, Mapping):
            break
        inner = next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
        if _holds_tensors(obj, tensor_type) and (inner is None or not _holds_tensors(obj[inner], tensor_type)):
            break
        if inner is None:
            break
        where.append(inner)
        obj = obj[inner]
    if not isinstance(obj, Mapping) or not _holds_tensors(obj, tensor_type):
        return None, _describe(obj)
    if not where:
        return obj, "a state dict"
    under = "".join(f"[{k!r}]" for k in where)
    return obj, f"{'a Lightning checkpoint' if lightning else 'a checkpoint'}'s state dict under {under}"


def _holds_tensors(obj: Mapping[Any, Any], tensor_type: type) -> bool:
    return bool(obj) and all(isinstance(k, str) for k in obj) and any(isinstance(v, tensor_type) for v in obj.values())


def _describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        keys = ", ".join(repr(k) for k in list(obj)[:8]) + (", ..." if len(obj) > 8 else "")
        return f"a dict with keys {keys}" if obj else "an empty dict"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(json.dumps({"error": "usage: python -m probes.checkpoint_file FILE"}))
        return 2
    try:
        out = read_state_dict(Path(args[0]))
    except CheckpointError as exc:
        print(json.dumps({"error": str(exc)}))
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
