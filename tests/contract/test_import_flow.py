"""Imports inside ``probes`` run one way: from the launchers down to the contract, never back up.

    launch, integrations  ->  api, watcher, notebook  ->  findings  ->  capture  ->  model  ->  store  ->  schema

A module may import its own layer and the layers below it; imports only a type checker reads (under
``TYPE_CHECKING``) do not count. The dashboard reads ``probes.schema`` only (tested with the wheel in
tests/packaging)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "probes"

LAYERS = {
    "launch": 6, "integrations": 6,
    "api": 5, "watcher": 5, "notebook": 5, "limits": 5, "checkpoint_file": 5,
    "findings": 4,
    "capture": 3,
    "model": 2,
    "store": 1,
    "schema": 0, "store_copy": 0, "paths": 0, "writer_status": 0, "state_dict_keys": 0, "_compat": 0, "_version": 0,
    "__init__": 7,
}


def layer_of(module: str) -> int:
    """The layer of ``probes.<top>...``."""
    top = module.split(".")[1] if "." in module else "__init__"
    return LAYERS[top]


def runtime_imports(path: Path, module: str) -> list[str]:
    """The probes modules ``path`` imports at run time (absolute names)."""
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for child in node.body for n in ast.walk(child))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            out += [n for n in names if n.startswith("probes.")]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("probes.")]
    return out


def test_probes_imports_run_one_way():
    against = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if module == "probes":
            continue
        own = layer_of(module)
        for target in runtime_imports(path, module):
            if target.split(".")[1] not in LAYERS:
                against.append(f"{module} -> {target}: not in a known layer")
            elif layer_of(target) > own:
                against.append(f"{module} -> {target}")
    assert not against, "imports against the flow:\n" + "\n".join(against)


def test_the_check_sees_an_import_against_the_flow(tmp_path):
    """The check itself: a model module importing a finding is caught."""
    bad = tmp_path / "probes" / "model" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ..findings.finding import Finding\n")
    assert runtime_imports(bad, "probes.model.bad") == ["probes.findings.finding"]
    assert layer_of("probes.findings.finding") > layer_of("probes.model.bad")
