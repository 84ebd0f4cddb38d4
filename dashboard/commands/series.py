"""``modscope series``: one metric of a run over time as a tidy CSV (``step,rank,path,metric,value``), for a
notebook, a spreadsheet or another plotting tool. The rows are :func:`dashboard.series.read_series`'s.

Exit status: 0, or 2 with one line on stderr when an argument is wrong (an unknown metric names the metrics)
or the store cannot be read."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


def parser(prog: str, make: Callable[..., argparse.ArgumentParser]) -> argparse.ArgumentParser:
    from ..read.series import METRICS
    from .args import ABOUT, COMMANDS

    p = make(prog=f"{prog} series", usage=f"{prog} series {COMMANDS['series']}", description=ABOUT["series"],
             epilog="metrics: " + "; ".join(f"{m.name} ({m.doc})" for m in METRICS.values()))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory (its newest run) or one store file")
    src.add_argument("--snapshot", metavar="FILE", help="a snapshot file")
    p.add_argument("--metric", required=True, metavar="NAME", help=f"one of {', '.join(METRICS)}")
    p.add_argument("--rank", type=int, default=None, help="only this rank (default: every rank)")
    p.add_argument("-o", "--output", metavar="FILE", default=None, help="write the CSV here (default: stdout)")
    return p


def series_main(argv: Sequence[str], prog: str, make: Callable[..., argparse.ArgumentParser],
                fail: Callable[[str], NoReturn]) -> int:
    """Parse, read, write; ``make`` builds the command line's parser and ``fail`` exits 2 with one line."""
    from ..read.series import COLUMNS, MetricError, metric_spec, open_run, run_frame
    from ..read.store import StoreError
    from .args import check_store_target
    from .export import check_output_not_read

    args = parser(prog, make).parse_args(list(argv))
    try:
        spec = metric_spec(args.metric)
    except MetricError as exc:
        fail(f"--metric: {exc}")
    option, target = ("--run", args.run) if args.run is not None else ("--snapshot", args.snapshot)
    check_store_target(option, target)
    if args.output is not None:
        check_output_not_read(args.output, target)
    try:
        df = run_frame(open_run(target), spec.name, args.rank)
    except StoreError as exc:
        fail(str(exc))
    assert tuple(df.columns) == COLUMNS
    try:
        if args.output is None:
            df.to_csv(sys.stdout, index=False, lineterminator="\n")
        else:
            df.to_csv(args.output, index=False, lineterminator="\n")
    except OSError as exc:
        fail(f"{args.output}: cannot write ({exc.strerror or exc})")
    if args.output is not None:
        print(f"wrote {len(df):,} rows of {spec.name} to {args.output}", file=sys.stderr)
    return 0
