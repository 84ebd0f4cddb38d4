"""The Python processes ``modscope run`` starts: the training (``probes.launch.autorun``) and, with ``--serve``, the
dashboard (``dashboard.cli serve``).

``python -m probes.launch.autorun`` would put the working folder first on ``sys.path``: a user's ``argparse.py``, or a
``probes/`` or ``dashboard/`` package of their own in the folder they start from, would be imported instead of
modscope's (and of the standard library's). So each child is ``python -c BOOT ARGS``: ``-c`` puts the working
folder first too, but only after the interpreter started (``site`` and ``sitecustomize`` ran without it), and the
boot code replaces that entry with the folder that holds modscope's own packages before anything is imported.
The training child then gives that entry to the script as ``python script.py`` would (the script's folder;
``python -m``'s working folder for ``-m``: probes/launch/autorun.py), so the script sees the ``sys.path`` Python
gives it, and modscope's packages, imported by then, are the ones it runs with. The environment is passed unchanged:
no ``PYTHONPATH`` is added, and a token travels in ``MODSCOPE_TOKEN``, never on a command line (docs/security.md).

The run directory ``modscope run`` makes by default, ``./runs/<time>``, has a predictable name: it is created here
(:func:`new_run_dir`), never taken over when something (a link included) is already there.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from ..paths import SOURCE_ROOT

# sys.path[0] is the working folder ('') that -c put there, unless -P / PYTHONSAFEPATH left it out (3.11+)
_BOOT = ("import sys; sys.path[0:0 if getattr(sys.flags, 'safe_path', False) else 1] = [{root!r}]; "
         "from {module} import main; sys.exit(main())")


def python_command(module: str, args: list[str]) -> list[str]:
    """``[python, -c, BOOT, *args]``: ``module``'s ``main()`` run with modscope's own packages first on the path,
    ``sys.argv[1:] == args``."""
    return [sys.executable, "-c", _BOOT.format(root=str(SOURCE_ROOT), module=module), *args]


def new_run_dir(base: Path) -> Path:
    """A new ``base/<time>[-n]``, created by this call (an existing one, a link included, is never taken for it)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        d = base / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}/{stamp}-*: a thousand of them exist")
