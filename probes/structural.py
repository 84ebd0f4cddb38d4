"""Structural findings: what the structure walk alone shows, with no forward pass."""

from __future__ import annotations

from . import findings
from .findings import Finding
from .schema import ModuleKind, TensorKind
from .structure import (
    ModelStructure,
    is_mode_sensitive,
    subtree_has_state_or_modes,
)


def structural_findings(s: ModelStructure, step: int | None = None) -> list[Finding]:
    """Unregistered modules and tensors, optimizer membership, stale optimizer entries, frozen and shared
    parameters: everything the structure walk alone shows."""
    out: list[Finding] = []
    # by id, not position: a watcher's index gives modules run-stable ids, which stop matching positions in the
    # list once a module is added or removed mid-run
    modules = {n.module_id: n for n in s.modules}
    for node in s.modules:
        if not node.top_level_unregistered or node.module is None:
            continue
        sub = node.module
        modes = sorted({type(m).__name__ for m in sub.modules() if is_mode_sensitive(m)})
        owner = modules[node.parent_id].path if node.parent_id is not None else ""
        out.append(findings.unregistered_module(node.path, node.type, sum(1 for _ in sub.parameters()),
                                                node.params_total, owner, modes,
                                                subtree_has_state_or_modes(sub), step))
    for t in s.tensors:
        owner_kind = modules[t.module_id].kind if t.module_id is not None else ModuleKind.REGISTERED
        if t.kind == TensorKind.TENSOR and owner_kind == ModuleKind.REGISTERED:
            out.append(findings.unregistered_tensor(t.path, is_parameter=t.is_parameter,
                                                    requires_grad=t.requires_grad, shape=t.shape, dtype=t.dtype,
                                                    device=t.device, step=step))
        if t.kind == TensorKind.PARAMETER:
            if not t.requires_grad:
                out.append(findings.frozen_parameter(t.path, t.shape, t.in_optimizer, step))
            elif s.n_optimizers and not t.in_optimizer:
                out.append(findings.not_in_optimizer(t.path, t.shape, t.numel, step))
            if t.aliases:
                out.append(findings.shared_parameter(t.path, t.aliases, t.shape, step))
    for st in s.stale:
        where = (f"optimizer.param_groups[{st.group}]['params'][{st.index}]" if s.n_optimizers == 1
                 else f"optimizer[{st.opt_index}].param_groups[{st.group}]['params'][{st.index}]")
        out.append(findings.stale_optimizer_param(where, st.shape, st.opt_index, st.group, st.index, st.looks_like,
                                                  step))
    return out

