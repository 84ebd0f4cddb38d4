"""`training-mode-mismatch`: a module that runs in another training mode than the model. One code, several kinds
(:class:`TrainingModeKind`), from an info to an error."""

from __future__ import annotations

from typing import Any

from ...schema import FindingCode, Severity, StrEnum, display_path
from ..finding import Finding, Links, ModuleGroup, Seen, fmt_number, make
from .base import Explains, Reads, Relation, Rule


class TrainingModeKind(StrEnum):
    """The variants of ``training-mode-mismatch``."""

    NOT_REACHED = "not-reached"                  # model.train()/eval() never reach the module (unregistered)
    LEFT_IN_EVAL = "left-in-eval"                # a part put in eval on its own while the model trains
    SET_TO_TRAIN = "set-to-train"                # a part put in training mode on its own while the model evaluates
    NORMS_TRAINING_IN_EVAL = "norms-training-in-eval"
    FROZEN_DROPOUT_ACTIVE = "frozen-dropout-active"
    MONTE_CARLO_DROPOUT = "monte-carlo-dropout"
    FROZEN_NORMALIZATION = "frozen-normalization"
    FROZEN_NORMALIZATION_UPDATING = "frozen-normalization-updating"


class TrainingModeMismatch(Rule):
    code = FindingCode.TRAINING_MODE_MISMATCH
    reads = Reads.EVENTS
    severities = (
        "error (event) for a module `model.train()`/`eval()` never reach (unregistered); a warning for one they "
        "reach whose mode something set after them (a part left in `eval()` while the model trains, a Hugging Face "
        "model from `from_pretrained()`, in eval mode, under a LightningModule): one finding at the highest such "
        "module, the modules inside it with the same flag counted in it; one info for dropout layers put back in "
        "training mode after `model.eval()` (Monte Carlo dropout), one warning for normalization layers put back in "
        "training mode after it (their statistics move to the evaluated batches; test-time adaptation such as TENT "
        "does it on purpose, and its steps are no `train-step-in-eval-mode`); a frozen part (its parameters all "
        "`requires_grad=False`) put in eval is frozen on purpose, no finding; an evaluation after the last optimizer "
        "step is judged when the watcher closes; one info at the root when every normalization layer that ran was in "
        "eval while the model trained (statistics frozen on purpose: mmdetection's `norm_eval`, timm's `freeze_bn`); "
        "one warning at the root for normalization layers with frozen parameters (or none of their own, "
        "`affine=False`) inside frozen blocks (a frozen stem's `bn1` on a model whose later stages train counts with "
        "the frozen `conv1` before it; unchanged between sampled steps, by their version counters and a sample of "
        "their values: not a momentum encoder, even one updated through `.data`, not a discriminator frozen again "
        "after its own step), that ran in training mode in any call of a step that trained (a later call in eval, a "
        "part evaluated within the step, does not hide it); `FrozenBatchNorm2d` keeps no running statistics and is "
        "never one of them; one warning for dropout layers in such frozen blocks that ran in training mode under "
        "`no_grad` in a step that trained (a frozen distillation teacher left in training mode: its targets are "
        "randomly masked; not an EMA or Mean Teacher, whose parameters change, nor a frozen base run with gradients "
        "for adapters after it); once those are in eval (the fix), one info says they are frozen on purpose, even "
        "where a trained head's BatchNorm trains")
    meaning = (
        "a Dropout/BatchNorm-like module (or a user module with state) (not in a frozen block: `eval()` on a frozen "
        "teacher or backbone is how it is frozen) runs with `.training` different from the root's at that call (a "
        "part called from outside the model's forward, after `model.eval()`, is compared with the model's flag "
        "then); or a frozen backbone left in training mode by `model.train()`, whose BatchNorm running statistics "
        "still move to the fine-tuning batches (not reported where only the layers' affine parameters are frozen and "
        "the layers around them train; found also under a root nobody calls, such as an `nn.ModuleDict` of a student "
        "and its frozen teacher)")
    example = "model.train(); model.encoder.eval()   # the encoder's Dropout stays off while the model trains"
    explains = (Explains(FindingCode.TRAIN_STEP_IN_EVAL_MODE, Relation.MEMBERS_UNDER,
                        frozenset({TrainingModeKind.LEFT_IN_EVAL})),)

    @staticmethod
    def mismatch(path: str, type_name: str, training: bool, root_training: bool, seen: Seen, *,
                 registered: bool = False, inside: int = 0, pretrained: bool = False) -> Finding:
        """``registered``: model.train()/eval() reach the module, so its mode was set after them (a warning: on purpose
        or by mistake, the code that did it says which); otherwise they never reach it (an error). ``inside``: the
        modules below it that ran with the same flag, told in this one finding. ``pretrained``: a Hugging Face model
        (from_pretrained() returns it in eval mode)."""
        mode = "train" if root_training else "eval"
        below = f" and {fmt_number(inside)} module{'s' if inside != 1 else ''} inside it" if inside else ""
        evidence: dict[str, Any] = {"module_training": training, "root_training": root_training}
        if inside:
            evidence["modules_inside"] = inside
        if not registered:
            return make(FindingCode.TRAINING_MODE_MISMATCH, path,
                        f"{display_path(path)} ({type_name}){below} ran with training={training} while the model is in "
                        f"{mode} mode: model.train()/eval() did not reach it.",
                        evidence=evidence, seen=seen,
                        links=Links(kind=TrainingModeKind.NOT_REACHED))
        evidence["mode_set_after_model"] = True
        how = f".{'train' if training else 'eval'}() on it" + (
            ", or from_pretrained(), which returns a model in eval mode" if pretrained and not training else "")
        return make(FindingCode.TRAINING_MODE_MISMATCH, path,
                    f"{display_path(path)} ({type_name}){below} ran with training={training} while the model is in "
                    f"{mode} mode: its mode was set on it alone ({how}), and no model.{mode}() came after.",
                    evidence=evidence, severity=Severity.WARNING, seen=seen,
                    fix=f"Call model.{mode}() after whatever set its mode, or set it again after every model.{mode}() "
                        "if it is meant.",
                    links=Links(kind=TrainingModeKind.SET_TO_TRAIN if training else TrainingModeKind.LEFT_IN_EVAL))

    @staticmethod
    def norms_training_in_eval(group: ModuleGroup) -> Finding:
        """Normalization layers put in training mode after model.eval(): their running statistics move to the batches
        the model evaluates. Test-time adaptation (TENT) does it on purpose; an evaluation does not. One warning, at the
        first layer."""
        its = "its" if group.one else "their"
        return make(FindingCode.TRAINING_MODE_MISMATCH, group.paths[0],
                    f"{len(group.paths):,} normalization layer{'' if group.one else 's'} ({', '.join(group.types)}: "
                    f"{group.shown()}) ran in training mode while the model was in eval mode: {its} mode was set after "
                    f"model.eval(), so {its} running statistics move to the batches evaluated (test-time adaptation "
                    "such as TENT does this on purpose).",
                    evidence=group.evidence(module_training=True, root_training=False, mode_set_after_model=True),
                    severity=Severity.WARNING, seen=Seen(group.step, first_step=group.first_step, count=group.count),
                    fix="Call model.eval() after whatever put them in training mode, unless adapting them to the test "
                        "data is meant.",
                    links=Links(kind=TrainingModeKind.NORMS_TRAINING_IN_EVAL))

    @staticmethod
    def frozen_dropout_active(group: ModuleGroup) -> Finding:
        """Dropout layers inside frozen blocks (unchanged between sampled steps) ran in training mode under no_grad in
        training steps: a frozen teacher's targets (or a frozen backbone's features) are randomly masked, though nothing
        in the block trains. One warning, at the first layer."""
        return make(FindingCode.TRAINING_MODE_MISMATCH, group.paths[0],
                    f"{len(group.paths):,} dropout layer{'' if group.one else 's'} ({', '.join(group.types)}: "
                    f"{group.shown()}) in frozen blocks (every parameter requires_grad=False, unchanged) ran in "
                    "training mode under no_grad in training steps: what the frozen part computes (a teacher's "
                    "targets, a frozen backbone's features) is randomly masked at every call, though nothing in it "
                    "trains.",
                    evidence=group.evidence(module_training=True, frozen_parameters=True, dropout_in_frozen_block=True),
                    severity=Severity.WARNING, seen=Seen(group.step, first_step=group.first_step, count=group.count),
                    fix="Put the frozen part in eval mode after every model.train() (teacher.eval()), or override its "
                        "train() to stay in eval.",
                    links=Links(kind=TrainingModeKind.FROZEN_DROPOUT_ACTIVE))

    @staticmethod
    def monte_carlo_dropout(group: ModuleGroup) -> Finding:
        """Dropout layers put back in training mode after model.eval(): Monte Carlo dropout, on purpose. One info, at
        the first layer."""
        return make(FindingCode.TRAINING_MODE_MISMATCH, group.paths[0],
                    f"{len(group.paths):,} dropout layer{'' if group.one else 's'} ({', '.join(group.types)}: "
                    f"{group.shown()}) ran in training mode while the model was in eval mode: "
                    f"{'its' if group.one else 'their'} mode was set after model.eval(), as Monte Carlo dropout does "
                    "on purpose (each evaluation then draws random masks).",
                    evidence=group.evidence(module_training=True, root_training=False, monte_carlo_dropout=True),
                    severity=Severity.INFO, seen=Seen(group.step, first_step=group.first_step, count=group.count),
                    fix="Nothing, if Monte Carlo dropout is meant; otherwise call model.eval() after whatever put them "
                        "in training mode.",
                    links=Links(kind=TrainingModeKind.MONTE_CARLO_DROPOUT))

    @staticmethod
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
                    severity=Severity.INFO, seen=Seen(group.step, first_step=group.first_step, count=group.count),
                    links=Links(kind=TrainingModeKind.FROZEN_NORMALIZATION))

    @staticmethod
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
                    severity=Severity.WARNING, seen=Seen(group.step, first_step=group.first_step, count=group.count),
                    links=Links(kind=TrainingModeKind.FROZEN_NORMALIZATION_UPDATING))
