"""Reads for the rent page's verification panel and the REST API."""

from billing import charts
from verification import evaluate as ev
from verification.models import (
    Finding,
    GpuSpec,
    Measurement,
    VerificationRun,
    VerifiedCapacity,
)

_ORDER = ("mismatch", "warning", "ok", "not_measured")
# What the plot's circles stand for, by the serving finding's basis.
_EXPECTED = {"peers": ("peers", "the median of its fleet peers"),
             "reference": ("reference", "the published figure for this hardware"),
             "calibrated": ("calibrated", "the prediction for its hardware, calibrated on its "
                                          "yardstick"),
             "prediction": ("predicted", "the first-principles prediction for its hardware"),
             "floor": ("floor", "the first-principles floor for its hardware")}
# The bases a judgment can stand on, in the order they are tried, as the rent page names them.
BASES = (("peers", "Fleet peers"), ("reference", "Published"), ("calibrated", "Calibrated"),
         ("predicted", "Predicted"), ("floor", "Floor"))


def card_panel(card, user) -> dict:
    runs = list(VerificationRun.objects.filter(node_id=card.node_id)[:10])
    active = next((r for r in runs if r.is_active), None)
    done = next((r for r in runs if r.status == VerificationRun.Status.DONE), None)
    spec = next((s for s in GpuSpec.objects.all() if card.name in s.nvml_names), None)
    panel = {"card": card, "active": active, "done": done, "runs": runs, "spec": spec,
             "is_owner": user.is_authenticated and card.node.owner_id == user.pk}
    if done is None:
        return panel
    findings = list(Finding.objects.filter(run=done, card=card))
    severity = {f.metric: f.severity for f in findings}
    mine = {m.metric: m for m in done.measurements.filter(card=card)}
    engine = {m.metric: m for m in done.measurements.filter(card__isnull=True)}

    def value(metric):
        return mine[metric].value if metric in mine else None

    panel["findings"] = sorted(findings, key=lambda f: _ORDER.index(f.severity)
                               if f.severity in _ORDER else len(_ORDER))
    panel["hardware_chart"] = charts.measured_vs_spec([
        ("Memory bandwidth", value("bandwidth_gbs"), spec.bandwidth_gbs if spec else None,
         "GB/s", severity.get("bandwidth", "not_measured")),
        ("BF16 matmul", value("bf16_tflops"), spec.bf16_tflops if spec else None, "TFLOPS",
         severity.get("compute", "not_measured")),
        ("Host to device", value("h2d_gbs"), None, "GB/s", severity.get("pcie", "not_measured")),
    ])
    served = {int(k.split("@")[1]): m.value for k, m in engine.items() if k.startswith("tps@")}
    serving = next((f for f in findings if f.metric == "serving"), None)
    key, label = _EXPECTED.get(serving.basis if serving else "", ("", ""))
    levels = (serving.details or {}).get("levels", {}) if serving else {}
    expected = {int(level): row[key] for level, row in levels.items() if key and key in row}
    panel["serving_chart"] = charts.tokens_vs_concurrency(served, expected, label)
    panel["bases"] = [judged_against(f) for f in findings if f.metric in ("serving", "yardstick")
                      and (f.details or {}).get("levels")]
    # Serving is measured on the machine's engine, which may span all its cards; a card's
    # verified capacity is its share of that.
    panel["machine_cards"] = getattr(card, "cards_per_node", None) or 1
    panel["machine_tps_at_32"] = served.get(32)
    panel["ttft"] = sorted((int(k.split("@")[1]), m.value) for k, m in engine.items()
                           if k.startswith("ttft_p50@"))
    panel["verdict"] = ev.verdict(findings)
    return panel


def judged_against(finding) -> dict:
    """Every basis of a serving or yardstick finding at each concurrency, the one it was
    judged against marked: the rent page's table."""
    levels = finding.details.get("levels") or {}
    shown = [(key, name) for key, name in BASES
             if any(key in row for row in levels.values())]
    basis_key = _EXPECTED.get(finding.basis, ("", ""))[0]
    rows = [{"level": int(level), "measured": row.get("measured"),
             "cells": [(row.get(key), key == basis_key) for key, _ in shown]}
            for level, row in sorted(levels.items(), key=lambda item: int(item[0]))]
    return {"metric": finding.metric, "severity": finding.severity, "basis": finding.basis,
            "columns": [name for _, name in shown], "rows": rows}


def verified_speeds(node_ids) -> dict[tuple[int, str], dict[int, float]]:
    """{(node, model): {concurrency: output tokens/s}} of the run each node's verified capacity
    comes from: what its served traffic is compared with (routing/drift.py)."""
    runs = {}
    for node_id, model, run_id in (VerifiedCapacity.objects.filter(card__node_id__in=node_ids)
                                   .values_list("card__node_id", "model", "run_id")):
        runs[(node_id, model)] = run_id
    levels: dict[int, dict[int, float]] = {}
    for run_id, metric, value in Measurement.objects.filter(
            run_id__in=set(runs.values()), card__isnull=True,
            metric__startswith="tps@").values_list("run_id", "metric", "value"):
        level = metric.removeprefix("tps@")
        if level.isdigit() and value:
            levels.setdefault(run_id, {})[int(level)] = value
    return {key: levels[run_id] for key, run_id in runs.items() if run_id in levels}
