"""The training process of ``modscope run``: runs a script (or a module) as ``__main__`` with the
zero-code watcher installed.

    python -m probes.launch.autorun --run-dir DIR [--every N | --overhead F] -- script.py [ARGS...]
    python -m probes.launch.autorun --run-dir DIR [--every N | --overhead F] -- -m package.module [ARGS...]

The script sees what ``python script.py ARGS`` gives it: ``sys.argv`` (the path as given, then
ARGS), ``sys.path`` (the script's real directory first, the working folder nowhere; modscope's own packages are
imported from where modscope is installed before that: dashboard/commands/children.py), ``__file__`` (absolute),
``__name__ == "__main__"``, and ``sys.modules["__main__"]`` is its module (pickling and ``multiprocessing``
find its classes). ``-m`` runs like ``python -m``: ``runpy.run_module(..., alter_sys=True)``.
The exit status is the script's: 0 when it returns, its ``sys.exit`` code, 1 after an uncaught
exception (its traceback printed without this module's frames); an uncaught ``KeyboardInterrupt``
ends the process by SIGINT, as Python does. The watchers are closed before it exits.

Only this process installs the watcher (:mod:`probes.launch.autowatch`), and only because this module
is run: children (DataLoader workers, ``multiprocessing`` and ``subprocess``) run nothing of it.
``modscope run`` (dashboard/cli.py) starts this module, and the dashboard only as a process of
its own: Dash never enters the training process.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import os
import runpy
import signal
import sys
import traceback
import types
from collections.abc import Sequence
from typing import NoReturn

from ..schema import every_option, overhead_option

USAGE = ("python -m probes.launch.autorun --run-dir DIR [--every N | --overhead F] -- "
         "(script.py | -m package.module) [ARGS...]")


def _fail(msg: str) -> NoReturn:
    print(f"modscope run: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, target): target is ``[script, *args]`` or ``["-m", module, *args]``."""
    argv = list(argv)
    if "--" not in argv:
        _fail(f"expected '--' before the script; usage: {USAGE}")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m probes.launch.autorun", usage=USAGE)
    p.add_argument("--run-dir", required=True, metavar="DIR")
    p.add_argument("--every", type=every_option, default=None, metavar="N")
    p.add_argument("--overhead", type=overhead_option, default=0.01, metavar="F")
    opts = p.parse_args(argv[:cut])
    target = argv[cut + 1:]
    if not target or (target[0] == "-m" and len(target) < 2):
        _fail(f"expected a script or -m package.module after '--'; usage: {USAGE}")
    return opts, target


def _exit_status(exc: SystemExit) -> int:
    """What the interpreter makes of an uncaught SystemExit."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the script's first frame on: this module's and runpy's frames dropped."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or ""), "<frozen runpy>"}
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    return tb


def run_script(path: str) -> None:
    """Execute ``path`` as ``python path`` would (sys.argv is set by the caller)."""
    full = os.path.abspath(path)
    try:
        with open(full, "rb") as fh:
            source = fh.read()
    except OSError as exc:
        # python's own words: can't open file 'x.py': [Errno 2] No such file or directory
        print(f"{sys.executable}: can't open file {full!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    code = compile(source, full, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=full, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", full))
    _launcher_entry(os.path.dirname(os.path.realpath(full)))
    # like viztracer: the script is __main__ for good (pickle, multiprocessing spawn, atexit)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def run_module(name: str) -> None:
    _launcher_entry(os.getcwd())
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def _launcher_entry(first: str) -> None:
    """``sys.path[0]``, the launcher's entry (the folder of modscope's packages, dashboard/commands/children.py;
    the working folder under ``python -m probes.launch.autorun``), becomes what ``python script.py`` (the script's
    folder) or ``python -m`` (the working folder) puts there; under ``-P`` / ``PYTHONSAFEPATH`` Python puts nothing
    there."""
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = first
    elif sys.path and os.path.realpath(sys.path[0]) == _PACKAGES:
        del sys.path[0]


_PACKAGES = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))     # the folder holding probes/


def main(argv: Sequence[str] | None = None) -> int:
    opts, target = parse(sys.argv[1:] if argv is None else argv)
    # imports torch: after the arguments are known to be usable
    from . import autowatch

    sys.argv[:] = target[1:] if target[0] == "-m" else target     # run_module puts the module's file first
    try:
        aw = autowatch.install(opts.run_dir, every=opts.every, overhead=opts.overhead)
    except Exception as exc:          # the script runs anyway, unwatched
        print(f"modscope: not watching: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        aw = None
    status = 0
    interrupted: BaseException | None = None
    try:
        if target[0] == "-m":
            run_module(target[1])
        else:
            run_script(target[0])
    except SystemExit as exc:
        status = _exit_status(exc)
    except KeyboardInterrupt as exc:
        interrupted = exc
    except BaseException as exc:
        tb = _user_traceback(exc.__traceback__)
        if tb is None and isinstance(exc, ImportError) and target[0] == "-m":
            # runpy found no such module (no frame of the user's ran): python -m's own one line
            print(f"{sys.executable}: {exc}", file=sys.stderr)
        else:
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)     # the hook prints the exception's own
        status = 1
    finally:
        if aw is not None:
            aw.close()
    if interrupted is not None:
        tb = _user_traceback(interrupted.__traceback__)
        traceback.print_exception(type(interrupted), interrupted.with_traceback(tb), tb)
        sys.stderr.flush()
        # end as Python does after an uncaught KeyboardInterrupt: killed by SIGINT (status 130 in a shell)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
