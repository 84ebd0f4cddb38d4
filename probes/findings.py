"""Findings: what modscope reports. Pure data, no torch.

Every message text lives here, one builder per kind of finding, so the wording of all of them can be
read (and kept consistent) in one place. Codes, severities, badge labels and fixes are part of the
store's contract and live in :mod:`probes.schema`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from .schema import CODES as CODE_INFO
from .schema import SEVERITY_ORDER, FindingCode, Severity, display_path, printable

__all__ = ["CODES", "SEVERITIES", "Finding", "sort_findings"]

SEVERITIES = tuple(str(s) for s in Severity)
# code -> (default severity, fix), the public view of the codes (``probes.CODES``)
CODES: dict[str, tuple[str, str]] = {str(code): (str(info.severity), info.fix) for code, info in CODE_INFO.items()}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem found in a model, at one path.

    ``step`` is the last step it was seen in and ``first_step`` the first; ``count`` how often it was seen
    (sampled steps for a finding about a state, occurrences for one about an event). ``cause`` is the
    ``(code, path)`` of the finding that explains this one (three layers kept in a plain list are
    *unregistered*; that they do not update is a consequence), or None for a root cause.
    """

    code: str
    severity: str
    path: str
    message: str
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    fix: str = ""
    step: int | None = None
    cause: tuple[str, str] | None = None
    first_step: int | None = None
    count: int = 1

    def __post_init__(self) -> None:
        if self.code not in CODE_INFO:
            raise ValueError(f"unknown finding code {self.code!r}; expected one of {sorted(CODE_INFO)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; expected one of {SEVERITIES}")

    @property
    def key(self) -> tuple[str, str]:
        return (self.code, self.path)

    @property
    def is_event(self) -> bool:
        """About something that happened (stays until evidence of the fix), not a state re-checked each step."""
        return CODE_INFO[self.code].event

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "path": self.path, "message": self.message,
                "evidence": dict(self.evidence), "fix": self.fix, "step": self.step, "first_step": self.first_step,
                "count": self.count, "cause": list(self.cause) if self.cause else None}

    def __str__(self) -> str:
        return printable(f"[{self.severity}] {self.code} at {display_path(self.path)}: {self.message}")


def make(code: str, path: str, message: str, evidence: dict[str, Any] | None = None,
         severity: str | None = None, step: int | None = None, cause: tuple[str, str] | None = None,
         first_step: int | None = None, count: int = 1, fix: str | None = None) -> Finding:
    """``fix``: this finding's own, when the code's (schema.CODES) does not fit the case."""
    info = CODE_INFO[code]
    return Finding(code=str(code), severity=str(severity or info.severity), path=path, message=message,
                   evidence=evidence or {}, fix=fix or info.fix, step=step, cause=cause, first_step=first_step,
                   count=count)


@dataclasses.dataclass(frozen=True)
class ModuleGroup:
    """Modules one finding names together (a grouped finding sits at the root or at its first module), and when
    they were seen: the first step of any, the last step of any, the most times any was seen."""

    paths: Sequence[str]
    types: Sequence[str]
    first_step: int
    step: int
    count: int

    @property
    def one(self) -> bool:
        return len(self.paths) == 1

    def shown(self) -> str:
        """The first five paths as users read them, and how many more."""
        paths = self.paths
        return ", ".join(display_path(p) for p in paths[:5]) + (f" and {len(paths) - 5:,} more" if len(paths) > 5
                                                                 else "")

    def evidence(self, **more: Any) -> dict[str, Any]:
        return {"modules": list(self.paths[:50]), "n_modules": len(self.paths), **more}


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (SEVERITY_ORDER[Severity(f.severity)], f.code, f.path))


def _fmt(n: int) -> str:
    return f"{n:,}"


# ------------------------------------------------------------------------------------ structure
def unregistered_module(path: str, type_name: str, n_tensors: int, numel: int, owner: str,
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
        msg += (f"its {n_tensors} parameter tensors ({_fmt(numel)} numbers) are all frozen (requires_grad=False), "
                "so nothing trains them either way, but state_dict() does not save them and .to()/.cuda() do not "
                "move them (a forward after model.to(device) fails).")
        severity = Severity.WARNING
    elif all_frozen:
        modes = f" ({', '.join(mode_sensitive)})" if mode_sensitive else ""
        msg += (f"its {n_tensors} parameter tensors ({_fmt(numel)} numbers) are all frozen (requires_grad=False), "
                f"but model.eval()/.train() never reach its modules{modes}, so their mode stays whatever it was "
                "(BatchNorm statistics keep moving to the batches), and state_dict() does not save it nor "
                ".to()/.cuda() move it.")
    elif n_tensors:
        msg += (f"its {n_tensors} parameter tensors ({_fmt(numel)} numbers) run in forward and get gradients "
                "but are invisible to model.parameters(), the optimizer, state_dict(), .to() and .eval().")
    else:
        modes = f" ({', '.join(mode_sensitive)})" if mode_sensitive else ""
        msg += (f"it holds no parameters, but buffers or a mode{modes} that state_dict(), .to() or "
                ".train()/.eval() never reach.")
    return make(FindingCode.UNREGISTERED_MODULE, path, msg, severity=severity,
                evidence={"type": type_name, "parameter_tensors": n_tensors, "parameter_numbers": numel,
                          "reachable_from": display_path(owner), "mode_sensitive": list(mode_sensitive),
                          **({"frozen_only": True} if frozen_only else {})},
                step=step)


def unregistered_tensor(path: str, *, is_parameter: bool, requires_grad: bool, shape: list[int] | None,
                        dtype: str, device: str, step: int | None) -> Finding:
    what = "an nn.Parameter" if is_parameter else "a plain tensor"
    if requires_grad:
        msg = (f"{path} is {what} with requires_grad=True stored as an ordinary attribute: it gets gradients, "
               "but the optimizer, state_dict(), .to() and .cuda() never see it.")
    else:
        msg = (f"{path} is a plain tensor attribute, neither a Parameter nor a buffer: .to() does not move it "
               "and state_dict() does not save it.")
    return make(FindingCode.UNREGISTERED_TENSOR, path, msg,
                severity=Severity.ERROR if requires_grad else Severity.WARNING,
                evidence={"shape": shape, "dtype": dtype, "device": device, "requires_grad": requires_grad,
                          "is_parameter": is_parameter}, step=step)


def frozen_parameter(path: str, shape: list[int] | None, in_optimizer: bool, step: int | None) -> Finding:
    return make(FindingCode.FROZEN_PARAMETER, path,
                f"{path} has requires_grad=False: it is saved and moved, and no gradient trains it while it stays so.",
                evidence={"shape": shape, "in_optimizer": in_optimizer}, step=step)


def _count(n: int) -> str:
    """23,512,128 as 23.5M."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


def frozen_module(path: str, type_name: str, n_tensors: int, numel: int, in_optimizer: int,
                  step: int | None) -> Finding:
    """A subtree whose registered parameters are all frozen (a frozen backbone): one info, not one per tensor."""
    held = (f" ({in_optimizer:,} of them held by an optimizer, which skips them)" if in_optimizer else "")
    return make(FindingCode.FROZEN_PARAMETER, path,
                f"{display_path(path)} ({type_name}): {_count(numel)} parameters in {n_tensors:,} tensor"
                f"{'s' if n_tensors != 1 else ''}, all requires_grad=False{held}: saved and moved, and no gradient "
                "trains them while they stay so.",
                evidence={"tensors": n_tensors, "parameters": numel, "tensors_in_optimizer": in_optimizer,
                          "type": type_name}, step=step)


def frozen_parameters_many(names: Sequence[str], n_modules: int, n_tensors: int, numel: int, in_optimizer: int,
                           step: int | None) -> Finding:
    """Many frozen subtrees and tensors (LoRA around every projection of an LLM): one info at the root."""
    shown = ", ".join(display_path(n) for n in names[:5]) + (f" and {len(names) - 5:,} more" if len(names) > 5 else "")
    return make(FindingCode.FROZEN_PARAMETER, "",
                f"{_count(numel)} parameters in {n_tensors:,} tensors have requires_grad=False, in {n_modules:,} "
                f"frozen modules and {len(names) - n_modules:,} frozen tensors of modules that train ({shown}): "
                "saved and moved, and no gradient trains them while they stay so (a frozen base around adapters, as "
                "LoRA's).",
                evidence={"tensors": n_tensors, "parameters": numel, "tensors_in_optimizer": in_optimizer,
                          "modules": n_modules, "examples": list(names[:50])}, step=step)


def not_in_optimizer(path: str, shape: list[int] | None, numel: int, step: int | None) -> Finding:
    return make(FindingCode.NOT_IN_OPTIMIZER, path,
                f"{path} requires grad, but no param group of the watched optimizer(s) holds it (membership is "
                "by object identity): its gradient is computed, but optimizer.step() never updates it and "
                "zero_grad() never clears it.", evidence={"shape": shape, "numel": numel}, step=step)


def not_in_optimizer_unreached(found: Finding, samples: int) -> Finding:
    """``not-in-optimizer`` of a tensor no gradient reached in ``samples`` sampled training steps: it runs under
    no_grad or detached (a frozen feature extractor, a target network, a teacher), so nothing trains it and
    nothing accumulates in it; an info (an error again once a gradient reaches it)."""
    path = found.path
    return dataclasses.replace(
        found, severity=str(Severity.INFO),
        message=f"{path} requires grad and no param group of the watched optimizer(s) holds it, but no gradient "
                f"has reached it in the {samples:,} sampled training steps since it appeared, and its .grad is "
                "unset (it runs under no_grad or detached: a frozen feature extractor, a target network, a teacher): "
                "nothing trains it, as intended if it is frozen.",
        fix="Say it is frozen: requires_grad_(False) on it (or on its module). If it should train, the graph to "
            "the loss is cut (a .detach() or torch.no_grad()), and the optimizer must hold it too.",
        evidence={**found.evidence, "gradient_reached": False, "sampled_training_steps": samples})


def shared_parameter(path: str, aliases: Sequence[str], shape: list[int] | None, step: int | None) -> Finding:
    return make(FindingCode.SHARED_PARAMETER, path,
                f"{path} is the same Parameter as {', '.join(aliases)} (tied weights).",
                evidence={"aliases": list(aliases), "shape": shape}, step=step)


def stale_optimizer_param(where: str, shape: list[int] | None, opt_index: int, group: int, index: int,
                          looks_like: str | None, step: int | None) -> Finding:
    hint = (f" It has the shape of {looks_like}, which the optimizer does not hold: the module was probably "
            "replaced after the optimizer was built.") if looks_like else ""
    return make(FindingCode.STALE_OPTIMIZER_PARAM, where,
                f"The optimizer holds a tensor of shape {shape} that is not part of the model: it updates a "
                f"tensor the model no longer uses.{hint}",
                evidence={"optimizer": opt_index, "group": group, "index": index, "shape": shape,
                          "replaced": looks_like}, step=step)


def runtime_module(path: str, type_name: str, called_from: str, *, seen_before: bool, same_object: bool,
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
                          "same_object_each_step": same_object}, step=step)


# ------------------------------------------------------------------------------------ activations
def _dead_input(message: str, evidence: dict[str, Any], dead_input: tuple[str, str] | None
                ) -> tuple[str, dict[str, Any], str | None]:
    """``dead_input``: (the module whose dead output is this one's input, the first dead layer of the chain): the
    message says so, the evidence names both, and the fix is the first dead layer's."""
    if dead_input is None:
        return message, evidence, None
    given, first = (display_path(p) for p in dead_input)
    message += (f" Its input, the output of {given} before it, is dead too: this follows from the dead layer at "
                f"{first}" if given != first else f" Its input, the output of {given} before it, is dead: this "
                "follows from that dead layer")
    return (message + ".", {**evidence, "dead_input": dead_input[0], "dead_upstream": dead_input[1]},
            f"Fix the dead layer at {first} (its own finding says how): this module only passes its dead output "
            "on.")


def dead_constant(path: str, type_name: str, mean: float | None, samples: int, evidence: dict[str, Any],
                  step: int, dead_input: tuple[str, str] | None = None) -> Finding:
    msg, evidence, fix = _dead_input(
        f"The output of {display_path(path)} ({type_name}) is constant ({mean!r}) in every one of the "
        f"last {samples} samples: it carries no information and passes no useful gradient.", evidence, dead_input)
    return make(FindingCode.DEAD_LAYER, path, msg, evidence=evidence, step=step, fix=fix)


def dead_layer(path: str, type_name: str, dead: float, samples: int, evidence: dict[str, Any],
               step: int, dead_input: tuple[str, str] | None = None) -> Finding:
    msg, evidence, fix = _dead_input(
        f"{dead:.0%} of the units of {display_path(path)} ({type_name}) never activated (always zero) "
        f"over the last {samples} sampled steps: the layer is dead and its inputs get no gradient "
        "through it.", evidence, dead_input)
    return make(FindingCode.DEAD_LAYER, path, msg, evidence=evidence, step=step, fix=fix)


def dead_units(path: str, type_name: str, dead: float, samples: int, evidence: dict[str, Any],
               step: int, dead_input: tuple[str, str] | None = None) -> Finding:
    msg, evidence, fix = _dead_input(
        f"{dead:.0%} of the units of {display_path(path)} ({type_name}) never activated over the last "
        f"{samples} sampled steps: capacity is wasted.", evidence, dead_input)
    return make(FindingCode.DEAD_UNITS, path, msg, evidence=evidence, step=step, fix=fix)


def saturated(path: str, type_name: str, fraction: float, samples: int, step: int,
              output_layer: bool = False) -> Finding:
    """``output_layer``: no trained layer ran after it (a multi-label classifier's final Sigmoid): a confident model,
    an info."""
    evidence = {"saturated_fraction": fraction, "samples": samples, "type": type_name, "output_layer": output_layer}
    if output_layer:
        return make(FindingCode.SATURATED, path,
                    f"{fraction:.0%} of the outputs of {display_path(path)} ({type_name}), the model's output layer "
                    "(no trained layer runs after it), sit in the saturated tails: the model is confident. That "
                    "stalls nothing under a log-likelihood loss (binary_cross_entropy: its gradient, p - y, "
                    "vanishes only where the prediction is right); under mse_loss the gradient vanishes where it is "
                    "wrong too, and BCEWithLogitsLoss on the logits is the fix.",
                    evidence=evidence, severity=Severity.INFO, step=step)
    return make(FindingCode.SATURATED, path,
                f"{fraction:.0%} of the outputs of {display_path(path)} ({type_name}) sit in the saturated "
                "tails, where the gradient is nearly zero: learning through it stalls.",
                evidence=evidence, step=step)


def non_finite(origin: NonFiniteOrigin, *, last_step: int, count: int, later: Sequence[str]) -> Finding:
    """The first non-finite values of an episode, at their origin; ``later``: what later steps added."""
    first = origin.step
    if origin.kind == "activation" and origin.masking:
        what = (f"{display_path(origin.path)} produced {origin.values:,} -inf values in step {first}, and no NaN or "
                "+inf, with finite gradients: masking (masked_fill(mask, float('-inf')) before a softmax or a loss), "
                "harmless while no NaN or Inf follow")
    elif origin.kind == "activation":
        what = (f"{display_path(origin.path)} produced {origin.values:,} NaN/Inf values in step {first}, the first "
                f"module in execution order to do so ({len(origin.affected)} modules affected)")
    elif origin.kind == "gradient":
        what = f"The gradient of {origin.tensor} was NaN/Inf in step {first} ({len(origin.affected)} tensors affected)"
    else:
        what = f"The loss was {origin.values_text} in step {first}, a step whose modules were not sampled"
    went_on = "-inf values went on" if origin.masking else "non-finite values went on"
    tail = f"; {went_on} until step {last_step} ({count:,} observations)" if last_step != first else ""
    return make(FindingCode.NON_FINITE, origin.path, what + tail + ".",
                evidence={"kind": origin.kind, "first_step": first, "nonfinite": origin.values,
                          "modules_affected" if origin.kind == "activation" else "affected": len(origin.affected),
                          "first_modules" if origin.kind == "activation" else "first": list(origin.affected[:5]),
                          "later": list(later[:5]), "masking": origin.masking},
                severity=Severity.INFO if origin.masking else None, step=last_step, first_step=first, count=count)


@dataclasses.dataclass(frozen=True)
class NonFiniteOrigin:
    """Where an episode of non-finite values began: the first module in execution order of its first
    step (activation), the first gradient (gradient), or the loss of an unsampled step (loss)."""

    kind: str                      # 'activation' | 'gradient' | 'loss'
    path: str                      # where it is drawn: the module ('' for the loss)
    step: int
    values: int = 0                # NaN/Inf count of the origin (activation)
    affected: tuple[str, ...] = ()
    tensor: str = ""               # gradient: the tensor
    values_text: str = "NaN"       # loss: its value
    masking: bool = False          # activation: -inf alone, finite gradients, and no NaN or Inf since


# ------------------------------------------------------------------------------------ parameters
# significant bits of the low-precision floating types a parameter may be kept in
_PRECISION_BITS = {"bfloat16": 8, "float16": 11}


@dataclasses.dataclass(frozen=True)
class TinyLearningRate:
    """A learning rate so small that an optimizer step rounds away: about lr per value is below half the spacing of
    the ``reference`` floating type at the tensor's ``rms``."""

    lr: float                      # the latest step's
    rms: float
    spacing: float
    reference: str                 # 'float32' | 'float64'


def not_updating(path: str, grad_norm: float, steps: Sequence[int], in_optimizer: bool, step: int,
                 zero_lr_group: tuple[int, int] | None = None, dtype: str | None = None,
                 tiny_lr: TinyLearningRate | None = None) -> Finding:
    """``zero_lr_group``: (optimizer, param group) whose learning rate was 0 (or, with ``tiny_lr``, so small that a
    step rounds away) in every one of ``steps``; ``dtype``: the tensor's."""
    fix = None
    if zero_lr_group is not None:
        opt, group = zero_lr_group
        where = f"param group {group}" + (f" of optimizer {opt}" if opt else "")
        if tiny_lr is None:
            reason = f"its {where} has lr=0 in every one of them, so no optimizer step can move it"
        else:
            reason = (f"its {where}'s lr is {tiny_lr.lr:.1e} (a scheduler decayed it?): an optimizer step of about "
                      f"lr per value (Adam's; SGD's is lr x the gradient) is below half the spacing of "
                      f"{tiny_lr.reference} numbers at the tensor's values (rms {tiny_lr.rms:.2g}: spacing "
                      f"{tiny_lr.spacing:.2g}), so every step rounds away")
            fix = ("Check the learning-rate schedule: a StepLR/ExponentialLR stepped every batch instead of every "
                   "epoch divides lr by its factor every step_size batches; give it a floor (eta_min, min_lr) well "
                   "above 1e-7 of the weights' size, or step it per epoch.")
    elif not in_optimizer:
        reason = "no watched optimizer holds it"
    elif dtype in _PRECISION_BITS:
        bits = _PRECISION_BITS[dtype]
        reason = (f"the optimizer holds it, but it is {dtype}, whose {bits} significant bits round away an update "
                  f"smaller than about 1/{2 ** bits:,} of a value: keep float32 master weights (train in float32 "
                  "under autocast) or use a larger learning rate")
    else:
        reason = "the optimizer holds it but did not change it"
    evidence: dict[str, Any] = {"grad_norm": grad_norm, "steps": list(steps), "in_optimizer": in_optimizer}
    if dtype is not None:
        evidence["dtype"] = dtype
    if zero_lr_group is not None:
        evidence.update({"optimizer": zero_lr_group[0], "param_group": zero_lr_group[1],
                         "lr": tiny_lr.lr if tiny_lr is not None else 0.0})
    return make(FindingCode.NOT_UPDATING, path,
                f"{path} receives gradients (norm {grad_norm:.3g}) but its value did not change over the last "
                f"{len(steps)} observed optimizer steps: {reason}. A gradient only proves autograd reached it.",
                evidence=evidence, step=step, fix=fix)


def grad_accumulating(path: str, stale_norms: Sequence[float | None], grad_norms: Sequence[float | None],
                      step: int, optimizer: int | None = None, zeroed: int | None = None,
                      judged: int | None = None) -> Finding:
    """``optimizer``: the watched optimizer holding the tensor (None: none does). A tensor no optimizer holds grows a
    buffer nobody uses; one an optimizer holds is stepped with the growing sum unless something zeroes it before the
    step. ``zeroed`` of the ``judged`` tensors that optimizer holds that got gradients in as many sampled steps did
    not accumulate (None: not known; fewer than 90% of them accumulate, or the finding would be at the root)."""
    evidence: dict[str, Any] = {"stale_grad_norms": list(stale_norms), "grad_norms": list(grad_norms)}
    before = f"norm before the new one: {stale_norms[-1]:.3g}"
    if optimizer is None:
        return make(FindingCode.GRAD_ACCUMULATING, path,
                    f"{path}.grad was not zeroed between steps: each backward adds to the previous gradient "
                    f"({before}), so it grows for the whole run and holds a gradient buffer nobody uses (no watched "
                    "optimizer holds the tensor, so optimizer.zero_grad() never reaches it).",
                    evidence={**evidence, "in_optimizer": False}, step=step,
                    fix="Register the tensor (nn.Parameter in a registered module, nn.ModuleList) and give it to the "
                        "optimizer, so that optimizer.zero_grad() reaches it; or zero it yourself every step "
                        "(model.zero_grad()).")
    if zeroed is not None and judged is not None:
        others = (f"{zeroed:,} of the {judged:,} tensors it holds that got gradients are zeroed between steps: "
                  "whatever zeroes them misses this one.")
        evidence.update({"tensors_zeroed": zeroed, "tensors_with_gradients": judged})
    else:
        others = "Whatever zeroes some of the other tensors it holds misses this one."
    return make(FindingCode.GRAD_ACCUMULATING, path,
                f"{path}.grad still held the previous step's gradient when this step's first backward added to it "
                f"({before}), in each of the last sampled steps: unless something zeroes it before step(), the "
                f"optimizer that holds it steps with that growing sum instead of the step's gradient. {others}",
                evidence={**evidence, "in_optimizer": True, "optimizer": optimizer}, step=step,
                fix="Zero it once per optimizer step, after optimizer.step(): optimizer.zero_grad() reaches every "
                    "tensor the optimizer holds (a zero_grad() of part of the model does not).")


def gradients_never_zeroed(optimizers: Sequence[int], n_optimizers: int, tensors: Sequence[str], judged: int,
                           step: int) -> Finding:
    """(Nearly) every tensor that each of ``optimizers`` holds and that got gradients (``judged`` of them) accumulated
    its gradient (``tensors``): nothing zeroes them between the optimizer's step and the next step's first backward.
    Judged at that backward: zero_grad() may still run before the optimizer's own step (a GAN's discriminator zeroed
    right before its backward, after the generator's backward went through it), so the consequence is conditional.
    One finding at the root, not one per tensor."""
    if n_optimizers <= 1:
        who = "the optimizer"
    elif len(optimizers) == 1:
        who = f"optimizer {optimizers[0]}"
    else:
        who = "optimizers " + ", ".join(str(o) for o in optimizers)
    n = len(tensors)
    every = f"all {judged:,}" if n == judged else f"{n:,} of the {judged:,}"
    shown = ", ".join(tensors[:3]) + (f" and {n - 3:,} more" if n > 3 else "")
    return make(FindingCode.GRAD_ACCUMULATING, "",
                f"The gradients {who} steps with are not zeroed before the next step's first backward: {every} "
                f"tensors it holds that got gradients ({shown}) still held the previous step's gradient when this "
                "step's first backward added to it, in each of the last sampled steps. Unless zero_grad() runs "
                f"before each step() of {who} (a GAN's discriminator zeroed right before its own backward), they "
                "are never zeroed: every backward adds to the sum of all before it, and each optimizer.step() "
                "follows the running sum of the run's gradients instead of the step's.",
                evidence={"optimizers": list(optimizers), "tensors": n, "tensors_with_gradients": judged,
                          "examples": list(tensors[:20])},
                step=step,
                fix="Call optimizer.zero_grad() (or model.zero_grad()) every step, after optimizer.step() (with "
                    "gradient accumulation: after each optimizer step, so that the micro-batches' gradients add up "
                    "in between); if it already runs before this optimizer's own backward, zeroing right after "
                    "step() as well keeps another loss's backward from leaving gradients in it.")


def forward_bypassed(module_path: str, tensor_path: str, modules: Sequence[str], first_step: int, step: int,
                     count: int, forward_called: bool = True, table: bool = False) -> Finding:
    """``forward_called``: the module's children were called and it was not, so its .forward() was called
    directly. Otherwise (a leaf module) its parameters may as well have been read directly; for an embedding table
    that is usually by design (DETR's query embeddings, a position table sliced in forward): an info."""
    seen = f"seen in {count:,} sampled step{'s' if count != 1 else ''} since step {first_step}"
    if forward_called:
        how = "someone called .forward() directly, so hooks (pruning masks, probes, FSDP) never ran"
    else:
        how = ("its .forward() was called directly or its parameters were read directly (module.weight, a "
               "functional call), so its hooks (pruning masks, probes, FSDP's unsharding) did not run")
        if table:
            how += "; expected for a table kept to hold its weight"
    return make(FindingCode.FORWARD_BYPASSED, module_path,
                f"{tensor_path} received a gradient in step {step}, but its module {modules[0]} was never called "
                f"through __call__ in that step: {how} ({seen}).",
                evidence={"parameter": tensor_path, "modules": list(modules), "forward_called": forward_called},
                severity=Severity.INFO if table else None, step=step, first_step=first_step, count=count)


def no_gradient(module_path: str, tensor_paths: Sequence[str], first_step: int, step: int, count: int) -> Finding:
    names = ", ".join(tensor_paths[:5]) + (f" and {len(tensor_paths) - 5:,} more" if len(tensor_paths) > 5 else "")
    return make(FindingCode.NO_GRADIENT, module_path,
                f"{display_path(module_path)} ran in the training forward, but no gradient reached "
                f"{names}, which the optimizer holds and which require grad: its output does not reach the loss, "
                f"so the optimizer never changes them (in {count:,} sampled steps since step {first_step}).",
                evidence={"tensors": list(tensor_paths[:50]), "n_tensors": len(tensor_paths)},
                step=step, first_step=first_step, count=count)


# ------------------------------------------------------------------------------------ modes
def training_mode_mismatch(path: str, type_name: str, training: bool, root_training: bool, first_step: int,
                           step: int, count: int, registered: bool = False, inside: int = 0,
                           pretrained: bool = False) -> Finding:
    """``registered``: model.train()/eval() reach the module, so its mode was set after them (a warning: on purpose
    or by mistake, the code that did it says which); otherwise they never reach it (an error). ``inside``: the
    modules below it that ran with the same flag, told in this one finding. ``pretrained``: a Hugging Face model
    (from_pretrained() returns it in eval mode)."""
    mode = "train" if root_training else "eval"
    below = f" and {_fmt(inside)} module{'s' if inside != 1 else ''} inside it" if inside else ""
    evidence: dict[str, Any] = {"module_training": training, "root_training": root_training}
    if inside:
        evidence["modules_inside"] = inside
    if not registered:
        return make(FindingCode.TRAINING_MODE_MISMATCH, path,
                    f"{display_path(path)} ({type_name}){below} ran with training={training} while the model is in "
                    f"{mode} mode: model.train()/eval() did not reach it.",
                    evidence=evidence, step=step, first_step=first_step, count=count)
    evidence["mode_set_after_model"] = True
    how = f".{'train' if training else 'eval'}() on it" + (
        ", or from_pretrained(), which returns a model in eval mode" if pretrained and not training else "")
    return make(FindingCode.TRAINING_MODE_MISMATCH, path,
                f"{display_path(path)} ({type_name}){below} ran with training={training} while the model is in {mode} "
                f"mode: its mode was set on it alone ({how}), and no model.{mode}() came after.",
                evidence=evidence, severity=Severity.WARNING, step=step, first_step=first_step, count=count,
                fix=f"Call model.{mode}() after whatever set its mode, or set it again after every model.{mode}() if "
                    "it is meant.")


def norms_training_in_eval(group: ModuleGroup) -> Finding:
    """Normalization layers put in training mode after model.eval(): their running statistics move to the batches
    the model evaluates. Test-time adaptation (TENT) does it on purpose; an evaluation does not. One warning, at the
    first layer."""
    its = "its" if group.one else "their"
    return make(FindingCode.TRAINING_MODE_MISMATCH, group.paths[0],
                f"{len(group.paths):,} normalization layer{'' if group.one else 's'} ({', '.join(group.types)}: "
                f"{group.shown()}) ran in training mode while the model was in eval mode: {its} mode was set after "
                f"model.eval(), so {its} running statistics move to the batches evaluated (test-time adaptation such "
                "as TENT does this on purpose).",
                evidence=group.evidence(module_training=True, root_training=False, mode_set_after_model=True),
                severity=Severity.WARNING, step=group.step, first_step=group.first_step, count=group.count,
                fix="Call model.eval() after whatever put them in training mode, unless adapting them to the test "
                    "data is meant.")


def frozen_dropout_active(group: ModuleGroup) -> Finding:
    """Dropout layers inside frozen blocks (unchanged between sampled steps) ran in training mode under no_grad in
    training steps: a frozen teacher's targets (or a frozen backbone's features) are randomly masked, though nothing
    in the block trains. One warning, at the first layer."""
    return make(FindingCode.TRAINING_MODE_MISMATCH, group.paths[0],
                f"{len(group.paths):,} dropout layer{'' if group.one else 's'} ({', '.join(group.types)}: "
                f"{group.shown()}) in frozen blocks (every parameter requires_grad=False, unchanged) ran in training "
                "mode under no_grad in training steps: what the frozen part computes (a teacher's targets, a frozen "
                "backbone's features) is randomly masked at every call, though nothing in it trains.",
                evidence=group.evidence(module_training=True, frozen_parameters=True, dropout_in_frozen_block=True),
                severity=Severity.WARNING, step=group.step, first_step=group.first_step, count=group.count,
                fix="Put the frozen part in eval mode after every model.train() (teacher.eval()), or override its "
                    "train() to stay in eval.")


def monte_carlo_dropout(group: ModuleGroup) -> Finding:
    """Dropout layers put back in training mode after model.eval(): Monte Carlo dropout, on purpose. One info, at
    the first layer."""
    return make(FindingCode.TRAINING_MODE_MISMATCH, group.paths[0],
                f"{len(group.paths):,} dropout layer{'' if group.one else 's'} ({', '.join(group.types)}: "
                f"{group.shown()}) ran in training mode while the model was in eval mode: "
                f"{'its' if group.one else 'their'} mode was set after model.eval(), as Monte Carlo dropout does on "
                "purpose (each evaluation then draws random masks).",
                evidence=group.evidence(module_training=True, root_training=False, monte_carlo_dropout=True),
                severity=Severity.INFO, step=group.step, first_step=group.first_step, count=group.count,
                fix="Nothing, if Monte Carlo dropout is meant; otherwise call model.eval() after whatever put them in "
                    "training mode.")


def frozen_normalization(group: ModuleGroup, in_frozen_blocks: bool = False) -> Finding:
    """Every normalization layer that ran was in eval mode while the model trained: their running statistics
    frozen, which fine-tuning does on purpose (mmdetection's norm_eval, timm's freeze_bn). One info at the root."""
    return make(FindingCode.TRAINING_MODE_MISMATCH, "",
                f"{len(group.paths):,} normalization layer{'' if group.one else 's'} ({', '.join(group.types)}: "
                f"{group.shown()}) ran in eval mode while the model trained, "
                + ("inside frozen blocks" if in_frozen_blocks else "and none in training mode")
                + ": their running statistics "
                "are frozen, as fine-tuning does on purpose (mmdetection's norm_eval, timm's freeze_bn). If that "
                "is not meant, something put them in eval() after model.train().",
                evidence=group.evidence(module_training=False, root_training=True, frozen_normalization=True),
                severity=Severity.INFO, step=group.step, first_step=group.first_step, count=group.count)


def frozen_normalization_updating(group: ModuleGroup) -> Finding:
    """Normalization layers whose parameters are frozen, inside frozen blocks, ran in training mode in training
    steps: their running statistics still move to the batches, so the frozen part is not frozen. One warning."""
    its = "its" if group.one else "their"
    return make(FindingCode.TRAINING_MODE_MISMATCH, "",
                f"{len(group.paths):,} normalization layer{'' if group.one else 's'} ({', '.join(group.types)}: "
                f"{group.shown()}) in frozen blocks (every parameter requires_grad=False) ran in training mode in "
                f"training steps: {its} running_mean and running_var keep moving to these batches, so the frozen "
                "part still changes, and evaluation uses statistics it was never trained with.",
                evidence=group.evidence(module_training=True, root_training=True, frozen_parameters=True,
                                        running_statistics_updated=True),
                fix="Put them in eval mode after every model.train() (for m in frozen.modules(): if isinstance(m, "
                    "nn.modules.batchnorm._BatchNorm): m.eval()), or replace them with "
                    "torchvision.ops.FrozenBatchNorm2d. If adapting the statistics to new data is meant (AdaBN), "
                    "ignore this.",
                severity=Severity.WARNING, step=group.step, first_step=group.first_step, count=group.count)


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count:,} times"


def train_mode_under_no_grad(modules: Sequence[str], inference_mode: bool, first_step: int, step: int,
                             count: int) -> Finding:
    ctx = "inference_mode()" if inference_mode else "no_grad()"
    return make(FindingCode.TRAIN_MODE_UNDER_NO_GRAD, "",
                f"The model ran forward under {ctx} in training mode {_times(count)} (first in step {first_step}, "
                f"last in step {step}) while {len(modules)} Dropout/BatchNorm modules were in training mode "
                "(e.g. " + ", ".join(display_path(n) for n in modules[:3]) + "): validation in train mode "
                "applies dropout and overwrites BatchNorm running statistics with validation data (a pass that "
                "guesses labels inside a training step, as MixMatch's, does so on purpose).",
                evidence={"modules": list(modules[:20]), "modules_in_train_mode": len(modules), "context": ctx,
                          "forwards": count},
                step=step, first_step=first_step, count=count)


def train_step_in_eval_mode(modules: Sequence[str], first_step: int, step: int, count: int) -> Finding:
    return make(FindingCode.TRAIN_STEP_IN_EVAL_MODE, "",
                f"{count:,} optimizer step{'s' if count != 1 else ''} (first {first_step}, last {step}) trained on "
                "gradients of forwards run with the model in eval mode, while it holds "
                f"{len(modules)} Dropout/BatchNorm modules (e.g. " + ", ".join(display_path(n) for n in modules[:3])
                + "): dropout was off and BatchNorm used frozen running statistics. model.eval() for validation "
                "was probably never followed by model.train().",
                evidence={"modules": list(modules[:20]), "steps": count},
                step=step, first_step=first_step, count=count)


def eval_builds_graph(count: int, numel: int, first_step: int, step: int) -> Finding:
    return make(FindingCode.EVAL_BUILDS_GRAPH, "",
                f"The model ran forward in eval mode with gradients enabled {_times(count)} (first in step "
                f"{first_step}, last in step {step}) and the output ({numel:,} values) was never backpropagated: "
                "autograd recorded a graph, and kept the activations it needs, for nothing.",
                evidence={"forwards": count, "output_numel": numel}, step=step, first_step=first_step,
                count=count)
