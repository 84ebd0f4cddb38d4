"""A checkpoint's keys and shapes against the model a run store describes: pure functions over plain data (no
torch, no I/O), used by ``modscope checkpoint`` (dashboard/commands/checkpoint.py).

The model's side is the store's ``params`` table: every registered parameter and persistent buffer is a key of
``model.state_dict()`` (under its path and its aliases, tied weights); the tensors of unregistered modules and the
plain tensor attributes are in no ``state_dict()``, so no checkpoint file can hold them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from probes.schema import KeyPrefix, ModuleKind, TensorKind, key_prefix

# keys a state_dict() holds that the store does not list (a module's get_extra_state()): never "unexpected"
EXTRA_STATE_SUFFIX = "_extra_state"


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """One entry of a checkpoint: its shape and dtype (None for a value that is not a tensor)."""

    shape: tuple[int, ...] | None
    dtype: str | None


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of the model as the store's ``params`` table lists it, with the module that holds it
    (``Store.checkpoint_tensors``)."""

    path: str
    aliases: tuple[str, ...]           # its other state_dict names (tied weights)
    shape: tuple[int, ...] | None      # None: not initialised yet (a lazy module)
    numel: int
    dtype: str | None
    kind: str                          # TensorKind
    requires_grad: bool
    registered: bool
    is_parameter: bool
    in_state_dict: bool
    module_path: str | None
    module_kind: str | None            # ModuleKind
    module_type: str | None


@dataclasses.dataclass(frozen=True)
class ModelTensor:
    """A tensor ``model.state_dict()`` holds, under ``key`` and its ``aliases`` (tied weights)."""

    key: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...] | None      # None: not initialised yet (a lazy module)
    kind: str                          # TensorKind: parameter or buffer
    trained: bool                      # a parameter with requires_grad


@dataclasses.dataclass(frozen=True)
class UnheldTensor:
    """A tensor of the model that no state_dict() holds, so no checkpoint can: it lives in an unregistered module,
    or is a plain tensor attribute."""

    path: str
    shape: tuple[int, ...] | None
    numel: int
    module_path: str | None            # the unregistered module it lives in (None: a plain tensor attribute)
    module_type: str | None
    trained: bool                      # a Parameter or requires_grad: learned values a restore would lose

    @property
    def learned(self) -> bool:
        """Values a reload loses: anything of an unregistered module (weights, running statistics), or a plain
        tensor attribute that trains (a constant recomputed at construction is not lost)."""
        return self.module_path is not None or self.trained


@dataclasses.dataclass(frozen=True)
class ModelKeys:
    tensors: tuple[ModelTensor, ...]
    unheld: tuple[UnheldTensor, ...]

    @classmethod
    def from_store(cls, stored: Iterable[StoredTensor]) -> ModelKeys:
        """From ``Store.checkpoint_tensors``."""
        tensors, unheld = [], []
        for r in stored:
            trained = r.requires_grad and r.kind != TensorKind.BUFFER
            if r.registered:
                if r.in_state_dict:
                    tensors.append(ModelTensor(r.path, r.aliases, r.shape, r.kind, trained))
                continue                  # a non-persistent buffer: in no state_dict, rebuilt with the model
            outside = r.module_kind in (ModuleKind.UNREGISTERED, ModuleKind.RUNTIME)
            unheld.append(UnheldTensor(r.path, r.shape, r.numel, r.module_path if outside else None,
                                       r.module_type if outside else None, trained or r.is_parameter))
        return cls(tuple(tensors), tuple(unheld))

    def keys(self) -> dict[str, ModelTensor]:
        out: dict[str, ModelTensor] = {}
        for t in self.tensors:
            for k in (t.key, *t.aliases):
                out[k] = t
        return out


@dataclasses.dataclass(frozen=True)
class ShapeMismatch:
    key: str
    model_shape: tuple[int, ...]
    file_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TiedKey:
    """A key the file lacks whose tensor it holds under another name (tied weights): values load, strict does not."""

    key: str
    loaded_as: str


@dataclasses.dataclass(frozen=True)
class KeyComparison:
    missing: tuple[ModelTensor, ...]      # keys the model needs that the file lacks (by key: ``missing_keys``)
    missing_keys: tuple[str, ...]
    unexpected: tuple[str, ...]           # keys the file has that the model lacks
    shapes: tuple[ShapeMismatch, ...]
    tied: tuple[TiedKey, ...]
    matched: int                          # keys present in both

    @property
    def loads(self) -> bool:
        """Every tensor of the model's state_dict gets a value of the right shape."""
        return not self.missing_keys and not self.shapes


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The file as it is, the prefix that explains its mismatch (if any) and the file with that prefix fixed, and
    what no file can hold."""

    keys: KeyComparison
    prefix: KeyPrefix | None
    with_prefix_fixed: KeyComparison | None
    unheld: tuple[UnheldTensor, ...]
    n_file: int
    n_model: int

    @property
    def lost(self) -> tuple[UnheldTensor, ...]:
        """Learned values outside every state_dict (see UnheldTensor.learned)."""
        return tuple(u for u in self.unheld if u.learned)

    @property
    def complete(self) -> bool:
        """The file restores the model: every key, every shape, and nothing learned lives outside state_dict()."""
        return self.keys.loads and not self.lost

    def exit_status(self) -> int:
        return 0 if self.complete else 1


def compare_keys(model: Mapping[str, ModelTensor], file: Mapping[str, FileTensor]) -> KeyComparison:
    missing_keys = [k for k in model if k not in file]
    loaded = {id(model[k]) for k in model if k in file}
    tied: list[TiedKey] = []
    missing: list[ModelTensor] = []
    really_missing: list[str] = []
    for k in missing_keys:
        t = model[k]
        if id(t) in loaded:
            tied.append(TiedKey(k, next(a for a in (t.key, *t.aliases) if a in file)))
        else:
            really_missing.append(k)
            if not any(m is t for m in missing):
                missing.append(t)
    unexpected = [k for k in file if k not in model and not k.endswith(EXTRA_STATE_SUFFIX)]
    shapes = []
    for k, f in file.items():
        held = model.get(k)
        if held is not None and held.shape is not None and f.shape is not None and held.shape != f.shape:
            shapes.append(ShapeMismatch(k, held.shape, f.shape))
    return KeyComparison(tuple(missing), tuple(sorted(really_missing)), tuple(sorted(unexpected)),
                         tuple(sorted(shapes, key=lambda s: s.key)), tuple(tied),
                         sum(1 for k in file if k in model))


def compare(model: ModelKeys, file: Mapping[str, FileTensor]) -> Comparison:
    keys = model.keys()
    found = compare_keys(keys, file)
    prefix = key_prefix(found.missing_keys, found.unexpected) if found.missing_keys and found.unexpected else None
    fixed = compare_keys(keys, apply_prefix(file, prefix)) if prefix is not None else None
    return Comparison(found, prefix, fixed, model.unheld, len(file), len(keys))


def apply_prefix(file: Mapping[str, FileTensor], prefix: KeyPrefix) -> dict[str, FileTensor]:
    """The file's keys as they would be with ``prefix`` fixed: stripped where the file carries it, added where the
    model's keys do."""
    p = prefix.prefix
    if prefix.in_file:
        return {(k[len(p):] if k.startswith(p) else k): v for k, v in file.items()}
    return {p + k: v for k, v in file.items()}


def shape_text(shape: Sequence[int] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"
