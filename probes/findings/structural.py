"""Structural findings: what the structure walk alone shows, with no forward pass."""

from __future__ import annotations

from ..model.structure import ModelStructure, ModuleNode, is_mode_sensitive, subtree_has_state_or_modes
from ..schema import ModuleKind, TensorKind
from .finding import Finding
from .rules import (
    FrozenParameter,
    HeldModule,
    NotInOptimizer,
    SharedParameter,
    StaleOptimizerParam,
    UnregisteredModule,
    UnregisteredTensor,
)

# an averaged copy of a model (EMA, SWA): its parameters follow the trained ones through update_parameters(),
# never through an optimizer, and torch's AveragedModel copies them with requires_grad=True. By class name, so
# that timm's need no import of timm.
AVERAGED_COPY_TYPES = frozenset({"AveragedModel", "ModelEma", "ModelEmaV2", "ModelEmaV3"})


def averaged_copy_ids(s: ModelStructure) -> set[int]:
    """Ids of the modules inside an averaged copy (the copy's own module included)."""
    by_id = {n.module_id: n for n in s.modules}
    inside: set[int] = set()
    for node in s.modules:
        cur: ModuleNode | None = node
        while cur is not None:
            if cur.type in AVERAGED_COPY_TYPES:
                inside.add(node.module_id)
                break
            cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
    return inside


def structural_findings(s: ModelStructure, step: int | None = None) -> list[Finding]:
    """Unregistered modules and tensors, optimizer membership, stale optimizer entries, frozen and shared
    parameters: everything the structure walk alone shows."""
    out: list[Finding] = []
    # by id, not position: a watcher's index gives modules run-stable ids, which stop matching positions in the
    # list once a module is added or removed mid-run
    modules = {n.module_id: n for n in s.modules}
    averaged = averaged_copy_ids(s)
    out += UnregisteredModule.in_attributes_of(held_modules(s, modules), step)
    model_devices = sorted({t.device for t in s.tensors if t.kind != TensorKind.TENSOR})
    for t in s.tensors:
        owner_kind = modules[t.module_id].kind if t.module_id is not None else ModuleKind.REGISTERED
        if t.kind == TensorKind.TENSOR and owner_kind == ModuleKind.REGISTERED:
            out.append(UnregisteredTensor.build(t.path, is_parameter=t.is_parameter,
                                                    requires_grad=t.requires_grad, shape=t.shape, dtype=t.dtype,
                                                    device=t.device, step=step, model_devices=model_devices))
        if t.kind == TensorKind.PARAMETER:
            if not t.requires_grad:
                pass                       # frozen_findings
            elif s.n_optimizers and not t.in_optimizer and t.module_id not in averaged:
                out.append(NotInOptimizer.build(t.path, t.shape, t.numel, step))
            if t.aliases:
                out.append(SharedParameter.build(t.path, t.aliases, t.shape, step))
    out += frozen_findings(s, modules, step)
    for st in s.stale:
        where = (f"optimizer.param_groups[{st.group}]['params'][{st.index}]" if s.n_optimizers == 1
                 else f"optimizer[{st.opt_index}].param_groups[{st.group}]['params'][{st.index}]")
        out.append(StaleOptimizerParam.build(where, st.shape, st.opt_index, st.group, st.index, st.looks_like,
                                                  step))
    return out



def held_modules(s: ModelStructure, modules: dict[int, ModuleNode]) -> list[HeldModule]:
    """The unregistered modules found in the model's attributes that the optimizer, state_dict(), .to() or .eval()
    could miss, in the walk's order."""
    out: list[HeldModule] = []
    for node in s.modules:
        if not node.top_level_unregistered or node.module is None:
            continue
        sub = node.module
        if not subtree_has_state_or_modes(sub):
            continue        # drawn in the tree: nothing the optimizer, state_dict(), .to() or .eval() could miss
        modes = tuple(sorted({type(m).__name__ for m in sub.modules() if is_mode_sensitive(m)}))
        owner = modules[node.parent_id].path if node.parent_id is not None else ""
        params = list(sub.parameters())
        all_frozen = bool(params) and not any(p.requires_grad for p in params)
        frozen_only = all_frozen and not modes and next(iter(sub.buffers()), None) is None
        out.append(HeldModule(node.path, node.type, len(params), node.params_total, owner, modes,
                              frozen_only=frozen_only, all_frozen=all_frozen))
    return out


# frozen subtrees and tensors beyond which one info at the root counts them all (LoRA on every projection of an LLM
# freezes hundreds of base layers around the adapters)
MAX_FROZEN_FINDINGS = 10


def frozen_findings(s: ModelStructure, modules: dict[int, ModuleNode], step: int | None) -> list[Finding]:
    """Registered parameters with requires_grad=False: one info per frozen subtree (the highest module whose registered
    parameters are all frozen, and none of whose tensors trains), one per frozen tensor of a module that also trains
    (a frozen bias); more than MAX_FROZEN_FINDINGS of those are one info at the root."""
    frozen = [t for t in s.tensors if t.kind == TensorKind.PARAMETER and not t.requires_grad]
    if not frozen:
        return []
    # per module, its subtree's frozen parameters (tensors, numbers, held by an optimizer) and whether any tensor in
    # it trains; children before parents (deepest first), each adding to its parent
    n_frozen: dict[int, list[int]] = {}
    trains: set[int] = set()
    for t in s.tensors:
        if t.module_id is None or t.module_id not in modules:
            continue
        if t.kind == TensorKind.PARAMETER and not t.requires_grad:
            c = n_frozen.setdefault(t.module_id, [0, 0, 0])
            c[0] += 1
            c[1] += t.numel
            c[2] += t.in_optimizer
        elif t.trainable and t.requires_grad:
            trains.add(t.module_id)
    for node in sorted(modules.values(), key=lambda n: -n.depth):
        parent = node.parent_id
        if parent is None or parent not in modules:
            continue
        if node.module_id in trains:
            trains.add(parent)
        own = n_frozen.get(node.module_id)
        if own is not None:
            pc = n_frozen.setdefault(parent, [0, 0, 0])
            for i in range(3):
                pc[i] += own[i]

    def all_frozen(mid: int | None) -> bool:
        return mid is not None and mid in n_frozen and mid not in trains and \
            modules[mid].kind == ModuleKind.REGISTERED

    subtrees = [n for n in modules.values() if all_frozen(n.module_id) and not all_frozen(n.parent_id)]
    alone = [t for t in frozen if not all_frozen(t.module_id)]
    if len(subtrees) + len(alone) > MAX_FROZEN_FINDINGS:
        names = [n.path for n in subtrees] + [t.path for t in alone]
        return [FrozenParameter.many(names, len(subtrees), len(frozen), sum(t.numel for t in frozen),
                                                sum(t.in_optimizer for t in frozen), step)]
    out = [FrozenParameter.module(n.path, n.type, (c := n_frozen[n.module_id])[0], c[1], c[2], step)
           for n in subtrees]
    out += [FrozenParameter.build(t.path, t.shape, t.in_optimizer, step) for t in alone]
    return out
