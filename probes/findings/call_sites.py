"""The calls of a module called several times a step, judged apart by the dead-layer detectors.

One ``nn.ReLU`` instance applied after a block's first conv and again after its residual add (torchvision's
``BasicBlock``) is two layers that share a module: the first call may be dead while the second is alive. Each
measured call (``MAX_CALLS_MEASURED`` a step) keeps its own unit activity (``capture/step.py`` keys a later call's by
``(module id, call)``), and each call's output says whether it was flat (no spread over more than one value); a
module's row carries its worst call (:class:`probes.capture.decode.SharedCalls`), and the detectors judge, name and
place in the execution order the call that shows it.
"""

from __future__ import annotations

import torch

from ..capture.decode import ModuleColumns, SharedCalls
from ..capture.record import MAX_CALLS_MEASURED

_ALL_CALLS = (1 << MAX_CALLS_MEASURED) - 1


def flat_in_every_sample(flat: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per id, the calls (bit k: call k) whose output was flat in every sample of the window: ``flat`` holds each
    sample's bits ([size, ids], NaN where never written), ``valid`` the slots written."""
    bits = torch.where(valid, torch.nan_to_num(flat, nan=0.0), float(_ALL_CALLS)).to(torch.int64)
    out = torch.zeros(flat.shape[1], dtype=torch.int64)
    for k in range(MAX_CALLS_MEASURED):
        out |= ((bits >> k) & 1).all(0).to(torch.int64) << k
    return out


def first_call(bits: int) -> int:
    """The first call set in ``bits`` (0 when none is)."""
    return (bits & -bits).bit_length() - 1 if bits > 0 else 0


class CallSites:
    """The latest sampled step's modules measured in several calls, and which call of each flagged one is judged."""

    def __init__(self) -> None:
        self.shared: dict[int, SharedCalls] = {}
        self.site: dict[int, int] = {}          # flagged module called several times -> the call judged

    def observe(self, m: ModuleColumns, std: torch.Tensor, numel: torch.Tensor) -> torch.Tensor:
        """The step's flat bits per module (bit 0 for a module called once), from its std and numel columns."""
        flat = ((std == 0) & (numel > 1)).to(torch.float32)
        for shared in m.shared.values():
            flat[shared.row] = shared.flat
        self.shared = m.shared
        return flat

    def least_dead(self, m: ModuleColumns, dead: torch.Tensor) -> torch.Tensor:
        """The dead fraction per module of its call with the fewest dead units (a module called once: its own):
        units dead in every call are at most that many."""
        if not m.shared:
            return dead
        least = dead.clone()
        for shared in m.shared.values():
            measured = [r[0] for r in shared.rows if r[0] == r[0]]
            if measured:
                least[shared.row] = min(measured)
        return least

    def judge(self, flagged: list[int], constant: torch.Tensor, flat: torch.Tensor) -> None:
        """The call judged of each flagged module called several times: the first whose output was flat in every
        sample of the window (``flat``) when the module is ``constant``, else the one with the most dead units."""
        self.site = {m: first_call(int(flat[m])) if constant[m] else self.shared[m].dead_call
                     for m in flagged if m in self.shared}

    def judged_in(self, call: tuple[int, int] | None, modules: set[int]) -> bool:
        """``call`` (module id, which call) is the judged call (the first of a module called once) of one of
        ``modules``."""
        return call is not None and call[0] in modules and call[1] == self.site.get(call[0], 0)

    def judged(self, mid: int) -> tuple[tuple[int, int], float] | None:
        """(the call judged, the module's calls a step) and that call's mean in the latest sampled step; None for a
        module called once."""
        shared, k = self.shared.get(mid), self.site.get(mid)
        if shared is None or k is None or k not in shared.calls:
            return None
        return (k, shared.called), shared.rows[shared.calls.index(k)][3]

    def rows(self, mid: int) -> list[torch.Tensor] | None:
        """(dead fraction, numel, std, mean) of each call of a module called several times (float32); None else."""
        shared = self.shared.get(mid)
        return None if shared is None else [torch.tensor(r, dtype=torch.float32) for r in shared.rows]

    def sequence(self, orders: dict[int, int]) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
        """(execution order, module id, call) of every measured call of the latest sampled step, in execution order
        (the first call of each module, ``orders``, and the later ones of those called several times), and each
        module's place in it: its judged call's, else its first's."""
        seq = [(o, m, self.shared[m].calls[0] if m in self.shared else 0) for m, o in orders.items()]
        seq += [(o, m, k) for m, s in self.shared.items() for o, k in zip(s.orders[1:], s.calls[1:], strict=True)]
        seq.sort()
        site = self.site
        return seq, {m: i for i, (_, m, k) in reversed(list(enumerate(seq))) if k == site.get(m, k)}
