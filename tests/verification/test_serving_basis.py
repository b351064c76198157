"""The serving expectation, basis by basis, with plain values: peers only, first principles
only, the reference table only, none; and how they combine."""

import pytest

from verification.evaluate import (
    MISMATCH,
    NOT_MEASURED,
    OK,
    WARNING,
    Evidence,
    Floor,
    Spec,
    evaluate,
    verdict,
)

PRO_6000 = Spec("RTX PRO 6000 Blackwell", 96, 1792, None, 5, "12.0", 512, 188,
                ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition",), 600)
M4_MAX = Spec("Apple M4 Max", 128, 546, None, None, "", None, None, ("Apple M4 Max",))
SPECS = [PRO_6000, M4_MAX]
# The first-principles prediction for an RTX PRO 6000 serving the 27B at 8-bit (predict.py).
PREDICTED = {1: Floor(expected=105.2, floor=48.0), 32: Floor(expected=1341.0, floor=644.0)}


def serving(**kwargs):
    base = dict(reported_name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                reported_memory_mib=98304, peer_label="RTX PRO 6000 Blackwell")
    findings = evaluate(Evidence(**(base | kwargs)), PRO_6000, SPECS)
    return next(f for f in findings if f.metric == "serving")


@pytest.mark.parametrize("basis_kwargs, basis", [
    (dict(peer_tps={1: (104.0,), 32: (1248.0,)}), "peers"),
    (dict(reference_tps={1: 106, 32: 1342}), "reference"),
    (dict(predicted=PREDICTED), "prediction"),
])
@pytest.mark.parametrize("served, severity", [
    ({1: 104, 32: 1290}, OK),
    ({1: 30, 32: 380}, MISMATCH),  # under a third of the honest card, at every level
])
def test_each_basis_alone(basis_kwargs, basis, served, severity):
    found = serving(served_tps=served, **basis_kwargs)
    assert found.basis == basis and found.severity == severity
    assert basis in found.expected


def test_no_basis_at_all_is_said_and_never_ok():
    found = serving(served_tps={1: 36, 32: 427})
    assert found.severity == NOT_MEASURED and found.basis == "none"
    assert "no basis" in found.message


def test_the_finding_names_its_peers():
    found = serving(served_tps={1: 36, 32: 427},
                    peer_tps={1: (104.0, 106.0, 101.0), 32: (1248.0, 1300.0, 1190.0)})
    assert found.severity == MISMATCH
    assert "1,248 tok/s by 3 RTX PRO 6000 Blackwell peers on this model" in found.message
    assert found.details["peers"] == 3 and found.details["basis"] == "peers"


def test_peers_of_several_cards_are_named_as_machines():
    found = serving(served_tps={32: 224}, peer_tps={32: (434.0,)}, peer_label="2x RTX 4090")
    assert "434 tok/s by 1 peer with 2x RTX 4090 on this model" in found.message


def test_peers_are_preferred_to_the_table_and_the_prediction():
    """The WSL2 pair: its own peers serve 422 at 32; the reference says 435, the floor far
    less. The peers are the closest evidence."""
    found = serving(served_tps={1: 48, 32: 224}, peer_tps={1: (93.0,), 32: (422.0,)},
                    reference_tps={1: 94, 32: 435}, predicted=PREDICTED)
    assert found.basis == "peers" and found.severity == MISMATCH


def test_a_slow_majority_of_peers_is_set_aside():
    """Three peers all at a third of the published figure do not make a fourth look normal."""
    slow = (440.0, 430.0, 425.0)
    found = serving(served_tps={1: 36, 32: 427}, peer_tps={32: slow},
                    reference_tps={1: 106, 32: 1342})
    assert found.basis == "reference" and found.severity == MISMATCH
    assert "not used as a yardstick" in found.message


def test_a_slow_majority_is_set_aside_against_the_first_principles_floor_too():
    found = serving(served_tps={1: 30, 32: 150}, peer_tps={1: (31.0, 30.0, 29.0)},
                    predicted=PREDICTED)
    assert found.basis == "prediction" and found.severity == MISMATCH


def test_one_fast_peer_cannot_raise_the_bar_above_the_reference():
    """A lone peer serving a small model under a big model's name must not flag honest cards."""
    found = serving(served_tps={1: 104, 32: 1300}, peer_tps={1: (400.0,), 32: (5000.0,)},
                    reference_tps={1: 106, 32: 1342})
    assert found.basis == "peers" and found.severity == OK


def test_three_peers_stand_on_their_own():
    """Three peers at 1,500 are not capped by the 1,342 reference: 1,000 is 67% of them."""
    found = serving(served_tps={32: 1000}, peer_tps={32: (1500.0, 1480.0, 1520.0)},
                    reference_tps={32: 1342})
    assert found.severity == MISMATCH and found.basis == "peers"
    # One peer at 1,500 is capped by the reference: 1,000 is 75% of 1,342.
    found = serving(served_tps={32: 1000}, peer_tps={32: (1500.0,)}, reference_tps={32: 1342})
    assert found.severity == WARNING and found.basis == "peers"


def test_the_robust_median_ignores_one_outlier_peer():
    found = serving(served_tps={32: 1250}, peer_tps={32: (1248.0, 1300.0, 9000.0)})
    assert found.severity == OK


def test_the_worst_level_decides():
    """Normal alone, a third under load: capacity is what routing and renters buy."""
    found = serving(served_tps={1: 105, 32: 427}, reference_tps={1: 106, 32: 1342})
    assert found.severity == MISMATCH and "@32" in found.measured


def test_the_plot_gets_every_basis_per_level():
    found = serving(served_tps={1: 104, 8: 700, 32: 1290}, peer_tps={32: (1248.0,)},
                    reference_tps={1: 106, 32: 1342}, predicted=PREDICTED)
    levels = found.details["levels"]
    assert levels["32"] == {"measured": 1290, "reference": 1342, "peers": 1248.0,
                            "peer_count": 1, "predicted": 1341.0, "floor": 644.0}
    assert levels["8"] == {"measured": 700}


# --- Apple Silicon -------------------------------------------------------------------------

def mac(**kwargs):
    base = dict(reported_name="Apple M4 Max", reported_memory_mib=128 * 1024,
                claimed_model="Apple M4 Max", claimed_vram_gb=128,
                probe_note="a Mac has no CUDA: the probes answer 'no GPU'")
    return evaluate(Evidence(**(base | kwargs)), M4_MAX, SPECS)


def by_metric(findings):
    return {f.metric: f for f in findings}


def test_a_mac_with_only_a_serving_measurement_is_serving_verified():
    findings = mac(served_tps={1: 22, 4: 44}, predicted={
        1: Floor(expected=17.5, floor=12.1), 4: Floor(expected=17.5, floor=12.1)})
    found = by_metric(findings)
    assert found["serving"].severity == OK and found["serving"].basis == "prediction"
    for metric in ("identity", "bandwidth", "compute"):
        assert found[metric].severity == NOT_MEASURED, metric
        assert found[metric].expected != "? TFLOPS"
    assert found["vram"].severity == NOT_MEASURED and "unified memory" in found["vram"].message.lower()
    assert "power" not in found and "pcie" not in found
    assert verdict(findings) == "serving_verified"


def test_a_mac_claiming_more_memory_than_its_chip_is_made_with():
    found = by_metric(mac(reported_memory_mib=192 * 1024, claimed_vram_gb=192))
    assert found["vram"].severity == MISMATCH and "at most 128 GB" in found["vram"].message


def test_a_mac_whose_bandwidth_was_measured_is_judged_against_the_chip():
    probe = {"facts": {}, "bandwidth": {"best_gbs": 300.0}}
    found = by_metric(mac(probe=probe))
    assert found["bandwidth"].severity == MISMATCH and found["bandwidth"].expected == "546 GB/s"
    probe = {"facts": {}, "bandwidth": {"best_gbs": 470.0}}
    findings = mac(probe=probe)
    assert by_metric(findings)["bandwidth"].severity == OK
    assert verdict(findings) == "verified"
