"""State-dict key prefixes: what puts a prefix before every key of a state dict, and the prefix that pairs up the keys a
model needs with the keys a file has, as ``modscope checkpoint`` and the ``checkpoint-keys`` finding name it.

Standard library only: part of the store's contract (:mod:`probes.schema` re-exports it), read by the dashboard
without torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["STATE_DICT_PREFIXES", "KeyPrefix", "key_prefix"]

STATE_DICT_PREFIXES = MappingProxyType({
    "module.": "DistributedDataParallel or DataParallel: the wrapper's state_dict()",
    "_orig_mod.": "torch.compile: the compiled wrapper's state_dict()",
    "model.": "a module that holds the model as .model, such as a LightningModule",
})


@dataclass(frozen=True)
class KeyPrefix:
    """A prefix that explains why a state dict's keys and a model's do not meet: ``in_file``, the file's keys carry it
    and the model's do not (strip it); else the model's keys carry it and the file's do not (load into that part)."""

    prefix: str
    in_file: bool
    explained: int                 # keys it pairs up
    origin: str | None             # what adds it, for a prefix STATE_DICT_PREFIXES knows

    def describe(self) -> str:
        p, who = self.prefix, f" (added by {self.origin})" if self.origin else ""
        if self.in_file:
            return f"{self.explained:,} keys of the file are the model's with {p!r} in front{who}"
        return f"{self.explained:,} keys of the model are the file's with {p!r} in front{who}"

    def fix(self) -> str:
        p = self.prefix
        if self.in_file:
            inner = _INNER_MODULE.get(p, "the unwrapped model")
            return (f"strip it before loading: torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "
                    f"{p!r}), or save {inner}.state_dict()")
        return (f"load into that part: model.{p.rstrip('.')}.load_state_dict(sd), or add the prefix: "
                f"{{{p!r} + k: v for k, v in sd.items()}}")


_INNER_MODULE = {"module.": "model.module", "_orig_mod.": "model._orig_mod", "model.": "model.model"}


def key_prefix(missing: Iterable[str], unexpected: Iterable[str]) -> KeyPrefix | None:
    """The prefix that pairs up the most keys the model needs but the file lacks (``missing``) with keys the file has
    but the model lacks (``unexpected``), when it pairs up at least half of the fewer of them; None otherwise."""
    need, extra = set(missing), set(unexpected)
    counts: dict[tuple[str, bool], int] = {}
    for keys, other, in_file in ((extra, need, True), (need, extra, False)):
        for key in keys:
            i = key.find(".")
            while i != -1:
                if key[i + 1:] in other:
                    counts[(key[:i + 1], in_file)] = counts.get((key[:i + 1], in_file), 0) + 1
                i = key.find(".", i + 1)
    if not counts:
        return None
    (prefix, in_file), n = max(counts.items(), key=lambda kv: (kv[1], kv[0][0] in STATE_DICT_PREFIXES,
                                                               -len(kv[0][0])))
    if 2 * n < min(len(need), len(extra)):
        return None
    return KeyPrefix(prefix, in_file, n, STATE_DICT_PREFIXES.get(prefix))
