"""One bug, one card: a finding that is a consequence of another names it as its cause.

Three Linear layers kept in a plain list are one bug (``unregistered-module``); that their weights do not
update and that their gradients are never zeroed are its consequences. The rules, each from a root cause
to what it explains:

- ``unregistered-module`` at P explains ``not-updating``, ``grad-accumulating`` and
  ``training-mode-mismatch`` at P or below it;
- ``not-in-optimizer`` and ``unregistered-tensor`` at a tensor explain ``not-updating`` and
  ``grad-accumulating`` of that tensor; ``no-gradient`` at a module explains ``not-updating`` of the tensors it names;
- ``not-in-optimizer`` of a replacement explains the ``stale-optimizer-param`` entry of what it replaced;
- ``training-mode-mismatch`` at P, a part left in eval while the model trains, explains ``train-step-in-eval-mode``
  when the mode-sensitive modules it names are all under P (a Hugging Face model from ``from_pretrained()``, in eval
  mode, trained inside a LightningModule);
- ``dead-layer`` at P explains ``dead-layer`` and ``dead-units`` of the modules after it that are dead because their
  input is (the detectors name the first dead layer of the chain, in execution order: ``dead_upstream``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .findings import Finding
from .schema import FindingCode

_TENSOR_CONSEQUENCES = frozenset({FindingCode.NOT_UPDATING, FindingCode.GRAD_ACCUMULATING})
_MODULE_CONSEQUENCES = _TENSOR_CONSEQUENCES | {FindingCode.TRAINING_MODE_MISMATCH}
_DEAD = frozenset({FindingCode.DEAD_LAYER, FindingCode.DEAD_UNITS})


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith((prefix + ".", prefix + "["))


def assign_causes(found: Iterable[Finding]) -> list[Finding]:
    """``found`` with ``cause`` set on every finding another one explains."""
    items = list(found)
    unregistered = sorted((f.path for f in items if f.code == FindingCode.UNREGISTERED_MODULE and f.path),
                          key=len, reverse=True)
    not_in_optimizer = {f.path for f in items if f.code == FindingCode.NOT_IN_OPTIMIZER}
    unregistered_tensors = {f.path for f in items if f.code == FindingCode.UNREGISTERED_TENSOR}
    gradless = {t: f.path for f in items if f.code == FindingCode.NO_GRADIENT
                for t in f.evidence.get("tensors", ()) if isinstance(t, str)}
    keys = {f.key for f in items if f.code == FindingCode.DEAD_LAYER}
    left_in_eval = [f.path for f in items if f.code == FindingCode.TRAINING_MODE_MISMATCH
                    and f.evidence.get("mode_set_after_model") and f.evidence.get("module_training") is False]
    out = []
    for f in items:
        cause: tuple[str, str] | None = None
        if f.code in _MODULE_CONSEQUENCES:
            holder = next((p for p in unregistered if _under(f.path, p)), None)
            if holder is not None:
                cause = (FindingCode.UNREGISTERED_MODULE, holder)
        if cause is None and f.code in _TENSOR_CONSEQUENCES:
            if f.path in not_in_optimizer:
                cause = (FindingCode.NOT_IN_OPTIMIZER, f.path)
            elif f.path in unregistered_tensors:
                cause = (FindingCode.UNREGISTERED_TENSOR, f.path)
            elif f.code == FindingCode.NOT_UPDATING and f.path in gradless:
                cause = (FindingCode.NO_GRADIENT, gradless[f.path])
        upstream = f.evidence.get("dead_upstream") if f.code in _DEAD else None
        if isinstance(upstream, str) and upstream != f.path and (FindingCode.DEAD_LAYER, upstream) in keys:
            cause = (FindingCode.DEAD_LAYER, upstream)
        if f.code == FindingCode.TRAIN_STEP_IN_EVAL_MODE and left_in_eval:
            named = f.evidence.get("modules")
            part = next((p for p in left_in_eval if isinstance(named, list) and named
                         and all(isinstance(m, str) and _under(m, p) for m in named)), None)
            if part is not None:
                cause = (FindingCode.TRAINING_MODE_MISMATCH, part)
        if f.code == FindingCode.STALE_OPTIMIZER_PARAM:
            replaced = f.evidence.get("replaced")
            if isinstance(replaced, str) and replaced in not_in_optimizer:
                cause = (FindingCode.NOT_IN_OPTIMIZER, replaced)
        out.append(dataclasses.replace(f, cause=(str(cause[0]), cause[1])) if cause is not None else f)
    return out
