"""The frameworks are optional: ``import probes`` (and ``probes.integrations``) imports none of them, and an
integration whose framework is missing says how to install it, in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = '''
import json, sys
FRAMEWORKS = ["lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate"]
blocked = sys.argv[1:]
for name in blocked:
    sys.modules[name] = None          # as if not installed
import probes, probes.api, probes.integrations
out = {"imported": sorted(m for m in FRAMEWORKS if m in sys.modules and sys.modules[m] is not None), "errors": {}}
for name in ("lightning", "transformers", "accelerate") if blocked else ():
    try:
        __import__("probes.integrations." + name)
        out["errors"][name] = None
    except ImportError as exc:
        out["errors"][name] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
'''


def probe(*blocked: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, *blocked], cwd=str(REPO), capture_output=True, text=True,
                       timeout=120, check=False, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_probes_imports_no_framework():
    out = probe()
    assert out["imported"] == []


def test_a_missing_framework_gives_a_one_line_install_hint():
    out = probe("lightning", "pytorch_lightning", "transformers", "accelerate")
    hint = "modscope's {} needs {} (pip install 'modscope[{}]')"
    assert out["errors"] == {
        "lightning": ["ImportError", hint.format("Lightning callback", "lightning", "lightning")],
        "transformers": ["ImportError", hint.format("Trainer callback", "transformers", "transformers")],
        "accelerate": ["ImportError", hint.format("accelerate helper", "accelerate", "accelerate")],
    }
