"""`unregistered-module`: a module the model uses that model.modules() does not hold: kept in a plain Python
container or attribute, or called in forward from a closure, a global or a fresh construction."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from ...schema import FindingCode, Severity, display_path
from ..finding import Finding, Seen, fmt_number, make
from .base import Explains, Reads, Relation, Rule

_LIST_ITEM = re.compile(r"^(?P<container>.+)\[(?P<index>\d+)\]$")
MAX_LAYERS_NAMED = 8           # in the message; the evidence lists up to 200
MAX_LAYERS_KEPT = 200


@dataclasses.dataclass(frozen=True)
class HeldModule:
    """An unregistered module held in the model's attributes that the optimizer, state_dict(), .to() or .eval()
    could miss (what the structure walk saw of it)."""

    path: str
    type: str
    n_tensors: int
    numel: int
    owner: str
    modes: tuple[str, ...]
    frozen_only: bool = False
    all_frozen: bool = False

    def case(self) -> tuple[str, bool, bool, bool]:
        """What makes two modules of one list one finding: the same owner, and the same case (frozen or not)."""
        return self.owner, self.frozen_only, self.all_frozen, self.n_tensors > 0


class UnregisteredModule(Rule):
    code = FindingCode.UNREGISTERED_MODULE
    reads = Reads.STRUCTURE
    severities = (
        "error (warning when its parameters are all frozen and it holds no buffer or mode-sensitive module: a "
        "frozen base kept in a plain list misses `state_dict()` and `.to()`); never reported for a module with no "
        "parameters, no buffers and no mode (a stateless helper, drawn in the tree)")
    meaning = (
        "an `nn.Module` reachable from the model's attributes (lists, tuples, dicts, sets, plain objects, any depth) "
        "or executed during forward, but not in `model.modules()`; the layers of one plain list or tuple are one "
        "finding at the list (`encoder.blocks`), naming them")
    example = "self.blocks = [nn.Linear(64, 64) for _ in range(3)]   # a plain list: fix with nn.ModuleList"
    explains = (Explains(FindingCode.NOT_UPDATING, Relation.AT_OR_BELOW),
                Explains(FindingCode.GRAD_ACCUMULATING, Relation.AT_OR_BELOW),
                Explains(FindingCode.TRAINING_MODE_MISMATCH, Relation.AT_OR_BELOW))

    @staticmethod
    def in_attributes(held: HeldModule, step: int | None, layers: Sequence[str] = ()) -> Finding:
        """``held.frozen_only``: every parameter in it has requires_grad=False and it has no buffers and no
        mode-sensitive module (a frozen base kept out of state_dict on purpose, or by mistake): nothing trains it
        either way, what it misses is state_dict() and .to(), a warning. ``held.all_frozen``: every parameter is
        frozen but it has buffers or mode-sensitive modules (a frozen teacher with BatchNorm): model.eval() not
        reaching it is what matters.
        ``layers``: the modules of one plain list (``held.path`` is the list's): one finding for the bug, naming
        them."""
        path, type_name, n_tensors, numel = held.path, held.type, held.n_tensors, held.numel
        frozen_only, all_frozen, mode_sensitive = held.frozen_only, held.all_frozen, held.modes
        if layers:
            shown = ", ".join(display_path(p) for p in layers[:MAX_LAYERS_NAMED])
            if len(layers) > MAX_LAYERS_NAMED:
                shown += f" and {len(layers) - MAX_LAYERS_NAMED:,} more"
            msg = (f"{len(layers)} {type_name} modules are held in the plain Python list {display_path(path)} "
                   f"({shown}), not registered: ")
        else:
            msg = (f"{type_name} at {display_path(path)} is held in a plain Python attribute/container, not "
                   "registered: ")
        its, it_holds, it = ("their", "they hold", "them") if layers else ("its", "it holds", "it")
        severity: str | None = None
        if frozen_only:
            msg += (f"{its} {n_tensors} parameter tensors ({fmt_number(numel)} numbers) are all frozen "
                    f"(requires_grad=False), "
                    "so nothing trains them either way, but state_dict() does not save them and .to()/.cuda() do not "
                    "move them (a forward after model.to(device) fails).")
            severity = Severity.WARNING
        elif all_frozen:
            modes = f" ({', '.join(mode_sensitive)})" if mode_sensitive else ""
            msg += (f"{its} {n_tensors} parameter tensors ({fmt_number(numel)} numbers) are all frozen "
                    f"(requires_grad=False), "
                    f"but model.eval()/.train() never reach {its} modules{modes}, so their mode stays whatever it "
                    f"was (BatchNorm statistics keep moving to the batches), and state_dict() does not save {it} nor "
                    f".to()/.cuda() move {it}.")
        elif n_tensors:
            msg += (f"{its} {n_tensors} parameter tensors ({fmt_number(numel)} numbers) run in forward and get "
                    "gradients but are invisible to model.parameters(), the optimizer, state_dict(), .to() and "
                    ".eval().")
        else:
            modes = f" ({', '.join(mode_sensitive)})" if mode_sensitive else ""
            msg += (f"{it_holds} no parameters, but buffers or a mode{modes} that state_dict(), .to() or "
                    ".train()/.eval() never reach.")
        return make(FindingCode.UNREGISTERED_MODULE, path, msg, severity=severity,
                    evidence={"type": type_name, "parameter_tensors": n_tensors, "parameter_numbers": numel,
                              "reachable_from": display_path(held.owner), "mode_sensitive": list(mode_sensitive),
                              **({"frozen_only": True} if frozen_only else {}),
                              **({"layers": list(layers[:MAX_LAYERS_KEPT]), "n_layers": len(layers)}
                                 if layers else {})},
                    seen=Seen(step))

    @staticmethod
    def in_attributes_of(held: Sequence[HeldModule], step: int | None) -> list[Finding]:
        """One finding per unregistered module, except that the modules of one plain list (or tuple) in the same
        case are one finding at the list (``encoder.blocks``, naming its layers): one bug, one card, their
        consequences folded under it (``AT_OR_BELOW`` reaches ``encoder.blocks[0].weight``)."""
        lists: dict[tuple[str, tuple[str, bool, bool, bool]], list[HeldModule]] = {}
        for h in held:
            if (m := _LIST_ITEM.match(h.path)) is not None:
                lists.setdefault((m["container"], h.case()), []).append(h)
        out: list[Finding] = []
        done: set[str] = set()
        for h in held:
            if h.path in done:
                continue
            m = _LIST_ITEM.match(h.path)
            group = lists.get((m["container"], h.case()), []) if m is not None else []
            if m is None or len(group) < 2:
                out.append(UnregisteredModule.in_attributes(h, step))
                continue
            done.update(g.path for g in group)
            the_list = HeldModule(
                m["container"], ", ".join(dict.fromkeys(g.type for g in group)), sum(g.n_tensors for g in group),
                sum(g.numel for g in group), h.owner, tuple(sorted({x for g in group for x in g.modes})),
                frozen_only=h.frozen_only, all_frozen=h.all_frozen)
            out.append(UnregisteredModule.in_attributes(the_list, step, layers=[g.path for g in group]))
        return out

    @staticmethod
    def at_run_time(path: str, type_name: str, called_from: str, *, seen_before: bool, same_object: bool,
                    numel: int, step: int | None) -> Finding:
        """A module with parameters, buffers or modes executed inside the model but reachable from none of its
        attributes."""
        caller = display_path(called_from)
        if same_object:
            msg = (f"{type_name} is called inside {caller} but is not reachable from the model's attributes (held "
                   "in a closure or a global): its parameters are invisible to the optimizer, state_dict(), .to() "
                   "and .eval().")
        elif seen_before:
            msg = (f"A new {type_name} is constructed on every forward call inside {caller}: its weights are "
                   "re-initialised each call and never trained, saved or moved.")
        else:
            msg = (f"{type_name} with parameters runs inside {caller} but is not part of the model: the optimizer, "
                   "state_dict(), .to() and .eval() miss it.")
        return make(FindingCode.UNREGISTERED_MODULE, path, msg,
                    evidence={"type": type_name, "called_from": caller, "parameter_numbers": numel,
                              "same_object_each_step": same_object}, seen=Seen(step))
