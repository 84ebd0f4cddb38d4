"""Static structural audit: findings that need no forward pass."""
from __future__ import annotations

from typing import Any

from torch import nn

from . import findings as F
from .findings import Finding
from .structure import (ModelStructure, build_structure, is_mode_sensitive, normalize_optimizers,
                        subtree_has_state_or_modes)


def _fmt(n: int) -> str:
    return f"{n:,}"


def structural_findings(s: ModelStructure, step: int | None = None) -> list[Finding]:
    out: list[Finding] = []
    modules = s.modules
    for node in modules:
        if not node.top_level_unregistered or node.module is None:
            continue
        sub = node.module
        n_tensors = sum(1 for _ in sub.parameters())
        numel = node.params_total
        modes = sorted({type(m).__name__ for m in sub.modules() if is_mode_sensitive(m)})
        matters = subtree_has_state_or_modes(sub)
        owner = modules[node.parent_id].path if node.parent_id is not None else ""
        msg = (f"{node.type} at {node.path or '<root>'} is held in a plain Python attribute/container, "
               f"not registered: ")
        if matters:
            msg += (f"its {n_tensors} parameter tensors ({_fmt(numel)} numbers) run in forward and get "
                    "gradients but are invisible to model.parameters(), the optimizer, state_dict(), "
                    ".to() and .eval().")
        else:
            msg += "it holds no parameters or buffers, so only .train()/.eval() miss it."
        out.append(F.make("unregistered-module", node.path, msg, severity=None if matters else "info",
                          evidence={"type": node.type, "parameter_tensors": n_tensors,
                                    "parameter_numbers": numel, "reachable_from": owner or "<root>",
                                    "mode_sensitive": modes}, step=step))
    for t in s.tensors:
        owner_kind = modules[t.module_id].kind if t.module_id is not None else "registered"
        if t.kind == "tensor" and owner_kind == "registered":
            what = "an nn.Parameter" if t.is_parameter else "a plain tensor"
            if t.requires_grad:
                msg = (f"{t.path} is {what} with requires_grad=True stored as an ordinary attribute: it "
                       "gets gradients, but the optimizer, state_dict(), .to() and .cuda() never see it.")
            else:
                msg = (f"{t.path} is a plain tensor attribute, neither a Parameter nor a buffer: .to() "
                       "does not move it and state_dict() does not save it.")
            out.append(F.make("unregistered-tensor", t.path, msg,
                              severity="error" if t.requires_grad else "warning",
                              evidence={"shape": t.shape, "dtype": t.dtype, "device": t.device,
                                        "requires_grad": t.requires_grad,
                                        "is_parameter": t.is_parameter}, step=step))
        if t.kind == "parameter":
            if not t.requires_grad:
                out.append(F.make("frozen-parameter", t.path,
                                  f"{t.path} has requires_grad=False: it is saved and moved but never "
                                  "trained.", evidence={"shape": t.shape,
                                                        "in_optimizer": t.in_optimizer}, step=step))
            elif s.n_optimizers and not t.in_optimizer:
                out.append(F.make("not-in-optimizer", t.path,
                                  f"{t.path} requires grad, but no param group of the watched optimizer(s) "
                                  "holds it (membership is by object identity): its gradient is computed, "
                                  "but optimizer.step() never updates it and zero_grad() never clears it.",
                                  evidence={"shape": t.shape, "numel": t.numel}, step=step))
            if t.aliases:
                out.append(F.make("shared-parameter", t.path,
                                  f"{t.path} is the same Parameter as {', '.join(t.aliases)} (tied "
                                  "weights).", evidence={"aliases": list(t.aliases), "shape": t.shape},
                                  step=step))
    for st in s.stale:
        where = (f"optimizer.param_groups[{st.group}]['params'][{st.index}]" if s.n_optimizers == 1
                 else f"optimizer[{st.opt_index}].param_groups[{st.group}]['params'][{st.index}]")
        hint = (f" It has the shape of {st.looks_like}, which the optimizer does not hold: the module "
                "was probably replaced after the optimizer was built.") if st.looks_like else ""
        out.append(F.make("stale-optimizer-param", where,
                          f"The optimizer holds a tensor of shape {st.shape} that is not part of the "
                          f"model: it updates a tensor the model no longer uses.{hint}",
                          evidence={"optimizer": st.opt_index, "group": st.group, "index": st.index,
                                    "shape": st.shape, "replaced": st.looks_like}, step=step))
    return out


def audit(model: nn.Module, optimizer: Any = None) -> list[Finding]:
    """Static structural audit of ``model`` (no forward pass): unregistered modules and tensors,
    optimizer membership, stale optimizer entries, frozen and shared parameters."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__qualname__}: {model!r:.80}")
    optimizers = normalize_optimizers(optimizer)
    return F.sort_findings(structural_findings(build_structure(model, optimizers)))
