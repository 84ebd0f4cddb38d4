"""modscope's command line from a checkout: ``python app.py`` is ``modscope`` (the console script
an install provides), and starts the live demo when given no command.

    python app.py                               demo training + live dashboard on http://127.0.0.1:8050
    python app.py serve --run DIR               follow a run a training script is writing
    python app.py serve --snapshot FILE         review a snapshot (read-only, no polling)
    python app.py serve --compare A B           two runs or snapshots side by side
    python app.py export (--run DIR | --snapshot FILE) -o report.html
    python app.py findings (--run DIR | --snapshot FILE) [--json] [--fail-on error|warning|info]
    python app.py series (--run DIR | --snapshot FILE) --metric NAME [--rank R] [-o FILE]
    python app.py run [--run-dir DIR] [--every N] [--serve] script.py [ARGS...]
    options of serve and demo: --host H --port P --token T
    today's flags without a command still work: python app.py --run DIR (serve), --port P (demo)

Any unusable argument exits with status 2 and one line naming the value and the problem.
The commands live in dashboard/cli.py.
"""

from __future__ import annotations

import sys

from dashboard.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli_main(argv or ["demo"], prog="python app.py")


if __name__ == "__main__":
    sys.exit(main())
