"""``modscope snapshot (--run DIR | --snapshot FILE) -o FILE``: the file the dashboard's Snapshot button gives, from the
command line: every rank of a run (the newest run of a directory) as one consistent store file.

The copy is ``probes.schema.snapshot``'s: a new file made from the schema, the known columns of the known tables
copied row by row (memory independent of the store's size), none of the source's triggers, views or other objects,
none of its SQL run, stopped after ``--timeout`` seconds. A snapshot given with ``--snapshot`` is copied the same way:
what comes out holds only what modscope writes (docs/security.md). Any problem: exit status 2 and one line."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from probes.schema import LOCK_SUFFIX, STATUS_SUFFIX

ABOUT = "copy a run (every rank) or a snapshot into one store file: only what modscope writes, nothing else"


def parser(prog: str, parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = parser_class(prog=f"{prog} snapshot", description=ABOUT)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory (its newest run) or one store file")
    src.add_argument("--snapshot", metavar="FILE", help="a snapshot file")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the snapshot to write (replaced if there)")
    p.add_argument("--rank", type=int, default=None, help="the rank whose newest step the summary names "
                                                          "(default: the run's lowest); every rank is copied")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="stop (and write nothing) after S seconds (default 600)")
    return p


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def output_problem(output: Path, sources: Sequence[Path]) -> str | None:
    """Why ``output`` cannot be written (a directory, or a file of a store being copied), or None."""
    if output.is_dir():
        return f"-o {output}: is a directory; expected a file path for the snapshot"
    for store in sources:
        for suffix in ("", "-wal", "-shm", "-journal", LOCK_SUFFIX, STATUS_SUFFIX):
            if _same_file(output, Path(f"{store}{suffix}")):
                what = "the store" if not suffix else f"the {suffix.lstrip('-.')} file of the store"
                return f"-o {output}: is {what} {store} being copied; expected a new file for the snapshot"
    return None


def run_snapshot(args: argparse.Namespace) -> str:
    """Write the snapshot ``args`` asks for; returns the line to print. Raises SystemExit(2) (one line) on any
    problem (``dashboard.cli.fail``)."""
    from ..read.run import as_run_dir
    from ..read.store import Store, StoreError, snapshot_to
    from .args import check_store_target, fail

    option, target = ("--run", args.run) if args.run is not None else ("--snapshot", args.snapshot)
    check_store_target(option, target)
    if not Path(target).exists():
        fail(f"{option} {target}: no such file or directory")
    if not args.timeout > 0:
        fail(f"--timeout {args.timeout:g}: expected a positive number of seconds")
    try:
        store = Store.open_run(target) if args.run is not None else Store.open_snapshot(target)
        if not store.ready():
            fail(f"{option} {target}: no store yet (nothing written to this run)")
        run = as_run_dir(store).run()
        ranks = run.ranks()
        if args.rank is not None and args.rank not in ranks:
            fail(f"--rank {args.rank}: no such rank in this run; expected one of {', '.join(map(str, ranks))}")
        files = run.snapshot_files()
        output = Path(args.output)
        problem = output_problem(output, files)
        if problem:
            fail(problem)
        step = snapshot_to(files, output, run.view_rank(args.rank), timeout_s=args.timeout)
    except StoreError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{args.output}: cannot write ({exc.strerror or exc})")
    ranks_text = f"{len(ranks)} ranks" if len(ranks) > 1 else f"rank {ranks[0]}"
    return f"wrote {output} ({ranks_text}, step {'–' if step is None else step})"


def snapshot_main(argv: Sequence[str], prog: str, parser_class: type[argparse.ArgumentParser]) -> int:
    print(run_snapshot(parser(prog, parser_class).parse_args(list(argv))))
    return 0
