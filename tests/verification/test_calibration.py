"""The calibrated expectation, machine by machine and model by model: for every honest fleetsim
machine and every model of the platform's registry it can hold (at every weight format the
platform configures for it), with no peer and no published figure for that combination, the
machine serving it honestly is judged ok and the machine serving it at 60% is a mismatch. The
machine serves the yardstick honestly either way: only the calibrated expectation of its own
model can tell. Through the real evaluation and publication (tests/verification/machines.py).
"""

import pytest

from fleetsim.profiles import HONEST, get_profile
from marketplace.model_data import MODELS
from marketplace.models import Card
from tests.verification.machines import judged_node, measured, served_by
from verification.models import Finding, VerificationRun

pytestmark = pytest.mark.django_db

# The published combinations have a reference of their own: left out, so that the calibrated
# expectation is what decides.
PUBLISHED = {("rtx-pro-6000", "Qwen/Qwen3.5-27B"), ("2x-rtx-4090", "Qwen/Qwen3.5-27B"),
             ("2x-rtx-5090", "Qwen/Qwen3.5-27B"), ("h200", "Qwen/Qwen3.5-27B")}


def _cases():
    for key in sorted(HONEST):
        profile = get_profile(key)
        formats = ("Q4_K_M",) if profile.engine == "llama.cpp" else ("bf16", "fp8", "awq-int4")
        for model in MODELS:
            if (key.split("-llama8b")[0].split("-mistral24b")[0], model) in PUBLISHED:
                continue
            for quantization in formats:
                if served_by(profile, model, quantization) is not None:
                    yield pytest.param(key, model, quantization,
                                       id=f"{key}-{model.rsplit('/', 1)[-1]}-{quantization}")


CASES = list(_cases())


def test_every_honest_machine_has_cases():
    assert {case.values[0] for case in CASES} == HONEST
    assert len(CASES) >= 60


def serving(node) -> Finding:
    return Finding.objects.filter(run__node=node, metric="serving").latest("run_id")


@pytest.mark.parametrize("key, model, quantization", CASES)
def test_honest_is_ok_and_sixty_percent_is_a_mismatch(bob, mallory, key, model, quantization):
    profile = get_profile(key)
    own = served_by(profile, model, quantization)
    honest = judged_node(bob, profile, own=own, machine_id=f"{key}-1")
    found = serving(honest)
    assert found.basis == "calibrated", found.message
    assert found.severity == "ok", found.message
    assert Card.objects.filter(node=honest).first().verification_status in (
        "verified", "serving_verified")
    yardstick = Finding.objects.filter(run__node=honest, metric="yardstick").first()
    assert yardstick.severity == "ok", yardstick.message

    liar = judged_node(mallory, profile, own=own, own_factor=0.6, machine_id=f"{key}-2")
    found = serving(liar)
    # Its honest twin above is a peer now, and a better basis still.
    assert found.severity == "mismatch" and found.basis in ("calibrated", "peers"), found.message
    assert Card.objects.filter(node=liar).first().verification_status == "flagged"


def test_the_calibrated_expectation_lands_near_the_honest_figure(bob):
    """Within 15% of what every honest machine serves every model at, at one stream and at 32:
    the 70% mismatch line then falls between honest (>= 85% of the expectation: ok) and a
    machine at 60%."""
    worst = []
    for param in CASES:
        key, model, quantization = param.values
        profile = get_profile(key)
        own = served_by(profile, model, quantization)
        node = judged_node(bob, profile, own=own, machine_id=f"{param.id}")
        levels = serving(node).details["levels"]
        truth = measured(own, (1, 32))
        for level, tps in truth.items():
            worst.append((tps / levels[str(level)]["calibrated"], param.id, level))
        VerificationRun.objects.filter(node=node).delete()
        node.delete()
    low, high = min(worst), max(worst)
    assert low[0] >= 0.86 and high[0] <= 1.15, (low, high)


def test_where_a_floor_is_all_there_is_it_is_a_sane_one_and_only_flags(bob, mallory):
    """An engine run by hand that says neither its kind nor its weights' format, serving a
    model nobody published figures for: the floor from the heaviest weights that fit, vLLM's
    on a CUDA machine (an RTX PRO 6000 once read "at least 14 tok/s" at 32, from a llama.cpp
    guess), and it judges nothing but what is far below it."""
    profile = get_profile("rtx-pro-6000-llama8b")
    node = judged_node(bob, profile, supervised=False, unsaid=True)
    found = serving(node)
    assert found.basis == "floor"
    levels = found.details["levels"]
    assert levels["32"]["floor"] > 250 and levels["1"]["floor"] > 25, levels
    assert found.severity == "not_measured" and "by hand" in found.message
    assert Card.objects.filter(node=node).first().verification_status == "not_judged"
    slow = judged_node(mallory, profile, supervised=False, unsaid=True, own_factor=0.1,
                       machine_id="slow-1")
    assert serving(slow).severity == "mismatch"
