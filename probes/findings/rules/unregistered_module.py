"""`unregistered-module`: a module the model uses that model.modules() does not hold: kept in a plain Python
container or attribute, or called in forward from a closure, a global or a fresh construction."""

from __future__ import annotations

from collections.abc import Sequence

from ...schema import FindingCode, Severity, display_path
from ..finding import Finding, Seen, fmt_number, make
from .base import Explains, Reads, Relation, Rule


class UnregisteredModule(Rule):
    code = FindingCode.UNREGISTERED_MODULE
    reads = Reads.STRUCTURE
    severities = (
        "error (warning when its parameters are all frozen and it holds no buffer or mode-sensitive module: a "
        "frozen base kept in a plain list misses `state_dict()` and `.to()`); never reported for a module with no "
        "parameters, no buffers and no mode (a stateless helper, drawn in the tree)")
    meaning = (
        "an `nn.Module` reachable from the model's attributes (lists, tuples, dicts, sets, plain objects, any depth) "
        "or executed during forward, but not in `model.modules()`")
    example = "self.blocks = [nn.Linear(64, 64) for _ in range(3)]   # a plain list: fix with nn.ModuleList"
    explains = (Explains(FindingCode.NOT_UPDATING, Relation.AT_OR_BELOW),
                Explains(FindingCode.GRAD_ACCUMULATING, Relation.AT_OR_BELOW),
                Explains(FindingCode.TRAINING_MODE_MISMATCH, Relation.AT_OR_BELOW))

    @staticmethod
    def in_attributes(path: str, type_name: str, n_tensors: int, numel: int, owner: str,
                      mode_sensitive: Sequence[str], step: int | None,
                      frozen_only: bool = False, all_frozen: bool = False) -> Finding:
        """``frozen_only``: every parameter in it has requires_grad=False and it has no buffers and no mode-sensitive
        module (a frozen base kept out of state_dict on purpose, or by mistake): nothing trains it either way, what it
        misses is state_dict() and .to(), a warning. ``all_frozen``: every parameter is frozen but it has buffers or
        mode-sensitive modules (a frozen teacher with BatchNorm): model.eval() not reaching it is what matters."""
        msg = (f"{type_name} at {display_path(path)} is held in a plain Python attribute/container, not "
               "registered: ")
        severity: str | None = None
        if frozen_only:
            msg += (f"its {n_tensors} parameter tensors ({fmt_number(numel)} numbers) are all frozen "
                    f"(requires_grad=False), "
                    "so nothing trains them either way, but state_dict() does not save them and .to()/.cuda() do not "
                    "move them (a forward after model.to(device) fails).")
            severity = Severity.WARNING
        elif all_frozen:
            modes = f" ({', '.join(mode_sensitive)})" if mode_sensitive else ""
            msg += (f"its {n_tensors} parameter tensors ({fmt_number(numel)} numbers) are all frozen "
                    f"(requires_grad=False), "
                    f"but model.eval()/.train() never reach its modules{modes}, so their mode stays whatever it was "
                    "(BatchNorm statistics keep moving to the batches), and state_dict() does not save it nor "
                    ".to()/.cuda() move it.")
        elif n_tensors:
            msg += (f"its {n_tensors} parameter tensors ({fmt_number(numel)} numbers) run in forward and get gradients "
                    "but are invisible to model.parameters(), the optimizer, state_dict(), .to() and .eval().")
        else:
            modes = f" ({', '.join(mode_sensitive)})" if mode_sensitive else ""
            msg += (f"it holds no parameters, but buffers or a mode{modes} that state_dict(), .to() or "
                    ".train()/.eval() never reach.")
        return make(FindingCode.UNREGISTERED_MODULE, path, msg, severity=severity,
                    evidence={"type": type_name, "parameter_tensors": n_tensors, "parameter_numbers": numel,
                              "reachable_from": display_path(owner), "mode_sensitive": list(mode_sensitive),
                              **({"frozen_only": True} if frozen_only else {})},
                    seen=Seen(step))

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
