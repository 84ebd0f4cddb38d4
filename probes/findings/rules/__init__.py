"""The finding rules: one class per finding code, in one list.

To add a finding: its code in :mod:`probes.schema` (``FindingCode`` and ``CODES``: default severity, badge label,
fix: the store's contract), one rule module here (the class: what it reads, when it fires, an example, what it
explains; and its builders), its entry in ``RULES``, a call to its builder where what it reads is observed, a test,
and ``python -m probes.findings.catalog`` to regenerate ``docs/findings.md``.
"""

from __future__ import annotations

from .base import Explains, Reads, Relation, Rule
from .checkpoint_keys import CheckpointKeys, LoadResult
from .dead_layer import DeadLayer
from .dead_units import DeadUnits
from .eval_builds_graph import EvalBuildsGraph
from .forward_bypassed import ForwardBypassed
from .frozen_parameter import FrozenParameter
from .grad_accumulating import GradAccumulating
from .no_gradient import NoGradient
from .non_finite import NonFinite, NonFiniteOrigin
from .not_in_optimizer import NotInOptimizer
from .not_updating import NotUpdating, RoundedAway, Tensors
from .rank_divergence import RankDivergence
from .rank_straggler import RankStraggler
from .saturated import Saturated
from .shared_parameter import SharedParameter
from .stale_optimizer_param import StaleOptimizerParam
from .train_mode_under_no_grad import TrainModeUnderNoGrad
from .train_step_in_eval_mode import TrainStepInEvalMode
from .training_mode import TrainingModeKind, TrainingModeMismatch
from .unregistered_module import HeldModule, UnregisteredModule
from .unregistered_tensor import UnregisteredTensor

# The one list. Its order is the order causes are looked for: a consequence takes the first rule that explains it
# (a layer in a plain list is explained by its unregistered module before its own tensor's optimizer membership).
RULES: tuple[type[Rule], ...] = (
    UnregisteredModule, NotInOptimizer, UnregisteredTensor, StaleOptimizerParam, FrozenParameter, SharedParameter,
    DeadLayer, DeadUnits, Saturated, NotUpdating, NoGradient, GradAccumulating, TrainingModeMismatch,
    TrainModeUnderNoGrad, TrainStepInEvalMode, EvalBuildsGraph, NonFinite, ForwardBypassed, RankDivergence,
    RankStraggler, CheckpointKeys,
)

__all__ = ["RULES", "CheckpointKeys", "DeadLayer", "DeadUnits", "EvalBuildsGraph", "Explains", "ForwardBypassed",
           "FrozenParameter", "GradAccumulating", "HeldModule", "LoadResult", "NoGradient", "NonFinite",
           "NonFiniteOrigin", "NotInOptimizer", "NotUpdating", "RankDivergence", "RankStraggler", "Reads", "Relation",
           "RoundedAway", "Rule", "Saturated", "SharedParameter", "StaleOptimizerParam", "Tensors",
           "TrainModeUnderNoGrad", "TrainStepInEvalMode", "TrainingModeKind", "TrainingModeMismatch",
           "UnregisteredModule", "UnregisteredTensor", "rule_for"]


def rule_for(code: str) -> type[Rule]:
    """The rule of a finding code."""
    for rule in RULES:
        if rule.code == code:
            return rule
    raise KeyError(f"no rule for finding code {code!r}")
