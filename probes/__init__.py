"""modscope probes: live per-module statistics, structural audit and findings for PyTorch.

    import probes
    with probes.watch(model, optimizer) as w:      # writes under ./runs/<time>
        for x, y in data:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
            w.step(loss)                           # optional: records the loss
    print(*w.findings(), sep="\\n")

Then ``modscope serve --run runs/<time>`` shows it in the dashboard.

The package imports lazily: ``import probes.schema`` (the store's contract, which the dashboard reads)
needs neither torch nor anything else of probes.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = ["CODES", "Finding", "Watcher", "__version__", "audit", "begin_optimizer_step", "show", "watch"]

TORCH_HINT = ("modscope's probes need PyTorch (>= 2.4), which is not installed: pip install torch "
              "(the dashboard alone, `modscope serve`, needs no torch)")

# public name -> the submodule that defines it
_LAZY = {"watch": ".api", "audit": ".api", "begin_optimizer_step": ".api", "Watcher": ".watcher",
         "Finding": ".findings", "CODES": ".findings", "SCHEMA_VERSION": ".schema", "show": ".notebook"}
_TORCH_FREE = {"Finding", "CODES", "SCHEMA_VERSION"}


def _torch_missing() -> bool:
    if "torch" in sys.modules:
        return sys.modules["torch"] is None          # None: blocked on purpose
    try:
        return importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):
        return True


def _importing_a_submodule() -> bool:
    """True while Python imports this package only as the parent of a submodule (``import
    probes.schema``): then a missing torch is no error, since the submodule may not need it."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_find_and_load_unlocked" and code.co_filename.startswith("<frozen importlib"):
            name = frame.f_locals.get("name")
            if isinstance(name, str) and name.startswith(__name__ + "."):
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


if _torch_missing() and not _importing_a_submodule():
    raise ModuleNotFoundError(TORCH_HINT, name="torch")


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _TORCH_FREE and _torch_missing():
        raise ModuleNotFoundError(TORCH_HINT, name="torch")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .api import audit, begin_optimizer_step, watch
    from .findings.finding import CODES, Finding
    from .notebook import show
    from .watcher import Watcher
