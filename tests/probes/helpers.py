import sqlite3

import torch.nn.functional as F


def train(model, optimizer, watcher, steps, batch_fn, loss_fn=F.cross_entropy, zero_grad=True):
    losses = []
    for _ in range(steps):
        x, y = batch_fn()
        out = model(x)
        loss = loss_fn(out, y)
        if zero_grad:
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if watcher is not None:
            watcher.step(loss)
        losses.append(loss.detach())
    return losses


def by_code(findings):
    out = {}
    for f in findings:
        out.setdefault(f.code, []).append(f)
    return out


def codes(findings, severity=None):
    return {(f.code, f.path) for f in findings if severity is None or f.severity == severity}


def stored(w, sql):
    """Rows of ``sql`` on the store of watcher ``w``."""
    con = sqlite3.connect(w.store_path)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()
