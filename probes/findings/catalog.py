"""``docs/findings.md``, made from the rules: every finding code, what it means, an example, its fix and its causes.

    python -m probes.findings.catalog            # writes docs/findings.md
    python -m probes.findings.catalog --check    # exit 1 when docs/findings.md is out of date

A test runs the check, so the page cannot drift from the rules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .rules import RULES, Rule

DOC = Path(__file__).resolve().parents[2] / "docs" / "findings.md"

INTRO = """\
# Findings

Generated from the rules in `probes/findings/rules/` by `python -m probes.findings.catalog`: do not edit by hand.

Every finding has a code, a severity, a path and a message with its evidence and fix. A *state* finding holds while
the evidence shows it and is resolved when it no longer does; an *event* finding is about something that happened:
it stays, with its first and last step and how often it happened, until there is evidence of the fix (or to the end
of the run). A finding that another one explains names it as its **cause** (the layers of a plain list do not update
*because* they are unregistered): the dashboard, `modscope findings` and the report fold consequences under their
root cause, and count root causes.

Paths: registered things by PyTorch's name (`encoder.blocks.0.weight`, `""` for the root); unregistered things by
the Python path from the root (`encoder.blocks[0]`, `adapters['a']`, `gate`, `helper.proj`); modules found only at
run time (a closure, a global, built inside forward) as `encoder.<unreachable Linear>`.

Definitions the rules share:
- **Units** are channels (dim 1) of conv-like outputs (4-D/5-D, or 3-D from Conv1d/BatchNorm1d/pooling), else the
  last dimension. A unit is **active** in a sample when any of its values is non-zero. Units are tracked up to
  65,536 per output (a larger output gets every statistic but the dead fraction).
- The **window** is the last `window` sampled steps (default 16). A unit is dead when it was not active in any call
  of the window; `dead-layer` and `dead-units` need at least 3 calls of the module within the window, and a call in
  each of its sampled steps or 64 values per unit over it (a constant output needs neither).
- **Saturated**: Tanh/Hardtanh/Softsign outputs with |x| > 0.99; Sigmoid/Hardsigmoid outputs below 0.01 or above
  0.99; flagged when more than half of the values sit there, averaged over the last 3 samples.

| code | default severity | reads |
|---|---|---|
"""


def _explained_by(rule: type[Rule]) -> list[str]:
    return [f"`{other.code}` {link.relation}" + (f" (of kind {', '.join(sorted(link.root_kinds))})"
                                                 if link.root_kinds else "")
            for other in RULES for link in other.explains if link.code == rule.code]


def section(rule: type[Rule]) -> str:
    info = rule.info()
    lines = [f"## `{rule.code}`", "",
             f"Badge **{info.label}**; {'an event' if info.event else 'a state'} finding. Severity: "
             f"{rule.severities}.", "",
             f"**When:** {rule.meaning}.", "",
             f"**Reads:** {rule.reads}.", "",
             "**Example:**", "", "```python", rule.example, "```", "",
             f"**Fix:** {info.fix}", ""]
    explains = [f"`{link.code}` {link.relation}" + (f" (when it is of kind {', '.join(sorted(link.root_kinds))})"
                                                     if link.root_kinds else "") for link in rule.explains]
    if explains:
        lines += ["**Explains:** " + "; ".join(explains) + ".", ""]
    by = _explained_by(rule)
    if by:
        lines += ["**Explained by:** " + "; ".join(by) + ".", ""]
    return "\n".join(lines)


def markdown() -> str:
    table = "".join(f"| [`{r.code}`](#{r.code}) | {r.info().severity} | {r.reads.name.lower().replace('_', ' ')} |\n"
                    for r in RULES)
    return INTRO + table + "\n" + "\n".join(section(r) for r in RULES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m probes.findings.catalog", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/findings.md is out of date")
    args = p.parse_args(argv)
    text = markdown()
    if args.check:
        current = DOC.read_text() if DOC.is_file() else ""
        if current != text:
            print(f"{DOC} is out of date: run python -m probes.findings.catalog", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
