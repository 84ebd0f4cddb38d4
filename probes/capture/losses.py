"""The loss of each step: read at once on the CPU; on an accelerator kept on the device and read with the
next sampled step's single host copy (or when MAX_PENDING are waiting, or at close), never with a sync of
its own."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..model import tensors
from ..store import records
from ..store.records import Op

MAX_PENDING = 64


class LossRecorder:
    def __init__(self, rank: int, submit: Callable[[list[Op]], object], observe: Callable[[int, float | None], None]):
        self.rank = rank
        self._submit = submit              # store operations
        self._observe = observe            # the loss sentinel (non-finite losses)
        self.pending: list[tuple[int, torch.Tensor]] = []

    def record(self, step: int, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            if not tensors.reads_free(loss.device):
                self.pending.append((step, loss))
                if len(self.pending) >= MAX_PENDING:
                    self.flush()
                return
            loss = float(loss.reshape(-1)[0]) if loss.numel() else None
        elif loss is not None:
            loss = float(loss)
        self._observe(step, loss)
        self._submit([records.loss_op(self.rank, step, time.time(), loss)])

    def record_from(self, step: int, source: Callable[[], Any] | None) -> None:
        """The loss ``source`` gives for ``step`` (zero-code: what backward() ran on), if any."""
        loss = source() if source is not None else None
        if loss is not None:
            self.record(step, loss)

    def take_pending(self) -> list[tuple[int, torch.Tensor]]:
        """The device losses waiting, to be read with a sampled step's copy (see :meth:`read`)."""
        pending, self.pending = self.pending, []
        return pending

    def read(self, values: list[tuple[int, float]]) -> None:
        """Losses read with a sampled step's copy: (step, value)."""
        now = time.time()
        for step, v in values:
            self._observe(step, v)
        if values:
            self._submit([records.loss_op(self.rank, s, now, v) for s, v in values])

    def flush(self) -> None:
        pending = self.take_pending()
        if pending:
            vals = torch.stack([v.reshape(-1)[0].float() for _, v in pending]).cpu().tolist()
            self.read([(s, v) for (s, _), v in zip(pending, vals, strict=True)])
