"""``modscope export (--run DIR | --snapshot FILE) -o report.html``: the standalone HTML report of a run or a
snapshot, written to a new file (never over a file of the store it reads)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from probes.schema import printable

from .args import ABOUT, Parser, check_store_target, fail

__all__ = ["check_output_not_read", "export", "export_main"]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:         # one of them does not exist (yet): compare where they would be
        return a.resolve() == b.resolve()


def check_output_not_read(output: str, target: str) -> None:
    """``-o`` must not name a file of a store the export reads (the store, its ``-wal``, ``-shm``,
    ``-journal``, lock or status file): the report written there would replace the run."""
    from probes.schema import LOCK_SUFFIX, STATUS_SUFFIX

    from ..read.run import scan_runs

    out = Path(output)
    for entry in scan_runs(target, limit=sys.maxsize):
        for store in entry.files:
            for suffix in ("", "-wal", "-shm", "-journal", LOCK_SUFFIX, STATUS_SUFFIX):
                if _same_file(out, Path(f"{store}{suffix}")):
                    what = "the store" if not suffix else f"the {suffix.lstrip('-.')} file of the store"
                    fail(f"-o {output}: is {what} {store} being exported; expected a new file for the report")


def export(output: str, *, run: str | None = None, snapshot: str | None = None, rank: int | None = None) -> int:
    """Write the standalone HTML report of a run or snapshot (the newest run of a directory) to
    ``output``: the tree and charts of ``rank`` (default: the run's lowest)."""
    from ..read.run import as_run_dir
    from ..read.store import Store, StoreError
    from ..web.report import write_report

    if run is not None:
        check_store_target("--run", run)
    if snapshot is not None:
        check_store_target("--snapshot", snapshot)
    if run is None and snapshot is None:
        fail("export: expected --run DIR or --snapshot FILE")
    option, target = ("--run", run) if run is not None else ("--snapshot", str(snapshot))
    if not Path(target).exists():
        # (a live run that does not exist yet can only be served: export needs what was written)
        fail(f"{option} {target}: no such file or directory" + (" (no store yet)" if run is not None else ""))
    check_output_not_read(output, target)
    try:
        store = Store.open_run(target) if run is not None else Store.open_snapshot(target)
        if not store.ready():
            fail(f"{option} {target}: no store yet (nothing written to this run)")
        chosen = as_run_dir(store).run()
        ranks = chosen.ranks()
        if rank is not None and rank not in ranks:
            fail(f"--rank {rank}: no such rank in this run; expected one of {', '.join(map(str, ranks))}")
        out = write_report(chosen, output, rank)
    except StoreError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{output}: cannot write ({exc.strerror or exc})")
    print(printable(f"wrote {out}"))
    return 0


def export_main(argv: Sequence[str], prog: str = "modscope") -> int:
    p = Parser(prog=f"{prog} export", description=ABOUT["export"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR")
    src.add_argument("--snapshot", metavar="FILE")
    p.add_argument("-o", "--output", required=True, metavar="report.html")
    p.add_argument("--rank", type=int, default=None, help="the rank whose tree and charts are shown "
                                                          "(default: the run's lowest)")
    args = p.parse_args(list(argv))
    return export(args.output, run=args.run, snapshot=args.snapshot, rank=args.rank)
