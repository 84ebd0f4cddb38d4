"""What ``--run PATH`` names when it is not a run: a path that does not exist yet, or a folder of run folders.

``modscope serve --run runs/exp1`` started before the training waits for the run: it says so once and then
follows it when it appears. ``modscope serve --run runs`` on the folder that holds the run folders (what
``probes.watch()`` makes by default: ``./runs/<time>/``) is not a run: the folders that are are listed, newest
first, with how to pick one. Plain functions of the file system (no store is opened): no Dash, no torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .run import scan_runs

__all__ = ["RunFolder", "run_folders", "run_folders_text", "waiting_text"]

MAX_LISTED = 20             # run folders listed (the newest)
MAX_SCANNED = 500           # sub-folders looked at


@dataclass(frozen=True)
class RunFolder:
    """A sub-folder that holds runs: its path, how many runs, and when a store in it last changed."""

    path: Path
    runs: int
    mtime: float


def waiting_text(path: str | os.PathLike[str]) -> str:
    """The one line a dashboard prints when told to follow a run that does not exist yet."""
    p = Path(path)
    if p.suffix == ".sqlite":
        return f"modscope: waiting for the store {p}: it does not exist yet"
    return f"modscope: waiting for a run in {p}: it does not exist yet"


def run_folders(path: str | os.PathLike[str]) -> list[RunFolder]:
    """The sub-folders of ``path`` that hold runs, newest first; empty when ``path`` is a run itself (it holds a
    store), is no folder, or holds no run folder."""
    p = Path(path)
    if not p.is_dir() or scan_runs(p):
        return []
    out = []
    try:
        entries = sorted(os.scandir(p), key=lambda e: e.name)[:MAX_SCANNED]
    except OSError:
        return []
    for entry in entries:
        try:
            if not entry.is_dir():
                continue
        except OSError:
            continue
        runs = scan_runs(entry.path)
        if runs:
            out.append(RunFolder(Path(entry.path), len(runs), max(r.mtime for r in runs)))
    out.sort(key=lambda f: (f.mtime, f.path.name), reverse=True)
    return out


def run_folders_text(option: str, path: str | os.PathLike[str], folders: list[RunFolder],
                     command: str = "modscope serve") -> str:
    """Lines saying that ``path`` is a folder of run folders, listing them, and how to pick one."""
    n = len(folders)
    lines = [f"{option} {path}: a folder of {n} run folder{'s' if n != 1 else ''}, not a run; pick one "
             f"(newest first), e.g. {command} {option} {folders[0].path}"]
    for f in folders[:MAX_LISTED]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.mtime)) if f.mtime else "?"
        runs = f"{f.runs} runs" if f.runs != 1 else "1 run"
        lines.append(f"  {f.path}  ({runs}, last written {when})")
    if n > MAX_LISTED:
        lines.append(f"  ... and {n - MAX_LISTED} more")
    return "\n".join(lines)
