"""Two runs side by side: the before / after table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from probes.schema import (
    ModuleKind,
    Severity,
    normalize_path,
)

from .causes import fold_causes, root_counts
from .connection import MAX_COMPARE_MODULES, Row, severity_rank
from .store import Store

_STAT_KEYS = ("mean", "std", "dead_frac", "sat_frac", "out_grad_norm")


def _codes(findings: list[Row]) -> list[Row]:
    """Distinct finding codes of one module, worst severity first: [{"code", "severity"}]."""
    seen: dict[str, str] = {}
    for f in findings:
        seen.setdefault(f["code"], f["severity"])
    return sorted(({"code": c, "severity": v} for c, v in seen.items()),
                  key=lambda d: (severity_rank(d["severity"]), d["code"]))


def _finding_order(f: Mapping[str, Any]) -> tuple[int, str, str]:
    return severity_rank(f["severity"]), f["path"], f["code"]


def compare_stores(a: Store, b: Store, rank: int = 0, limit: int = MAX_COMPARE_MODULES, *,
                   rank_b: int | None = None, findings_a: Sequence[Row] | None = None,
                   findings_b: Sequence[Row] | None = None) -> Row:
    """The "before / after" table of two stores: summary, findings appeared/resolved,
    checkpoint keys added/removed, and per-module statistics then (a) and now (b).
    Modules are matched by normalised path (``blocks[0]`` ~ ``blocks.0``). ``rank`` of ``a`` is
    compared with ``rank_b`` (default: the same rank) of ``b``; ``findings_a``/``findings_b`` replace
    each side's own active findings (a run's findings merged over its ranks: dashboard.read.run)."""
    rb = rank if rank_b is None else rank_b
    ova, ovb = a.overview(rank), b.overview(rb)
    fa_list = list(findings_a) if findings_a is not None else a.findings(rank, active=True)
    fb_list = list(findings_b) if findings_b is not None else b.findings(rb, active=True)

    sev_a, sev_b = root_counts(fold_causes(fa_list)), root_counts(fold_causes(fb_list))

    def summary_row(label: str, va: Any, vb: Any) -> Row:
        return {"metric": label, "a": va, "b": vb, "changed": va != vb}

    unregistered = (ModuleKind.UNREGISTERED, ModuleKind.RUNTIME)
    keys_a, keys_b = set(a.state_dict_keys(rank)), set(b.state_dict_keys(rb))
    summary = [
        summary_row("model class", ova["model_class"], ovb["model_class"]),
        summary_row("registered modules", ova["modules"][ModuleKind.REGISTERED],
                    ovb["modules"][ModuleKind.REGISTERED]),
        summary_row("unregistered modules", sum(ova["modules"][k] for k in unregistered),
                    sum(ovb["modules"][k] for k in unregistered)),
        summary_row("parameters (registered)", ova["params"].get("total", 0), ovb["params"].get("total", 0)),
        summary_row("trainable", ova["params"].get("trainable", 0), ovb["params"].get("trainable", 0)),
        summary_row("held by optimizer", ova["params"].get("in_optimizer", 0),
                    ovb["params"].get("in_optimizer", 0)),
        summary_row("checkpoint keys", len(keys_a), len(keys_b)),
        # root causes, as the Overview, the Findings tab and the report count them
        summary_row("errors", sev_a[Severity.ERROR], sev_b[Severity.ERROR]),
        summary_row("warnings", sev_a[Severity.WARNING], sev_b[Severity.WARNING]),
        summary_row("last step", ova["step"], ovb["step"]),
        summary_row("final loss", a.final_loss(rank), b.final_loss(rb)),
    ]

    fa = {(f["code"], normalize_path(f["path"])): f for f in fa_list}
    fb = {(f["code"], normalize_path(f["path"])): f for f in fb_list}
    appeared = [fb[k] for k in fb if k not in fa]
    resolved = [fa[k] for k in fa if k not in fb]
    persisting = [fb[k] for k in fb if k in fa]

    mods_a = {normalize_path(m["path"]): m for m in a.all_modules(rank, limit)}
    mods_b = {normalize_path(m["path"]): m for m in b.all_modules(rb, limit)}
    stats_a, stats_b = a.latest_module_stats(rank, limit), b.latest_module_stats(rb, limit)
    codes_a = a.findings_for_modules(rank, [m["module_id"] for m in mods_a.values()])
    codes_b = b.findings_for_modules(rb, [m["module_id"] for m in mods_b.values()])

    order = list(mods_b.keys()) + [k for k in mods_a if k not in mods_b]
    modules = []
    for key in order:
        ma, mb = mods_a.get(key), mods_b.get(key)
        sa = stats_a.get(ma["module_id"], {}) if ma else {}
        sb = stats_b.get(mb["module_id"], {}) if mb else {}
        ca = _codes(codes_a.get(ma["module_id"], [])) if ma else []
        cb = _codes(codes_b.get(mb["module_id"], [])) if mb else []
        either = mb if mb is not None else ma
        row: Row = {
            "key": key,
            "path_a": ma["path"] if ma else None, "path_b": mb["path"] if mb else None,
            "type": either["type"] if either else None,
            "kind_a": ma["kind"] if ma else None, "kind_b": mb["kind"] if mb else None,
            "params_a": ma["params_total"] if ma else None, "params_b": mb["params_total"] if mb else None,
            "in_opt_a": ma["params_in_optimizer"] if ma else None,
            "in_opt_b": mb["params_in_optimizer"] if mb else None,
            "codes_a": ca, "codes_b": cb,
        }
        for k in _STAT_KEYS:
            row[f"{k}_a"] = sa.get(k)
            row[f"{k}_b"] = sb.get(k)
        row["changed"] = (row["kind_a"] != row["kind_b"] or row["params_a"] != row["params_b"]
                          or row["in_opt_a"] != row["in_opt_b"] or ca != cb)
        modules.append(row)

    return {
        "a": {"path": ova["path"], "run_name": ova["run_name"]},
        "b": {"path": ovb["path"], "run_name": ovb["run_name"]},
        "summary": summary,
        "findings_appeared": sorted(appeared, key=_finding_order),
        "findings_resolved": sorted(resolved, key=_finding_order),
        "findings_persisting": sorted(persisting, key=_finding_order),
        "keys_added": sorted(keys_b - keys_a),
        "keys_removed": sorted(keys_a - keys_b),
        "keys_common": len(keys_a & keys_b),
        "modules": modules,
    }


