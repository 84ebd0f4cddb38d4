"""Where the dashboard's files are, in a checkout and in an installed wheel.

In the checkout the static assets and the demo training live at the top of the repository
(``assets/``, ``examples/demo_train.py``); the wheel carries them inside the package
(``dashboard/assets``, ``dashboard/demo_train.py``: pyproject.toml's force-include). The
packaged location is looked at first, so an installed copy never reads a checkout's files."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE.parent          # the checkout's root (in a wheel: site-packages)


def assets_dir() -> Path:
    """The folder of the dashboard's CSS/JS (Dash's ``assets_folder``, the report's CSS)."""
    packaged = PACKAGE / "assets"
    return packaged if packaged.is_dir() else SOURCE_ROOT / "assets"


def demo_script() -> Path:
    """The demo training script that ``modscope demo`` (``python app.py``) runs."""
    packaged = PACKAGE / "demo_train.py"
    return packaged if packaged.is_file() else SOURCE_ROOT / "examples" / "demo_train.py"
