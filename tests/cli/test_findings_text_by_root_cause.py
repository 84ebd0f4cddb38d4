"""``modscope findings`` as text: one block per root cause, the findings it explains one line each under
it (a plain list of three layers made 39 blocks, 155 lines, for 3 root causes), and a consequence whose
cause is no longer active keeps its own block."""

from __future__ import annotations

from dashboard.commands.findings import format_text


def finding(code, severity, path, cause=None, run="r1", first=0, last=8):
    return {"code": code, "severity": severity, "path": path, "message": f"{code} message", "fix": f"{code} fix",
            "ranks": [0], "steps": {"first": first, "last": last, "count": 3},
            "cause": {"code": cause[0], "path": cause[1]} if cause else None, "run": run}


def test_consequences_are_lines_under_their_cause():
    cause = ("unregistered-module", "blocks[0]")
    found = [finding("not-updating", "error", "blocks[0].weight", cause, first=1),
             finding("unregistered-module", "error", "blocks[0]"),
             finding("grad-accumulating", "warning", "blocks[0].weight", cause, first=2),
             finding("not-updating", "error", "gate", ("unregistered-tensor", "gate"))]   # its cause resolved
    assert format_text(found, "runs/x").splitlines() == [
        "runs/x: 2 root causes (2 errors) and 2 consequences",
        "error   unregistered-module  blocks[0]  (rank 0, steps 0-8)",
        "        unregistered-module message",
        "        fix: unregistered-module fix",
        "        explains: error not-updating  blocks[0].weight  (steps 1-8)",
        "        explains: warning grad-accumulating  blocks[0].weight  (steps 2-8)",
        "error   not-updating  gate  (rank 0, steps 0-8)",
        "        not-updating message",
        "        caused by: unregistered-tensor at gate",
        "        fix: not-updating fix",
    ]


def test_a_cause_in_another_run_explains_nothing_here():
    found = [finding("unregistered-module", "error", "blocks[0]", run="r1"),
             finding("not-updating", "error", "blocks[0].weight", ("unregistered-module", "blocks[0]"), run="r2")]
    text = format_text(found, "runs/x")
    assert "explains" not in text and "caused by: unregistered-module at blocks[0]" in text
    assert text.splitlines()[0] == "runs/x: 2 root causes (2 errors) in 2 runs"
