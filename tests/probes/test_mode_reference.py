"""What a module's training flag is compared with when the model's own forward is not the only way in.

- A root that is a container nobody calls (an ``nn.ModuleDict`` of a student and its frozen teacher, each called
  on its own): the model's mode is unknown, yet a frozen teacher's BatchNorm left in training mode still moves its
  running statistics to the batches. That is the frozen-statistics warning, which needs no mode of the model; an
  EMA teacher (its parameters change between steps) and a teacher in eval mode give none.
- A part of the model evaluated from outside its forward, after ``model.eval()``, in the middle of a training step
  (embeddings for a kNN monitor between backward and the optimizer step): compared with the model's flag as it is
  at that call, not as it was at the model's last forward (that said "ran in eval mode while the model trained")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_frozen_norm_updating import FineTune
from torch import nn

import probes


def distill(run_dir, ema: bool = False, teacher_eval: bool = False) -> list:
    torch.manual_seed(0)
    model = nn.ModuleDict({"student": FineTune(), "teacher": FineTune()})
    model["teacher"].requires_grad_(False)
    if teacher_eval:
        model["teacher"].eval()
    before = model["teacher"].backbone[1].running_mean.clone()
    opt = torch.optim.SGD(model["student"].parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(5):
            x = torch.randn(4, 3, 10, 10, generator=g) * 3 + 1
            with torch.no_grad():
                target = model["teacher"](x)
            loss = F.mse_loss(model["student"](x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ema:
                with torch.no_grad():
                    for t, s in zip(model["teacher"].parameters(), model["student"].parameters(), strict=True):
                        t.mul_(0.9).add_(s, alpha=0.1)
            w.step(loss)
        found = [f for f in w.findings() if f.code == "training-mode-mismatch"]
    moved = not torch.equal(model["teacher"].backbone[1].running_mean, before)
    assert moved == (not teacher_eval)
    return found


def test_a_frozen_teacher_in_training_mode_under_a_container_root_is_a_warning(run_dir):
    found = distill(run_dir)
    assert [(f.severity, f.evidence.get("running_statistics_updated")) for f in found] == [("warning", True)]
    assert found[0].evidence["modules"] == ["teacher.backbone.1", "teacher.backbone.4"]


def test_an_ema_teacher_or_one_in_eval_mode_gives_no_mode_finding(run_dir, tmp_path):
    assert distill(run_dir, ema=True) == []
    assert distill(tmp_path / "eval", teacher_eval=True) == []


class Encoder(nn.Module):
    def __init__(self, dropout_in_list: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        drop = nn.Dropout(0.5)
        if dropout_in_list:
            self.regs = [drop]                # model.eval() never reaches it
        else:
            self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drop = self.regs[0] if hasattr(self, "regs") else self.drop
        return drop(self.norm(self.fc(x)))


class Classifier(nn.Module):
    def __init__(self, dropout_in_list: bool = False) -> None:
        super().__init__()
        self.encoder = Encoder(dropout_in_list)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def knn_monitor_loop(run_dir, dropout_in_list: bool = False) -> list[tuple[str, str, dict]]:
    torch.manual_seed(0)
    model = Classifier(dropout_in_list)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            model.train()
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            model.eval()
            with torch.no_grad():
                model.encoder(x)              # the monitor's embeddings, in eval mode as meant
            model.train()
            opt.step()
            w.step(loss)
        return [(f.path, f.severity, f.evidence) for f in w.findings() if f.code == "training-mode-mismatch"]


def test_a_part_evaluated_after_model_eval_inside_a_step_is_in_step_with_the_model(run_dir):
    assert knn_monitor_loop(run_dir) == []


def test_a_part_the_eval_does_not_reach_is_found_in_that_evaluation(run_dir):
    """The contrast: the Dropout in a plain list stays in training mode through the monitor's evaluation."""
    assert knn_monitor_loop(run_dir, dropout_in_list=True) == [
        ("encoder.regs[0]", "error", {"module_training": True, "root_training": False})]


def test_a_frozen_teacher_put_in_eval_is_no_error_whatever_the_call_order(run_dir):
    """eval() on a frozen teacher is how it is frozen: its Dropout in eval is no module eval() missed."""
    torch.manual_seed(0)

    class Distill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            self.teacher = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.student(x)
            with torch.no_grad():
                target = self.teacher(x)            # after the student's forward
            return F.mse_loss(out, target)

    model = Distill()
    model.teacher.requires_grad_(False)
    opt = torch.optim.SGD(model.student.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            model.train()
            model.teacher.eval()
            loss = model(torch.randn(8, 8))
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert [f for f in w.findings() if f.code == "training-mode-mismatch"] == []


class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def distill_dropout_teacher(run_dir, teacher: str) -> list:
    """A frozen teacher with Dropout and no BatchNorm (a transformer teacher), its targets taken under no_grad."""
    torch.manual_seed(0)

    class Distill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = Student()
            self.teacher = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.student(x)

    model = Distill()
    model.teacher.requires_grad_(False)
    opt = torch.optim.AdamW(model.student.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(5):
            model.train()
            if teacher == "eval":
                model.teacher.eval()
            x = torch.randn(16, 8, generator=g)
            with torch.no_grad():
                target = model.teacher(x).softmax(-1)
            loss = F.cross_entropy(model(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if teacher == "mean teacher":          # an EMA of the student: noise on its targets is the recipe
                with torch.no_grad():
                    for t, s in zip(model.teacher.parameters(), model.student.parameters(), strict=True):
                        t.mul_(0.99).add_(s, alpha=0.01)
            w.step(loss)
        return [(f.path, f.severity, f.evidence.get("modules")) for f in w.findings()
                if f.code == "training-mode-mismatch"]


def test_a_frozen_teacher_s_dropout_left_in_training_mode_is_a_warning(run_dir):
    assert distill_dropout_teacher(run_dir, "train") == [("teacher.2", "warning", ["teacher.2"])]


@pytest.mark.parametrize("teacher", ["eval", "mean teacher"])
def test_a_teacher_in_eval_or_an_ema_teacher_gives_none(run_dir, teacher):
    assert distill_dropout_teacher(run_dir, teacher) == []


def test_dropout_of_a_frozen_base_that_trains_adapters_is_no_finding(run_dir):
    """LoRA-style fine-tuning: a frozen MLP with Dropout in training mode, run with gradients (adapters after it
    train): its dropout regularises the training, nothing is computed under no_grad."""
    torch.manual_seed(0)

    class Adapted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8))
            self.adapter = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.adapter(self.mlp(x)))

    model = Adapted()
    model.mlp.requires_grad_(False)
    opt = torch.optim.AdamW([*model.adapter.parameters(), *model.head.parameters()], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert [f for f in w.findings() if f.code == "training-mode-mismatch"] == []


class DropPath(nn.Module):
    """timm's DropPath: zeroes whole samples at random in training (stochastic depth)."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0:
            return x
        keep = (torch.rand(x.shape[0], 1) >= self.drop_prob).to(x.dtype)
        return x * keep / (1 - self.drop_prob)


def test_a_frozen_teacher_s_drop_path_left_in_training_mode_is_a_warning(run_dir):
    """A ViT teacher as timm builds it by default for fine-tuning: dropout at p=0, drop-path 0.1."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.0)
            self.drop_path = DropPath(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop_path(self.drop(self.fc(x)))

    class Distill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = Student()
            self.teacher = nn.Sequential(Block(), Block(), nn.Linear(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.student(x)

    model = Distill()
    model.teacher.requires_grad_(False)
    opt = torch.optim.AdamW(model.student.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            x = torch.randn(16, 8, generator=g)
            with torch.no_grad():
                target = model.teacher(x).softmax(-1)
            loss = F.cross_entropy(model(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        found = [f.evidence.get("modules") for f in w.findings() if f.code == "training-mode-mismatch"]
    assert found == [["teacher.0.drop_path", "teacher.1.drop_path"]]


def test_a_dropout_after_a_frozen_embedding_in_a_model_that_trains_is_no_frozen_part(run_dir):
    """``nn.Embedding.from_pretrained(freeze=True)`` feeding a Dropout, the rest trained, with a pass that guesses
    labels under no_grad in training mode each step: the dropout belongs to no frozen part."""
    torch.manual_seed(0)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding.from_pretrained(torch.randn(50, 8), freeze=True)
            self.drop = nn.Dropout(0.2)
            self.head = nn.Linear(8, 2)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.drop(self.emb(tokens)).mean(1))

    model = Classifier()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        for _ in range(4):
            tokens = torch.randint(0, 50, (16, 6), generator=g)
            with torch.no_grad():
                guess = model(tokens).softmax(-1)            # label guessing, in training mode on purpose
            loss = F.cross_entropy(model(tokens), guess)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
        assert [f for f in w.findings() if f.evidence.get("dropout_in_frozen_block")] == []
