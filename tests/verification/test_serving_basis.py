"""The serving expectation, basis by basis, with plain values: peers, the reference table, the
prediction calibrated on the card's yardstick, the floor; how they combine; and when a card can
be judged at all."""

from dataclasses import replace

import pytest

from verification.evaluate import (
    MISMATCH,
    NOT_MEASURED,
    OK,
    WARNING,
    Evidence,
    Floor,
    Spec,
    Yardstick,
    evaluate,
    verdict,
)
from verification.predict import Decode

PRO_6000 = Spec("RTX PRO 6000 Blackwell", 96, 1792, None, 5, "12.0", 512, 188,
                ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition",), 600)
M4_MAX = Spec("Apple M4 Max", 128, 546, 16, None, "", None, None, ("Apple M4 Max",))
SPECS = [PRO_6000, M4_MAX]


def law(weights_ms: float, token_ms: float, batch: int, step_ms: float = 3.29) -> Decode:
    return Decode(busy=1, batch=batch, weights_s=weights_ms / 1e3, step_s=step_ms / 1e3,
                  token_s=token_ms / 1e3)


# The RTX PRO 6000 serving the 27B at 8-bit, as predict.py's law has it: 106 alone, 1,342 at
# 32 (the published figures), its floor about half.
P27 = {1: law(5.7, 0.464, 1), 32: law(5.7, 0.464, 32)}
PREDICTED = {level: Floor(expected=d.tps(), floor=d.tps() * 0.48, decode=d)
             for level, d in P27.items()}
# The yardstick on the same card (Llama-3.1-8B at 16 bits), as predicted for its hardware.
Y8 = {level: law(9.9, 0.25, level) for level in (1, 8, 32)}
HONEST_YARDSTICK = Yardstick(label="Llama-3.1-8B at bf16 on vLLM",
                             measured={level: d.tps() for level, d in Y8.items()},
                             predicted=Y8, peer_label="RTX PRO 6000 Blackwell")


def serving(**kwargs):
    base = dict(reported_name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                reported_memory_mib=98304, peer_label="RTX PRO 6000 Blackwell",
                supervised=True, yardstick=HONEST_YARDSTICK)
    findings = evaluate(Evidence(**(base | kwargs)), PRO_6000, SPECS)
    return next(f for f in findings if f.metric == "serving")


@pytest.mark.parametrize("basis_kwargs, basis", [
    (dict(peer_tps={1: (104.0,), 32: (1248.0,)}, predicted=PREDICTED), "peers"),
    (dict(reference_tps={1: 106, 32: 1342}, predicted=PREDICTED), "reference"),
    (dict(predicted=PREDICTED), "calibrated"),
])
@pytest.mark.parametrize("served, severity", [
    ({1: 104, 32: 1290}, OK),
    ({1: 30, 32: 380}, MISMATCH),  # under a third of the honest card, at every level
])
def test_each_basis(basis_kwargs, basis, served, severity):
    found = serving(served_tps=served, **basis_kwargs)
    assert found.basis == basis and found.severity == severity
    assert basis in found.expected


def test_no_basis_at_all_is_said_and_never_ok():
    found = serving(served_tps={1: 36, 32: 427})
    assert found.severity == NOT_MEASURED and found.basis == "none"
    assert "not judged" in found.message and "size is not known" in found.message


def test_the_calibration_follows_what_the_card_served_on_its_yardstick():
    """A card whose engine turns its hardware into 20% fewer tokens than predicted, on the
    yardstick as on its own model, is honest: its expectation is 20% lower."""
    slower = {level: d.tps() * 0.8 for level, d in Y8.items()}
    card = replace(HONEST_YARDSTICK, measured=slower)
    found = serving(served_tps={1: 106 * 0.8, 32: 1342 * 0.8}, predicted=PREDICTED,
                    yardstick=card)
    assert found.severity == OK and found.basis == "calibrated"
    assert "calibrated on its own yardstick" in found.message
    assert found.details["calibration"]["on"] == "yardstick"
    # The same machine at 60% of that on its own model: a mismatch.
    found = serving(served_tps={1: 106 * 0.8 * 0.6, 32: 1342 * 0.8 * 0.6},
                    predicted=PREDICTED, yardstick=card)
    assert found.severity == MISMATCH and found.basis == "calibrated"


def test_slow_twins_with_only_each_other_are_set_aside():
    """Two machines at half speed with only each other as peers: the peers are set aside
    against the calibrated expectation, and each is judged by it."""
    found = serving(served_tps={1: 53, 32: 671}, peer_tps={1: (54.0,), 32: (660.0,)},
                    predicted=PREDICTED)
    assert found.basis == "calibrated" and found.severity == MISMATCH
    assert "not used as a yardstick" in found.message


def test_peers_are_preferred_to_the_table_and_the_prediction():
    """The WSL2 pair: its own peers serve 422 at 32; the reference says 435. The peers are the
    closest evidence."""
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
    assert levels["32"]["measured"] == 1290 and levels["32"]["reference"] == 1342
    assert levels["32"]["peers"] == 1248.0 and levels["32"]["peer_count"] == 1
    assert levels["32"]["calibrated"] == pytest.approx(PREDICTED[32].expected, rel=0.01)
    assert levels["32"]["predicted"] == round(PREDICTED[32].expected, 1)
    assert levels["8"] == {"measured": 700}


# --- when a card can be judged at all ---------------------------------------------------------

def test_an_engine_run_by_hand_is_never_judged_ok():
    """No yardstick could run: honest-looking serving is "not judged", far too slow flags."""
    found = serving(served_tps={1: 104, 32: 1290}, reference_tps={1: 106, 32: 1342},
                    predicted=PREDICTED, supervised=False, yardstick=Yardstick(
                        label="Llama-3.1-8B at bf16 on vLLM", predicted=Y8,
                        note="its provider runs the engine by hand"))
    assert found.severity == NOT_MEASURED and "by hand" in found.message
    found = serving(served_tps={1: 30, 32: 380}, reference_tps={1: 106, 32: 1342},
                    predicted=PREDICTED, supervised=False)
    assert found.severity == MISMATCH


def test_a_yardstick_that_did_not_run_leaves_serving_not_judged():
    found = serving(served_tps={1: 104, 32: 1290}, predicted=PREDICTED, yardstick=Yardstick(
        label="Llama-3.1-8B at bf16 on vLLM", predicted=Y8,
        note="its engine did not serve the yardstick within 900 s"))
    assert found.severity == NOT_MEASURED and "within 900 s" in found.message
    # Judged against what its hardware is expected to serve the yardstick at: far below flags.
    assert found.details["calibration"]["on"] == "hardware"


def test_the_floor_only_ever_flags():
    floor_only = {level: replace(f, decode=None) for level, f in PREDICTED.items()}
    found = serving(served_tps={1: 104, 32: 1290}, predicted=floor_only)
    assert found.severity == NOT_MEASURED and found.basis == "floor"
    found = serving(served_tps={1: 20, 32: 200}, predicted=floor_only)
    assert found.severity == MISMATCH and found.basis == "floor"


def test_the_verdicts():
    honest = evaluate(Evidence(reported_name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                               reported_memory_mib=98304, served_tps={1: 104, 32: 1290},
                               predicted=PREDICTED, supervised=True,
                               yardstick=HONEST_YARDSTICK,
                               probe={"bandwidth": {"best_gbs": 1610.0}}), PRO_6000, SPECS)
    assert verdict(honest) == "verified"
    by_hand = evaluate(Evidence(reported_name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                                reported_memory_mib=98304, served_tps={1: 104, 32: 1290},
                                predicted=PREDICTED,
                                probe={"bandwidth": {"best_gbs": 1610.0}}), PRO_6000, SPECS)
    assert verdict(by_hand) == "not_judged"


# --- the yardstick itself ----------------------------------------------------------------------

def yardstick_finding(y: Yardstick):
    findings = evaluate(Evidence(reported_name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                                 reported_memory_mib=98304, supervised=True, yardstick=y),
                        PRO_6000, SPECS)
    return next(f for f in findings if f.metric == "yardstick")


def test_the_yardstick_is_judged_against_peers_the_reference_then_the_calibrated_prediction():
    slow = replace(HONEST_YARDSTICK, measured={k: v * 0.5 for k, v in
                                               HONEST_YARDSTICK.measured.items()})
    assert yardstick_finding(HONEST_YARDSTICK).severity == OK
    found = yardstick_finding(slow)
    assert found.severity == MISMATCH and found.basis == "prediction"
    reference = {k: v for k, v in HONEST_YARDSTICK.measured.items()}
    found = yardstick_finding(replace(slow, reference=reference))
    assert found.severity == MISMATCH and found.basis == "reference"
    found = yardstick_finding(replace(slow, fleet_ratio={1: 1.0, 8: 1.0, 32: 1.0},
                                      fleet_machines=4))
    assert found.basis == "calibrated" and "4 machines of the fleet" in found.message
    # Slow twins on the yardstick: set aside against the reference.
    twins = {k: (v * 0.5,) for k, v in HONEST_YARDSTICK.measured.items()}
    found = yardstick_finding(replace(slow, peers=twins, reference=reference))
    assert found.severity == MISMATCH and found.basis == "reference"
    assert "not used as a yardstick" in found.message
    # Honest peers are the closest evidence.
    peers = {k: (v,) for k, v in HONEST_YARDSTICK.measured.items()}
    found = yardstick_finding(replace(HONEST_YARDSTICK, peers=peers, reference=reference))
    assert found.basis == "peers" and found.severity == OK


def test_a_yardstick_that_was_not_served_says_why():
    found = yardstick_finding(Yardstick(label="Llama-3.1-8B at bf16 on vLLM", predicted=Y8,
                                        note="a card of it is rented"))
    assert found.severity == NOT_MEASURED and "a card of it is rented" in found.message


# --- Apple Silicon -------------------------------------------------------------------------

M4_Y = {level: law(20.0, 3.0, min(level, 4)) for level in (1, 8, 32)}


def mac(**kwargs):
    base = dict(reported_name="Apple M4 Max", reported_memory_mib=128 * 1024,
                claimed_model="Apple M4 Max", claimed_vram_gb=128,
                probe_note="a Mac has no CUDA: the probes answer 'no GPU'", supervised=True,
                yardstick=Yardstick(label="Llama-3.1-8B at Q4_K_M on llama.cpp",
                                    measured={k: d.tps() for k, d in M4_Y.items()},
                                    predicted=M4_Y))
    return evaluate(Evidence(**(base | kwargs)), M4_MAX, SPECS)


def by_metric(findings):
    return {f.metric: f for f in findings}


def test_a_mac_with_only_a_serving_measurement_is_serving_verified():
    own = {1: law(30.0, 8.0, 1), 4: law(30.0, 8.0, 4)}
    findings = mac(served_tps={level: d.tps() for level, d in own.items()}, predicted={
        level: Floor(expected=d.tps(), floor=d.tps() * 0.7, decode=d)
        for level, d in own.items()})
    found = by_metric(findings)
    assert found["serving"].severity == OK and found["serving"].basis == "calibrated"
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
    own = {1: law(30.0, 8.0, 1)}
    findings = mac(probe=probe, served_tps={1: own[1].tps()},
                   predicted={1: Floor(own[1].tps(), own[1].tps() * 0.7, own[1])})
    assert by_metric(findings)["bandwidth"].severity == OK
    assert verdict(findings) == "verified"
