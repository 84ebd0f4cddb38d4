"""The wheel built from this checkout, installed with ``pip install --target`` into a folder that
holds nothing else: the tests that use it run Python from another folder with only that folder on
``PYTHONPATH`` (torch, Dash and the rest come from the environment's site-packages), so nothing
of the checkout can be imported by accident."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Site:
    root: Path          # the --target folder: probes/, dashboard/, bin/modscope, the dist-info
    wheel: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return {**env, "PYTHONPATH": str(self.root), "PYTHONUNBUFFERED": "1", **extra}

    def modscope(self) -> list[str]:
        """The console script pip wrote (``bin/modscope``), else ``python -m dashboard.cli``."""
        script = self.root / "bin" / "modscope"
        return [str(script)] if script.exists() else [sys.executable, "-m", "dashboard.cli"]


def build_and_install(tmp: Path) -> Site:
    """``pip wheel`` of the checkout (no network: hatchling from the environment), then
    ``pip install --no-deps --target``."""
    wheel_dir, root = tmp / "wheel", tmp / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheel_dir), str(REPO)],
         tmp)
    (wheel,) = wheel_dir.glob("modscope-*.whl")
    _run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(root), str(wheel)], tmp)
    return Site(root, wheel)


def _run(cmd: list[str], cwd: Path) -> None:
    r = subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=300, check=False)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stdout}{r.stderr}")
