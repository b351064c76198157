"""Fleet peers as a serving basis, on PostgreSQL: who counts as a peer, peers that agree with
each other but not with the calibrated expectation, and a slow machine caught whatever the
order in which it and its peers were verified."""

from datetime import timedelta

import pytest
from django.utils import timezone

from fleetsim.profiles import get_profile
from marketplace.models import Card, Node
from tests.verification.machines import judged_node, measure
from verification import evidence, services
from verification.models import Finding, Measurement, VerificationRun

pytestmark = pytest.mark.django_db

# An RTX PRO 6000 serving Llama-3.1-8B: no published figure for it.
PRO_8B = get_profile("rtx-pro-6000-llama8b")


def status(node) -> str:
    return Card.objects.filter(node=node).first().verification_status


def serving(node) -> Finding:
    return Finding.objects.filter(run__node=node, metric="serving").latest("run_id")


def test_verified_peers_are_the_basis_and_named(bob, mallory):
    for i in range(3):
        judged_node(bob, PRO_8B, machine_id=f"honest-{i}")
    liar = judged_node(mallory, PRO_8B, own_factor=0.35, machine_id="liar")
    assert status(liar) == "flagged"
    found = serving(liar)
    assert found.severity == "mismatch" and found.basis == "peers"
    assert "by 3 RTX PRO 6000 Blackwell peers on this model" in found.message


def test_a_slow_machine_verified_first_is_caught_at_once_and_never_a_peer(bob, mallory):
    liar = judged_node(mallory, PRO_8B, own_factor=0.35, machine_id="liar")
    assert status(liar) == "flagged" and serving(liar).basis == "calibrated"
    honest = judged_node(bob, PRO_8B, machine_id="honest")
    assert status(honest) == "verified" and serving(honest).severity == "ok"
    assert serving(honest).details["peers"] == 0  # the flagged machine is no peer


def test_slow_twins_with_only_each_other_are_both_flagged(bob, mallory):
    first = judged_node(mallory, PRO_8B, own_factor=0.5, machine_id="twin-1")
    second = judged_node(mallory, PRO_8B, own_factor=0.5, machine_id="twin-2")
    for twin in (first, second):
        assert status(twin) == "flagged"
        assert serving(twin).severity == "mismatch" and serving(twin).basis == "calibrated"


def test_peers_far_below_the_calibrated_expectation_are_set_aside(bob, mallory):
    """A peer verified once, whose latest run reads half its speed: agreeing with a second
    machine as slow makes neither normal."""
    peer = judged_node(bob, PRO_8B, machine_id="peer")
    run = VerificationRun.objects.filter(node=peer).latest("pk")
    for row in Measurement.objects.filter(run=run, metric__startswith="tps@"):
        row.value /= 2
        row.save()
    liar = judged_node(mallory, PRO_8B, own_factor=0.5, machine_id="liar")
    found = serving(liar)
    assert found.severity == "mismatch" and found.basis == "calibrated"
    assert "not used as a yardstick" in found.message


@pytest.mark.parametrize("unlike", [
    dict(profile=get_profile("rtx-pro-6000")),  # another model
    dict(quantization="fp8"),  # other weights, both said
    dict(finished_at=timezone.now() - evidence.PEER_WINDOW - timedelta(days=1)),  # too old
])
def test_only_alike_recent_peers_count(bob, mallory, unlike):
    profile = unlike.get("profile", PRO_8B)
    own = (PRO_8B.serving(PRO_8B.model, unlike["quantization"])
           if "quantization" in unlike else None)
    peer = judged_node(bob, profile, own=own, machine_id="peer")
    if "finished_at" in unlike:
        VerificationRun.objects.filter(node=peer).update(finished_at=unlike["finished_at"])
    liar = judged_node(mallory, PRO_8B, own_factor=0.35, machine_id="liar")
    assert serving(liar).basis == "calibrated" and status(liar) == "flagged"


def test_an_unsaid_quantization_matches_any(bob, mallory):
    judged_node(bob, PRO_8B, machine_id="peer")
    run = VerificationRun.objects.get(node__hostname="peer")
    run.served = {**run.served, "quantization": ""}
    run.save()
    liar = judged_node(mallory, PRO_8B, own_factor=0.35, machine_id="liar")
    assert serving(liar).basis == "peers" and status(liar) == "flagged"


@pytest.mark.parametrize("hold", [
    lambda node: Card.objects.filter(node=node).update(verification_status="flagged"),
    lambda node: Node.objects.filter(pk=node.pk).update(needs_review=True),
    lambda node: Node.objects.filter(pk=node.pk).update(uuid_conflict=True),
    lambda node: Node.objects.filter(pk=node.pk).update(credential_revoked_at=timezone.now()),
])
def test_a_flagged_or_held_out_machine_is_no_peer(bob, mallory, hold):
    hold(judged_node(bob, PRO_8B, machine_id="peer"))
    liar = judged_node(mallory, PRO_8B, own_factor=0.35, machine_id="liar")
    assert serving(liar).basis == "calibrated"


def test_a_peer_flagged_later_leads_to_judging_again(bob, mallory):
    """The rule is "judged with as many peers as there are": one fewer is judged again too."""
    peer = judged_node(bob, PRO_8B, machine_id="peer")
    other = judged_node(mallory, PRO_8B, own_factor=0.95, machine_id="other")
    assert serving(other).details["peers"] == 1
    Card.objects.filter(node=peer).update(verification_status="flagged")
    run = VerificationRun.objects.filter(node=peer).latest("pk")
    services.peers_rejudge(run_id=run.pk)
    assert serving(other).details["peers"] == 0


def test_apple_machines_with_only_a_serving_measurement_are_peers_of_each_other(bob, mallory):
    mac = get_profile("m4-max-llamacpp")
    honest = judged_node(bob, mac, machine_id="mac")
    assert status(honest) == "serving_verified"
    slow = judged_node(mallory, mac, own_factor=0.45, machine_id="slow-mac")
    found = serving(slow)
    assert found.severity == "mismatch" and found.basis == "peers", found.message
    assert "1 Apple M4 Max peer on this model" in found.message
    yardstick = Finding.objects.filter(run__node=slow, metric="yardstick").first()
    assert yardstick.basis == "peers"  # the honest Mac on the yardstick too


def test_a_machine_short_only_against_peers_that_came_later_is_read_again_first(bob, mallory):
    """Judged again when faster peers were verified after it, a machine whose one reading
    passed against the peers it had then is not flagged on that old reading: its shortfall
    stands as a warning and a new run reads it again, which flags it when it is still short
    (twice)."""
    slowish = 0.72  # at the calibrated expectation's threshold: peers this slow still count
    middle = judged_node(mallory, PRO_8B, own_factor=slowish, machine_id="middle")
    for i in range(2):
        judged_node(mallory, PRO_8B, own_factor=slowish, machine_id=f"early-{i}")
    assert status(middle) == "verified" and serving(middle).severity == "ok"
    for i in range(5):
        judged_node(bob, PRO_8B, own_factor=1.1, machine_id=f"later-{i}")
    found = serving(middle)
    assert found.severity == "warning" and "measured again" in found.message, found.message
    assert status(middle) == "verified"
    again = VerificationRun.objects.get(node=middle, status="probing")
    assert again.trigger == "peers"

    measure(again, PRO_8B, own_factor=slowish, machine_id="middle")
    assert status(middle) == "flagged"
    found = serving(middle)
    assert found.severity == "mismatch" and "agreed" in found.message, found.message
