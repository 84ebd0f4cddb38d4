"""The runs of a run directory: its store files grouped by run id, newest first."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from probes.schema import LEGACY_STORE_FILENAME, STORE_SUFFIX, parse_store_filename

from .files import last_modified, rank_files

FILE_KEY = "@file:"             # the key of a run read from one file that its name does not name a run
MAX_RUNS = 50                   # runs of a directory listed (the newest)


@dataclass(frozen=True)
class RunEntry:
    """One run as the directory listing sees it (no file opened)."""

    key: str                                 # the run id, or FILE_KEY + file name
    run_id: str | None                       # from the file names (None for a version-1 store or a snapshot)
    files: tuple[Path, ...]                  # per-rank files in rank order; or the one file
    file_ranks: tuple[int | None, ...]       # the rank each file's name says (None: a file of any ranks)
    mtime: float                             # the newest modification of its files (-wal and -journal included)


def _mtime(path: Path) -> float:
    return last_modified(path)


def _file_entry(path: Path) -> RunEntry:
    name = parse_store_filename(path.name)
    if name is not None:
        return RunEntry(name.run_id, name.run_id, (path,), (name.rank,), _mtime(path))
    return RunEntry(FILE_KEY + path.name, None, (path,), (None,), _mtime(path))


def scan_runs(target: str | os.PathLike[str], limit: int = MAX_RUNS) -> list[RunEntry]:
    """The runs at ``target``, newest first (the largest modification time of a run's files; a tie goes
    to the larger run id): every run id of the per-rank stores of a directory and its version-1
    ``modscope.sqlite``; or the one store file named. No file is opened."""
    p = Path(target)
    if not p.is_dir():
        if p.suffix != STORE_SUFFIX and not p.is_file():
            return []                           # a run directory that does not exist yet
        return [_file_entry(p)]
    legacy_path = p / LEGACY_STORE_FILENAME
    try:
        legacy = _file_entry(legacy_path) if legacy_path.is_file() else None
    except OSError:                             # a directory that cannot be searched
        legacy = None
    out = []
    for run_id, files in rank_files(p).items():
        paths = tuple(f for _, f in files)
        out.append(RunEntry(run_id, run_id, paths, tuple(r for r, _ in files), max(_mtime(f) for f in paths)))
    if legacy is not None:
        out.append(legacy)
    out.sort(key=lambda e: (e.mtime, e.run_id or ""), reverse=True)
    return out[:limit]
