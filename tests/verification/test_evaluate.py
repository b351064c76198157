"""Every evaluator rule, with plain values."""

import pytest

from tests.verification.test_serving_basis import HONEST_YARDSTICK
from verification.evaluate import (
    MISMATCH,
    NOT_MEASURED,
    OK,
    THRESHOLDS,
    WARNING,
    Evidence,
    Spec,
    evaluate,
    spec_for,
    verdict,
)

RTX_4090 = Spec("RTX 4090", 24, 1008, 165, 4, "8.9", 384, 128, ("NVIDIA GeForce RTX 4090",),
                450)
RTX_3090 = Spec("RTX 3090", 24, 936, 71, 4, "8.6", 384, 82, ("NVIDIA GeForce RTX 3090",), 350)
H200 = Spec("H200", 141, 4800, 989, 5, "9.0", 6144, 132, ("NVIDIA H200",), 700)
SPECS = [RTX_3090, RTX_4090, H200]


def honest_probe(**overrides):
    probe = {
        "facts": {"compute_capability_cuda": "8.9", "sm_count": 128,
                  "memory_bus_width_bits": 384, "theoretical_bandwidth_gbs": 1008.0,
                  "pcie_gen_max": 4, "pcie_width_max": 16, "power_limit_w": 450,
                  "power_default_limit_w": 450, "virtualization_mode": 0},
        "bandwidth": {"best_gbs": 920.0, "median_gbs": 910.0},
        "matmul": {"best_tflops": 150.0, "median_tflops": 148.0},
        "host_device": {"h2d_gbs": 24.5, "d2h_gbs": 24.8},
        "vram": {"free_bytes": int(23.6 * 2**30), "tested_bytes": int(21 * 2**30),
                 "pattern_ok": True},
    }
    for key, value in overrides.items():
        if key in probe["facts"]:
            probe["facts"][key] = value
        else:
            probe[key] = value
    return probe


def ev(**kwargs):
    base = dict(reported_name="NVIDIA GeForce RTX 4090", reported_memory_mib=24564,
                claimed_model="RTX 4090", claimed_vram_gb=24, probe=honest_probe(),
                supervised=True, yardstick=HONEST_YARDSTICK)
    base.update(kwargs)
    return Evidence(**base)


def by_metric(findings):
    return {f.metric: f for f in findings}


def test_an_honest_4090_has_no_mismatch_or_warning():
    findings = evaluate(ev(served_tps={1: 90, 32: 430}, reference_tps={1: 94, 32: 435}),
                        RTX_4090, SPECS)
    assert {f.severity for f in findings} == {OK}
    assert verdict(findings) == "verified"
    assert {"identity", "vram", "bandwidth", "compute", "pcie", "power", "serving"} <= set(
        by_metric(findings))


def test_identity_names_exactly_the_facts_it_compared():
    found = by_metric(evaluate(ev(), RTX_4090, SPECS))["identity"]
    assert "compute capability, SM count and memory bus width match" in found.message
    probe = honest_probe(sm_count=None, memory_bus_width_bits=None)
    found = by_metric(evaluate(ev(probe=probe), RTX_4090, SPECS))["identity"]
    assert found.severity == OK and "its compute capability matches" in found.message
    assert "SM" not in found.message and "bus" not in found.message


def test_identity_with_no_fact_to_compare_is_not_measured():
    probe = honest_probe(compute_capability_cuda=None, sm_count=None, memory_bus_width_bits=None)
    found = by_metric(evaluate(ev(probe=probe), RTX_4090, SPECS))["identity"]
    assert found.severity == NOT_MEASURED and found.measured == ""
    assert "the agent reported no compute capability, SM count or memory bus width" \
        in found.message


def test_identity_a_3090_reporting_itself_as_a_4090():
    probe = honest_probe(compute_capability_cuda="8.6", sm_count=82)
    found = by_metric(evaluate(ev(probe=probe), RTX_4090, SPECS))["identity"]
    assert found.severity == MISMATCH
    assert "compute capability 8.6 (expected 8.9)" in found.measured
    assert "SM count 82 (expected 128)" in found.measured
    assert "RTX 3090" in found.message


def test_identity_bus_width_alone_is_enough():
    found = by_metric(evaluate(ev(probe=honest_probe(memory_bus_width_bits=256)), RTX_4090,
                               SPECS))["identity"]
    assert found.severity == MISMATCH and "memory bus width 256" in found.measured


def test_identity_listing_claims_another_model():
    found = by_metric(evaluate(ev(claimed_model="H200"), RTX_4090, SPECS))["identity"]
    assert found.severity == MISMATCH


def test_a_card_missing_from_the_table_is_judged_by_measurement():
    findings = evaluate(ev(reported_name="NVIDIA Mystery 9000", claimed_model="",
                           served_tps={1: 90, 32: 430}, peer_tps={1: (91.0,), 32: (431.0,)}),
                        None, SPECS)
    found = by_metric(findings)
    assert found["identity"].severity == NOT_MEASURED
    assert "no reference spec" in found["identity"].message
    # bandwidth is judged against the card's own clock x bus width: 920 of 1008 is fine
    assert found["bandwidth"].severity == OK and "own memory clock" in found["bandwidth"].message
    assert verdict(findings) == "verified"
    # With no serving measured, its hardware alone is no verdict on what it serves.
    findings = evaluate(ev(reported_name="NVIDIA Mystery 9000", claimed_model=""), None, SPECS)
    assert verdict(findings) == "not_judged"


@pytest.mark.parametrize("free_gib, claimed_gb, reported_mib, severity", [
    (23.6, 24, 24564, OK),
    (22.0, 48, 49152, MISMATCH),  # NVML spoofed to 48 GB, the provider claims 48
    (22.0, 48, 24564, MISMATCH),  # honest NVML, inflated claim
    (20.0, None, 24564, MISMATCH),  # 81% of what NVML reports
])
def test_vram_below_claim(free_gib, claimed_gb, reported_mib, severity):
    probe = honest_probe(vram={"free_bytes": int(free_gib * 2**30), "pattern_ok": True})
    found = by_metric(evaluate(ev(probe=probe, claimed_vram_gb=claimed_gb,
                                  reported_memory_mib=reported_mib), RTX_4090, SPECS))["vram"]
    assert found.severity == severity


def test_vram_pattern_errors_are_a_mismatch():
    probe = honest_probe(vram={"free_bytes": int(23.6 * 2**30), "pattern_ok": False})
    assert by_metric(evaluate(ev(probe=probe), RTX_4090, SPECS))["vram"].severity == MISMATCH


@pytest.mark.parametrize("gbs, severity", [
    (1008 * 0.90, OK), (1008 * 0.85, OK), (1008 * 0.84, WARNING), (1008 * 0.75, WARNING),
    (1008 * 0.74, MISMATCH), (600, MISMATCH)])
def test_bandwidth_thresholds(gbs, severity):
    probe = honest_probe(bandwidth={"best_gbs": gbs})
    found = by_metric(evaluate(ev(probe=probe), RTX_4090, SPECS))["bandwidth"]
    assert found.severity == severity and found.expected == "1,008 GB/s"


def test_the_h200_read_a_correct_way_passes_and_the_consumer_method_fails():
    """FACTS.md: a method right on consumer cards read an H200 at 2,319 GB/s; a correct one
    reads ~4,110 (spec 4,800)."""
    h200 = dict(compute_capability_cuda="9.0", sm_count=132, memory_bus_width_bits=6144,
                pcie_gen_max=5)
    for gbs, severity in ((4110, OK), (2319, MISMATCH)):
        probe = honest_probe(bandwidth={"best_gbs": gbs}, matmul={"best_tflops": 700})
        probe["facts"].update(h200)
        found = by_metric(evaluate(ev(reported_name="NVIDIA H200", claimed_model="H200",
                                      claimed_vram_gb=141, reported_memory_mib=143771,
                                      probe=probe), H200, SPECS))
        assert found["bandwidth"].severity == severity


@pytest.mark.parametrize("tflops, severity", [(150, OK), (116, OK), (114, WARNING),
                                              (100, WARNING), (98, MISMATCH)])
def test_compute_thresholds(tflops, severity):
    probe = honest_probe(matmul={"best_tflops": tflops})
    assert by_metric(evaluate(ev(probe=probe), RTX_4090, SPECS))["compute"].severity == severity


def test_thresholds_live_in_one_place():
    assert THRESHOLDS["bandwidth"] == (0.75, 0.85) and THRESHOLDS["compute"] == (0.60, 0.70)


def test_a_real_h200_at_600_tflops_is_not_flagged():
    """A real H200 reaches >= 600 TFLOPS BF16 (61% of 989): it must pass."""
    probe = honest_probe(matmul={"best_tflops": 702}, bandwidth={"best_gbs": 4110})
    probe["facts"].update(compute_capability_cuda="9.0", sm_count=132,
                          memory_bus_width_bits=6144, pcie_gen_max=5)
    found = by_metric(evaluate(ev(reported_name="NVIDIA H200", claimed_model="H200",
                                  claimed_vram_gb=141, reported_memory_mib=143771,
                                  probe=probe), H200, SPECS))
    assert found["compute"].severity == OK


@pytest.mark.parametrize("gen, width, h2d, severity", [
    (4, 16, 24.5, OK), (3, 16, 12.0, WARNING), (4, 8, 12.0, WARNING), (3, 1, 0.8, MISMATCH),
    (4, 16, 3.0, MISMATCH)])
def test_pcie_link(gen, width, h2d, severity):
    probe = honest_probe(pcie_gen_max=gen, pcie_width_max=width,
                         host_device={"h2d_gbs": h2d, "d2h_gbs": h2d})
    assert by_metric(evaluate(ev(probe=probe), RTX_4090, SPECS))["pcie"].severity == severity


@pytest.mark.parametrize("limit, severity", [(450, OK), (400, WARNING), (350, WARNING),
                                             (330, MISMATCH), (250, MISMATCH)])
def test_power_limit_below_default(limit, severity):
    found = by_metric(evaluate(ev(probe=honest_probe(power_limit_w=limit)), RTX_4090, SPECS))
    assert found["power"].severity == severity and found["power"].measured == f"{limit} W"


def test_power_is_judged_against_the_spec_not_the_machines_own_default():
    """An H200 capped at 300 W that calls 300 W its default is still capped (spec: 700 W)."""
    probe = honest_probe(power_limit_w=300, power_default_limit_w=300)
    found = by_metric(evaluate(ev(reported_name="NVIDIA H200", probe=probe), H200, SPECS))
    assert found["power"].severity == MISMATCH and found["power"].expected == "700 W"
    assert "calls 300 W its default" in found["power"].message


def test_power_limit_unreported_is_not_measured():
    found = by_metric(evaluate(ev(probe=honest_probe(power_limit_w=None)), RTX_4090, SPECS))
    assert found["power"].severity == NOT_MEASURED


def test_wsl_and_virtualisation_are_warnings():
    assert by_metric(evaluate(ev(wsl=True), RTX_4090, SPECS))["virtualisation"].severity \
        == WARNING
    found = by_metric(evaluate(ev(probe=honest_probe(virtualization_mode=2)), RTX_4090, SPECS))
    assert found["virtualisation"].severity == WARNING and "vGPU" in found["virtualisation"].message


def test_a_uuid_seen_on_another_node_is_a_mismatch():
    found = by_metric(evaluate(ev(other_nodes_with_uuid=(7,)), RTX_4090, SPECS))["uuid"]
    assert found.severity == MISMATCH and "#7" in found.message


@pytest.mark.parametrize("served, severity", [(435, OK), (340, WARNING), (226, MISMATCH)])
def test_serving_far_below_what_the_hardware_predicts(served, severity):
    """The WSL2 case: hardware probes fine, serving 48% slower (435 -> 226 tok/s at 32)."""
    found = by_metric(evaluate(ev(served_tps={1: 90, 8: 300, 32: served},
                                  reference_tps={1: 94, 32: 435}), RTX_4090, SPECS))["serving"]
    assert found.severity == severity and "@32" in found.measured
    assert found.basis == "reference"


def test_serving_with_no_basis_says_so_and_is_never_ok():
    found = by_metric(evaluate(ev(served_tps={32: 10}), RTX_4090, SPECS))["serving"]
    assert found.severity == NOT_MEASURED and found.basis == "none"
    assert found.expected == "no basis" and "not judged" in found.message
    assert found.measured == "10 tok/s @32"


def test_prefix_cache_and_context_checks():
    found = by_metric(evaluate(ev(prefix_cache_speedup=4.5, context_accepted=True), RTX_4090,
                               SPECS))
    assert found["prefix_cache"].severity == OK and found["context"].severity == OK
    found = by_metric(evaluate(ev(prefix_cache_speedup=1.1, context_accepted=False), RTX_4090,
                               SPECS))
    assert found["prefix_cache"].severity == WARNING and found["context"].severity == MISMATCH


def test_missing_measurements_are_said_not_flagged_and_not_passed():
    findings = evaluate(ev(probe=None, probe_note="the machine did not answer its probe job"),
                        RTX_4090, SPECS)
    found = by_metric(findings)
    for metric in ("identity", "vram", "bandwidth", "compute"):
        assert found[metric].severity == NOT_MEASURED, metric
    assert found["bandwidth"].measured == ""
    assert "did not answer its probe job" in found["bandwidth"].message
    assert verdict(findings) == "unverified"


def test_serving_alone_is_serving_verified_never_plain_verified():
    findings = evaluate(ev(probe=None, served_tps={1: 90, 32: 430},
                           reference_tps={1: 94, 32: 435}), RTX_4090, SPECS)
    assert verdict(findings) == "serving_verified"


def test_spec_lookup_by_nvml_name():
    assert spec_for("NVIDIA GeForce RTX 4090", SPECS) is RTX_4090
    assert spec_for("RTX 3090", SPECS) is RTX_3090
    assert spec_for("NVIDIA B200", SPECS) is None


def test_every_finding_says_something_to_a_renter():
    probe = honest_probe(compute_capability_cuda="8.6", sm_count=82, power_limit_w=200,
                         bandwidth={"best_gbs": 500}, matmul={"best_tflops": 60})
    for finding in evaluate(ev(probe=probe, wsl=True, other_nodes_with_uuid=(3,)), RTX_4090,
                            SPECS):
        assert finding.severity in (OK, WARNING, MISMATCH, NOT_MEASURED)
        assert len(finding.message) > 20 and finding.message.endswith(".")
