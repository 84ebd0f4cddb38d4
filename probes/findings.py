"""Findings: what modscope reports, with stable codes. Pure data, no torch."""
from __future__ import annotations

import dataclasses
from typing import Any

SEVERITIES = ("error", "warning", "info")
SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}

# code -> (default severity, the fix shown to the user)
CODES: dict[str, tuple[str, str]] = {
    "unregistered-module": (
        "error",
        "Hold sub-modules in nn.ModuleList / nn.ModuleDict / nn.Sequential (or assign them as attributes) "
        "so that parameters(), the optimizer, state_dict(), .to() and eval() see them."),
    "unregistered-tensor": (
        "error",
        "Make learned tensors nn.Parameter; register state with register_buffer(name, t) "
        "(persistent=False for constants recomputable from the config)."),
    "not-in-optimizer": (
        "error",
        "Build the optimizer after the model is final (after replacing heads or unfreezing), "
        "from model.parameters(), or add the parameter with optimizer.add_param_group()."),
    "stale-optimizer-param": (
        "warning",
        "Rebuild the optimizer after replacing modules, so it holds the parameters the model uses now."),
    "frozen-parameter": (
        "info",
        "Expected if you froze it on purpose; otherwise call requires_grad_(True)."),
    "dead-layer": (
        "error",
        "Check initialisation, learning rate and the preceding normalisation; consider LeakyReLU/GELU "
        "or a lower learning rate."),
    "dead-units": (
        "warning",
        "Check initialisation and learning rate; consider LeakyReLU/GELU."),
    "saturated": (
        "warning",
        "Normalise the input of the activation (LayerNorm/BatchNorm), lower the learning rate or rescale "
        "the initialisation."),
    "not-updating": (
        "error",
        "Give the tensor to the optimizer (register it: nn.Parameter / nn.ModuleList) and check its "
        "learning rate."),
    "grad-accumulating": (
        "warning",
        "Zero the gradient every step: register the tensor so optimizer.zero_grad() reaches it, or call "
        "model.zero_grad()."),
    "training-mode-mismatch": (
        "error",
        "Register the module so model.train()/model.eval() reach it, or set its mode explicitly."),
    "train-mode-under-no-grad": (
        "warning",
        "Call model.eval() before validation and model.train() after it; no_grad() does not change "
        "Dropout or BatchNorm behaviour."),
    "non-finite": (
        "error",
        "Lower the learning rate, clip gradients, check for log(0)/division by zero, or use a wider dtype."),
    "forward-bypassed": (
        "warning",
        "Call the module (module(x)), not module.forward(x): calling forward() skips every hook."),
    "shared-parameter": (
        "info",
        "Expected for tied weights; the tensor is stored once in parameters() and updated once."),
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem found in a model, at one path."""

    code: str
    severity: str
    path: str
    message: str
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    fix: str = ""
    step: int | None = None

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}; expected one of {sorted(CODES)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; expected one of {SEVERITIES}")

    @property
    def key(self) -> tuple[str, str]:
        return (self.code, self.path)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "path": self.path,
                "message": self.message, "evidence": dict(self.evidence), "fix": self.fix,
                "step": self.step}

    def __str__(self) -> str:
        where = self.path if self.path else "<root>"
        return f"[{self.severity}] {self.code} at {where}: {self.message}"


def make(code: str, path: str, message: str, evidence: dict[str, Any] | None = None,
         severity: str | None = None, step: int | None = None) -> Finding:
    default_severity, fix = CODES[code]
    return Finding(code=code, severity=severity or default_severity, path=path, message=message,
                   evidence=evidence or {}, fix=fix, step=step)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (SEVERITY_RANK[f.severity], f.code, f.path))
