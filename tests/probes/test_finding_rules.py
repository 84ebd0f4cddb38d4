"""The finding rules: one rule per code, the generated findings page, and causes read from the rules' data."""

import subprocess
import sys

from probes.findings import catalog
from probes.findings.causes import assign_causes
from probes.findings.finding import Seen
from probes.findings.rules import RULES, DeadLayer, DeadUnits, TrainingModeMismatch, TrainStepInEvalMode, rule_for
from probes.schema import CODES, FindingCode


def test_every_finding_code_has_exactly_one_rule():
    codes = [rule.code for rule in RULES]
    assert sorted(codes) == sorted(FindingCode) and len(set(codes)) == len(codes)
    for code in FindingCode:
        rule = rule_for(code)
        assert rule.info() is CODES[code]
        assert rule.meaning and rule.example and rule.severities


def test_the_findings_page_is_generated_from_the_rules():
    text = catalog.markdown()
    for rule in RULES:
        assert f"## `{rule.code}`" in text and rule.example in text and CODES[rule.code].fix in text
    r = subprocess.run([sys.executable, "-m", "probes.findings.catalog", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_check_fails_when_the_page_is_out_of_date(tmp_path, monkeypatch):
    stale = tmp_path / "findings.md"
    stale.write_text(catalog.markdown().replace("dead-units", "dead-unit", 1))
    monkeypatch.setattr(catalog, "DOC", stale)
    assert catalog.main(["--check"]) == 1
    assert catalog.main([]) == 0 and catalog.main(["--check"]) == 0


def test_causes_follow_the_relations_the_rules_declare():
    first = DeadLayer.build("stem.act", "ReLU", 1.0, 16, {}, 5)
    later = DeadUnits.build("body.act", "ReLU", 0.5, 16, {}, 5, dead_input=("body.fc", "stem.act"))
    seen = Seen(5, first_step=1, count=3)
    left = TrainingModeMismatch.mismatch("encoder", "Encoder", False, True, seen, registered=True)
    set_train = TrainingModeMismatch.mismatch("decoder", "Decoder", True, False, seen, registered=True)
    step_eval = TrainStepInEvalMode.build(["encoder.drop", "encoder.bn"], 1, 5, 3)
    step_eval_outside = TrainStepInEvalMode.build(["decoder.drop"], 1, 5, 3)
    out = {(f.code, f.path, tuple(f.members)): f.cause for f in assign_causes(
        [first, later, left, set_train, step_eval, step_eval_outside])}
    assert out[("dead-units", "body.act", ())] == ("dead-layer", "stem.act")
    assert out[("dead-layer", "stem.act", ())] is None
    assert out[("train-step-in-eval-mode", "", ("encoder.drop", "encoder.bn"))] == ("training-mode-mismatch", "encoder")
    # a part put in training mode on its own is not the kind that explains a step trained in eval mode
    assert out[("train-step-in-eval-mode", "", ("decoder.drop",))] is None
