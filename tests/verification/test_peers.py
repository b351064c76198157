"""Fleet peers as the serving basis, on PostgreSQL: who counts as a peer, and a slow machine
caught whatever the order in which it and its peers were verified."""

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Card, Listing, Node
from tests.factories import CardFactory, NodeFactory
from tests.verification.test_pipeline import h200_probe
from verification import services
from verification.models import Finding, Measurement, ProbeJob, VerificationRun

pytestmark = pytest.mark.django_db

PRO_6000 = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
# A model nobody publishes figures for and whose name states no size: peers are the only basis.
MODEL = "acme/house-model"


def pro_6000_probe(index: int) -> dict:
    gpu = h200_probe()["gpus"][0]
    gpu["index"] = index
    gpu["facts"] |= {"name": PRO_6000, "compute_capability": "12.0",
                     "compute_capability_cuda": "12.0", "sm_count": 188,
                     "memory_bus_width_bits": 512, "power_limit_w": 600,
                     "power_default_limit_w": 600, "memory_total_mib": 98304}
    gpu["bandwidth"] = {"best_gbs": 1620.0}
    gpu["matmul"] = {"best_tflops": 185.0}
    gpu["vram"] = {"free_bytes": 95 * 2**30, "pattern_ok": True}
    return gpu


def verified_node(owner, tps: dict[int, float], *, count: int = 1, model: str = MODEL,
                  quantization: str = "fp8", finished_at=None) -> Node:
    """A node whose run went through evaluation and publication with these figures, as the
    load test would have written them."""
    node = NodeFactory(owner=owner, engine_models=[model], engine_served=[
        {"id": model, "engine": "vllm", "max_context": 32768, "quantization": quantization}])
    for index in range(count):
        card = CardFactory(node=node, index=index, name=PRO_6000, memory_total_mib=98304,
                           compute_capability="12.0", pcie_gen_max=5, pcie_gen_current=5,
                           power_limit_w=600)
        Listing.objects.create(card=card, is_listed=True, price_per_hour_micros=1_000_000)
    run = VerificationRun.objects.create(node=node, trigger="enrolment", model=model,
                                         status=VerificationRun.Status.LOAD_TESTING)
    ProbeJob.objects.create(run=run, node=node, status="done", result={
        "device": "cuda", "wsl": False, "gpus": [pro_6000_probe(i) for i in range(count)]})
    for level, value in tps.items():
        Measurement.objects.create(run=run, card=None, metric=f"tps@{level}", value=value,
                                   unit="tok/s")
    assert services.run_evaluate(run_id=run.pk) and services.run_publish(run_id=run.pk)
    if finished_at:
        VerificationRun.objects.filter(pk=run.pk).update(finished_at=finished_at)
    return node


def status(node) -> str:
    return Card.objects.filter(node=node).first().verification_status


def serving(node) -> Finding:
    return Finding.objects.filter(run__node=node, metric="serving").latest("run_id")


HONEST = {1: 104.0, 32: 1248.0}
SLOW = {1: 34.0, 32: 427.0}


def test_a_slow_machine_judged_before_its_peers_is_caught_once_they_are_verified(bob, mallory):
    liar = verified_node(mallory, SLOW)
    assert serving(liar).basis == "none" and status(liar) == "verified"  # hardware checked
    honest = verified_node(bob, HONEST)
    assert status(honest) == "verified"
    assert status(liar) == "flagged"
    found = serving(liar)
    assert found.severity == "mismatch" and found.basis == "peers"
    assert "1,248 tok/s by 1 RTX PRO 6000 Blackwell peer on this model" in found.message


def test_three_peers_are_named_in_the_finding(bob, mallory):
    for _ in range(3):
        verified_node(bob, HONEST)
    liar = verified_node(mallory, SLOW)
    assert status(liar) == "flagged"
    assert "by 3 RTX PRO 6000 Blackwell peers" in serving(liar).message


def test_the_honest_are_not_flagged_by_a_slow_peer(bob, mallory):
    verified_node(mallory, SLOW)
    honest = verified_node(bob, HONEST)
    assert status(honest) == "verified" and serving(honest).severity == "ok"


@pytest.mark.parametrize("unlike", [
    dict(count=2),  # another GPU count
    dict(model="acme/other-model"),  # another model
    dict(quantization="bf16"),  # another quantization, both said
    dict(finished_at=timezone.now() - services.PEER_WINDOW - timedelta(days=1)),  # too old
])
def test_only_alike_recent_peers_count(bob, mallory, unlike):
    verified_node(bob, HONEST if unlike.get("count", 1) == 1 else {1: 104.0, 32: 2496.0},
                  **unlike)
    liar = verified_node(mallory, SLOW)
    assert serving(liar).basis == "none" and status(liar) == "verified"


def test_an_unsaid_quantization_matches_any(bob, mallory):
    verified_node(bob, HONEST, quantization="")
    liar = verified_node(mallory, SLOW)
    assert serving(liar).basis == "peers" and status(liar) == "flagged"


@pytest.mark.parametrize("hold", [
    lambda node: Card.objects.filter(node=node).update(verification_status="flagged"),
    lambda node: Node.objects.filter(pk=node.pk).update(needs_review=True),
    lambda node: Node.objects.filter(pk=node.pk).update(uuid_conflict=True),
    lambda node: Node.objects.filter(pk=node.pk).update(credential_revoked_at=timezone.now()),
])
def test_a_flagged_or_held_out_machine_is_no_peer(bob, mallory, hold):
    hold(verified_node(bob, HONEST))
    liar = verified_node(mallory, SLOW)
    assert serving(liar).basis == "none"


def test_a_peer_flagged_later_leads_to_judging_again(bob, mallory):
    """The rule is "judged with as many peers as there are": one fewer is judged again too."""
    peer = verified_node(bob, HONEST)
    other = verified_node(mallory, {1: 100.0, 32: 1200.0})
    assert serving(other).details["peers"] == 1
    Card.objects.filter(node=peer).update(verification_status="flagged")
    run = VerificationRun.objects.filter(node=peer).latest("pk")
    services.peers_rejudge(run_id=run.pk)
    assert serving(other).details["peers"] == 0
