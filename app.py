"""modscope dashboard entry point.

    python app.py                               demo training + live dashboard on http://127.0.0.1:8050
    python app.py --run DIR                     follow a run a training script is writing
    python app.py --snapshot FILE               review a snapshot (read-only, no polling)
    python app.py --compare A B                 two runs or snapshots side by side
    python app.py export (--run DIR | --snapshot FILE) -o report.html
    options: --host H --port P --token T

Any unusable argument exits with status 2 and one line naming the path and the problem.
"""

from __future__ import annotations

import argparse
import sys

from dashboard.cli import (
    check_port_number,
    export,
    open_config,
    serve,
    start_demo_config,
)
from dashboard.demo import DEMO_ARGS


def parse_serve(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python app.py", description="modscope dashboard")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", metavar="DIR", help="follow the run store in DIR (live)")
    src.add_argument("--snapshot", metavar="FILE", help="open a snapshot read-only (review mode)")
    src.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two runs or snapshots")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="port (default 8050)")
    p.add_argument("--token", help="access token (required, or generated, for a non-loopback host)")
    p.add_argument("--poll-ms", type=int, default=1000, help="live polling interval in ms (default 1000)")
    p.add_argument("--runs-dir", default="runs", help="where the demo writes its run (default ./runs)")
    p.add_argument("--demo-arg", action="append", default=None, metavar="ARG",
                   help="argument passed to examples/demo_train.py, repeatable "
                        f"(default: {' '.join(DEMO_ARGS)}: train until stopped, sampling every step)")
    return p.parse_args(argv)


def parse_export(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python app.py export", description="write a standalone HTML report")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR")
    src.add_argument("--snapshot", metavar="FILE")
    p.add_argument("-o", "--output", required=True, metavar="report.html")
    p.add_argument("--rank", type=int, default=0)
    return p.parse_args(argv)


def export_main(argv: list[str]) -> int:
    args = parse_export(argv)
    return export(args.output, run=args.run, snapshot=args.snapshot, rank=args.rank)


def serve_main(argv: list[str]) -> int:
    args = parse_serve(argv)
    check_port_number(args.port)
    demo_proc = None
    if args.compare or args.snapshot or args.run:
        config = open_config(run=args.run, snapshot=args.snapshot, compare=args.compare, poll_ms=args.poll_ms)
    else:
        config, demo_proc = start_demo_config(args.host, args.port, args.runs_dir,
                                              list(DEMO_ARGS) if args.demo_arg is None else args.demo_arg,
                                              args.poll_ms)
    return serve(config, args.host, args.port, token=args.token, demo_proc=demo_proc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "export":
        return export_main(argv[1:])
    return serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
