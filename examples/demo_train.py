"""The demo: an XOR classifier with the most common silent bug, an encoder that keeps its blocks in a plain list.

    python examples/demo_train.py                  # then: python app.py --run runs/<printed dir>
    python examples/demo_train.py --fixed          # the same model with nn.ModuleList

It trains, validation accuracy rises, and three Linear layers (816 numbers) are never seen
by the optimizer, state_dict(), .to() or .eval(). modscope flags them.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import probes


class Encoder(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, fixed: bool = False) -> None:
        super().__init__()
        blocks = [nn.Linear(width, width) for _ in range(depth)]
        self.blocks = nn.ModuleList(blocks) if fixed else blocks     # the bug: a plain list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


class Classifier(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, fixed: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(2, width)
        self.encoder = Encoder(width, depth, fixed)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = self.encoder(x)
        return self.head(x)


def xor_data(n: int = 2000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, generator=g)
    y = ((X[:, 0] > 0) ^ (X[:, 1] > 0)).long()
    perm = torch.randperm(n, generator=g)
    split = int(n * 0.8)
    return X[perm[:split]], y[perm[:split]], X[perm[split:]], y[perm[split:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default=None, help="where the store is written (default: a new ./runs/<time>)")
    ap.add_argument("--steps", type=int, default=200, help="training steps; 0 = run until stopped")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds to sleep per step (keeps a demo live)")
    ap.add_argument("--every", type=int, default=None, help="sample every N steps (default: overhead budget)")
    ap.add_argument("--fixed", action="store_true", help="use nn.ModuleList (the fix)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    X_train, y_train, X_val, y_val = xor_data(seed=args.seed)
    model = Classifier(fixed=args.fixed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    every = args.every if args.every is not None else (1 if args.delay > 0 else None)
    with probes.watch(model, optimizer, run_dir=args.run_dir, every=every,
                      run_name="demo (fixed)" if args.fixed else "demo") as w:
        print(f"writing to {w.run_dir}", flush=True)
        step = 0
        while args.steps == 0 or step < args.steps:
            logits = model(X_train)
            loss = F.cross_entropy(logits, y_train)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            w.step(loss)
            if step % 50 == 0 or step == args.steps - 1:
                with torch.no_grad():
                    val_acc = (model(X_val).argmax(1) == y_val).float().mean()
                print(f"step={step:4d} loss={loss.item():.4f} val_acc={val_acc.item():.3f}", flush=True)
            if args.delay:
                time.sleep(args.delay)
            step += 1
        for f in w.findings():
            if f.severity != "info":
                print(f, flush=True)
    print(f"store: {w.store_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
