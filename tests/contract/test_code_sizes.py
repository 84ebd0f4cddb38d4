"""Sizes the code holds to: no source file over 600 lines, no class over 400 (ruff holds the functions: arguments,
statements and complexity, with the thresholds in pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("probes", "dashboard", "bench", "app.py")
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400


def source_files() -> list[Path]:
    out: list[Path] = []
    for name in SOURCES:
        path = REPO / name
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def oversized(path: Path, root: Path = REPO) -> list[str]:
    text = path.read_text()
    rel = path.relative_to(root)
    found = []
    lines = text.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{rel}: {lines} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_CLASS_LINES:
                found.append(f"{rel}: class {node.name} {length} lines")
    return found


def test_no_file_over_600_lines_and_no_class_over_400():
    files = source_files()
    assert len(files) > 50
    found = [line for path in files for line in oversized(path)]
    assert not found, "\n".join(found)


def test_the_size_check_sees_a_long_class_and_a_long_file(tmp_path):
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "y = 2\n" * (MAX_FILE_LINES - MAX_CLASS_LINES))
    assert oversized(big, tmp_path) == ["big.py: 601 lines", "big.py: class Big 401 lines"]
