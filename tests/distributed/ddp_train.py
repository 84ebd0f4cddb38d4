"""A tiny DDP training for tests/distributed/test_torchrun.py, started by ``torchrun`` (gloo, CPU).

    torchrun --nproc_per_node=2 tests/distributed/ddp_train.py --run-dir DIR [--steps N] [--every N]
             [--diverge-at STEP] [--slow-rank R --slow-ms MS]

Every rank trains the same two-layer model wrapped in DistributedDataParallel on its own data, watched
by ``probes.watch`` into one run directory (one store per rank). ``--diverge-at STEP``: after that
step's optimizer step, rank 1 (only) changes ``fc.weight`` in place, once, under no_grad -- what data
parallelism cannot see and the dashboard must (rank-divergence). ``--slow-rank R --slow-ms MS``: rank R
sleeps MS milliseconds before every backward (a slow data pipeline, a slower host): under DDP every rank's
wall time per step is the same, only rank R's own time is longer (rank-straggler).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import probes


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=0, help="sample every N-th step (0: the default budget)")
    ap.add_argument("--diverge-at", type=int, default=-1, help="rank 1 changes fc.weight in place after this step")
    ap.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps before every backward")
    ap.add_argument("--slow-ms", type=float, default=20.0, help="how long the slow rank sleeps (ms)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)                                   # the same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(Tiny())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)      # each rank its own data
    try:
        with probes.watch(model, opt, run_dir=args.run_dir, every=args.every or None) as w:
            for step in range(args.steps):
                x = torch.randn(32, 8, generator=data)
                y = (x[:, 0] > 0).long()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                if rank == args.slow_rank:
                    time.sleep(args.slow_ms / 1e3)
                loss.backward()
                opt.step()
                w.step(loss)
                if step == args.diverge_at and rank == 1:
                    with torch.no_grad():
                        model.module.fc.weight.add_(0.5)   # in place, on this rank only, once
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
