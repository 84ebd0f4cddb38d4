"""The gradient norm of each module's output, against autograd's own gradients of the same run."""
import sqlite3

import pytest
import torch
from helpers import train
from torch import nn

import probes
from probes.capture import batch


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 8))


def _reference_norms(model: nn.Module, steps: int, rows: int) -> dict[tuple[str, int], float]:
    """(module path, step) -> the norm of the gradient of its output, read with tensor hooks."""
    norms: dict[tuple[str, int], float] = {}
    step = [0]

    def hook(path):
        def forward_hook(module, args, output):
            output.register_hook(lambda g: norms.__setitem__((path, step[0]), g.norm().item()))
        return forward_hook

    for path, m in model.named_modules():
        m.register_forward_hook(hook(path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        step[0] = s
        train(model, opt, None, 1, lambda: (torch.randn(rows, 64, generator=g), torch.randint(0, 8, (rows,),
                                                                                            generator=g)))
    return norms


def _stored_norms(model: nn.Module, steps: int, rows: int, run_dir) -> dict[tuple[str, int], float | None]:
    """(module path, step) -> the stored norm of the gradient of its output, the model watched at every step
    of the same training as :func:`_reference_norms`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with probes.watch(model, opt, run_dir=run_dir, every=1) as w:
        train(model, opt, w, steps, lambda: (torch.randn(rows, 64, generator=g), torch.randint(0, 8, (rows,),
                                                                                             generator=g)))
    con = sqlite3.connect(w.store_path)
    stored = {(path, step): norm for path, step, norm in con.execute(
        "SELECT m.path, s.step, s.out_grad_norm FROM module_stats s JOIN modules m USING(rank, module_id)")}
    con.close()
    return stored


@pytest.mark.parametrize("rows", [128, 8], ids=["large-outputs", "small-outputs"])
def test_each_module_gets_the_gradient_of_its_own_output(tmp_path, rows):
    """Large outputs (a gradient hook each) and small ones (kept by autograd) alike. A large output is freed
    once the next module ran, and the next output of its shape often gets its address, its id and version 0:
    looked up by those at backward time, one module's gradient went to another and the first got none."""
    assert (rows * 64 > batch.SMALL_OUTPUT) == (rows == 128)
    steps = 4
    expected = _reference_norms(_model(), steps, rows)
    stored = _stored_norms(_model(), steps, rows, tmp_path)
    assert set(stored) == set(expected)
    for key, norm in expected.items():
        assert stored[key] == pytest.approx(norm, rel=1e-5), key


class _SideBranch(nn.Module):
    """A module whose small output is computed first and dropped: autograd keeps no gradient for it, while the
    modules after it get theirs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.side = nn.Linear(64, 64)
        self.body = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.side(x)
        return self.body(x)


def test_an_output_no_gradient_reaches_has_none_and_the_others_keep_their_own(tmp_path):
    steps, rows = 3, 8
    expected = _reference_norms(_SideBranch(), steps, rows)
    stored = _stored_norms(_SideBranch(), steps, rows, tmp_path)
    assert {key: stored[key] for key in stored if key[0] == "side"} == {("side", s): None for s in range(steps)}
    assert set(stored) - set(expected) == {("side", s) for s in range(steps)}
    for key, norm in expected.items():
        assert stored[key] == pytest.approx(norm, rel=1e-5), key


class _InPlace(nn.Module):
    """Small outputs changed in place after their module returned them: a BatchNorm's by an in-place ReLU, a
    Linear's by a residual add (from the forward pass numbered ``residual_from`` on, counting from 0)."""

    def __init__(self, residual_from: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.act = nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(inplace=True)
        self.fc2, self.act2, self.head = nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
        self.residual_from, self.calls = residual_from, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.fc1(x)))
        out = self.fc2(h)
        if self.calls >= self.residual_from:
            out += h
        self.calls += 1
        return self.head(self.act2(out))


def test_outputs_changed_in_place_get_the_gradient_of_what_their_module_returned(tmp_path):
    """autograd keeps a tensor's gradient for its latest version: for an output changed in place after its module
    returned it, that is the gradient of what the in-place operation made, not of the module's output."""
    steps, rows = 4, 8
    expected = _reference_norms(_InPlace(), steps, rows)
    stored = _stored_norms(_InPlace(), steps, rows, tmp_path)
    assert set(stored) == set(expected)
    for key, norm in expected.items():
        assert stored[key] == pytest.approx(norm, rel=1e-5), key


def test_an_output_first_changed_in_place_at_a_later_step_has_no_norm_that_step_then_its_own(tmp_path):
    """The path changes at step 2: fc2's output is changed in place for the first time after the sampled steps
    that learnt which outputs are. That step it has no row (its output was lost for every statistic: missing,
    never wrong) and no other module gets its gradient; from the next, its own."""
    steps, rows = 5, 8
    expected = _reference_norms(_InPlace(residual_from=2), steps, rows)
    stored = _stored_norms(_InPlace(residual_from=2), steps, rows, tmp_path)
    assert ("fc2", 2) not in stored
    for key, norm in expected.items():
        if key != ("fc2", 2):
            assert stored[key] == pytest.approx(norm, rel=1e-5), key


class _Deep(nn.Module):
    """12 small blocks (their gradients' norms are stacked by shape) and a narrower head; ``depth`` blocks run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(12))
        self.head = nn.Linear(16, 8)
        self.depth = 12

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:self.depth]:
            x = block(x)
        return self.head(x)


def _train_varying(model: _Deep, opt, w, schedule, hook_norms=None) -> None:
    g = torch.Generator().manual_seed(2)
    for step, (rows, bf16, depth) in enumerate(schedule):
        if hook_norms is not None:
            hook_norms["step"] = step
        model.depth = depth
        x, y = torch.randn(rows, 16, generator=g), torch.randint(0, 8, (rows,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if w is not None:
            w.step(loss)


def test_gradient_norms_stay_right_when_the_calls_change_between_steps(tmp_path):
    """A sampled step reuses the last one's plan of the small gradients' norms while their shapes are the
    same: here the same shapes come in bfloat16 (autocast), then the batch shrinks, then fewer blocks run,
    then all as before. Each change of shapes needs a new plan: an old one mixes or misses gradients."""
    schedule = [(8, False, 12), (8, False, 12), (8, True, 12), (4, True, 12), (8, False, 8), (8, False, 12)]
    expected: dict = {}

    def hook(path):
        def forward_hook(module, args, output):
            step = expected["step"]
            output.register_hook(lambda g: expected.__setitem__((path, step), g.float().norm().item()))
        return forward_hook

    reference = _Deep()
    for path, m in reference.named_modules():
        m.register_forward_hook(hook(path))
    _train_varying(reference, torch.optim.SGD(reference.parameters(), lr=0.1), None, schedule, expected)
    del expected["step"]
    model = _Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        _train_varying(model, opt, w, schedule)
    con = sqlite3.connect(w.store_path)
    stored = {(path, step): norm for path, step, norm in con.execute(
        "SELECT m.path, s.step, s.out_grad_norm FROM module_stats s JOIN modules m USING(rank, module_id)")}
    con.close()
    assert w.probe_errors == {}
    assert set(stored) == set(expected)
    for key, norm in expected.items():
        assert stored[key] == pytest.approx(norm, rel=1e-5), key


class _Cached(nn.Module):
    """Returns the same non-leaf tensor at every call (made once, its graph kept by backward(retain_graph=True)):
    under retain_grad its .grad would add up over the steps, and a norm read from it be of them all together."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.cached: torch.Tensor | None = None

    def forward(self):
        if self.cached is None:
            self.cached = self.fc(torch.ones(1, 8))
        return self.cached


class _WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.cache, self.out = nn.Linear(8, 8), _Cached(), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.inp(x) + self.cache())


def test_the_users_own_retained_gradients_stay_theirs_through_sampled_steps(tmp_path):
    """A user who keeps the gradient of a module's output (out.retain_grad(), after modscope's hook saw the output)
    reads it after optimizer.step() at every step. modscope used to set .grad back to None at the end of a sampled
    step, so a saliency map or a gradient check read None (and failed) on sampled steps only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    seen = []
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for _ in range(4):
            out = model(x)
            out.retain_grad()
            loss = out.pow(2).sum()
            opt.zero_grad()
            loss.backward()
            expected = (2 * out).detach()
            opt.step()
            w.step(loss)
            seen.append(out.grad is not None and torch.equal(out.grad, expected))
    assert seen == [True] * 4


def test_a_module_returning_the_same_tensor_every_step_gets_each_steps_own_gradient(tmp_path):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=g) for _ in range(4)]
    torch.manual_seed(0)
    model, twin = _WithCache(), _WithCache()
    twin.load_state_dict(model.state_dict())
    # autograd's gradient of the cached output at each step, read with a hook of our own on an unwatched twin
    reference: dict[int, float] = {}
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
    for s, x in enumerate(batches):
        handle = twin.cache().register_hook(lambda grad, s=s: reference.__setitem__(s, grad.norm().item()))
        opt_twin.zero_grad()
        twin(x).sum().backward(retain_graph=True)
        opt_twin.step()
        handle.remove()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.watch(model, opt, run_dir=tmp_path, every=1) as w:
        for x in batches:
            opt.zero_grad()
            model(x).sum().backward(retain_graph=True)
            opt.step()
    con = sqlite3.connect(w.store_path)
    stored = dict(con.execute("SELECT s.step, s.out_grad_norm FROM module_stats s JOIN modules m USING(rank, module_id)"
                              " WHERE m.path = 'cache'"))
    con.close()
    assert len(reference) == 4 and set(stored) == set(reference)
    for s, norm in reference.items():
        assert stored[s] == pytest.approx(norm, rel=1e-5), (s, stored, reference)
