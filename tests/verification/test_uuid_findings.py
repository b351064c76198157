"""A GPU UUID conflict reaches the newcomer's verdict at once, through its heartbeats, and
leaves it when the conflict is gone; the incumbent's verdict never moves."""

import copy

import pytest

from marketplace.models import Card, Node
from tests.marketplace.test_agent_api import H200, beat, enroll, report
from tests.verification.test_pipeline import h200_probe
from verification import services
from verification.models import Finding, VerificationRun

pytestmark = pytest.mark.django_db

OWN_UUID = "GPU-77777777-0000-0000-0000-000000000001"
# Hardware checked, no engine measured: its serving is not judged, and nothing is flagged.
CHECKED = "not_judged"


def verified(node_id: int, uuid: str) -> None:
    """The node's run, probes answered, judged and published (no engine: hardware only)."""
    run = services.run_start(node_id=node_id, trigger="enrolment")
    job = services.jobs_for_node(node_id)[0]
    services.job_result_record(node_id=node_id, job_id=job["id"], status="done",
                               result=h200_probe(uuid=uuid))
    VerificationRun.objects.filter(pk=run.pk).update(status="load_testing")
    assert services.run_evaluate(run_id=run.pk) and services.run_publish(run_id=run.pk)


def gpus(uuid):
    return [copy.deepcopy(H200) | {"uuid": uuid}]


def status(node_id):
    return Card.objects.get(node_id=node_id).verification_status


def test_the_newcomer_is_flagged_when_it_copies_a_uuid_and_cleared_when_it_stops(
        api, bob, mallory):
    incumbent = enroll(api, bob, "honest")
    beat(api, incumbent["credential"], report())
    verified(incumbent["node_id"], H200["uuid"])
    newcomer = enroll(api, mallory, "newcomer")
    beat(api, newcomer["credential"], report(gpus=gpus(OWN_UUID)))
    verified(newcomer["node_id"], OWN_UUID)
    assert status(newcomer["node_id"]) == CHECKED

    beat(api, newcomer["credential"], report())  # now it reports the incumbent's UUID
    assert status(newcomer["node_id"]) == "flagged"
    found = Finding.objects.get(card__node_id=newcomer["node_id"], metric="uuid")
    assert found.severity == "mismatch" and f"#{incumbent['node_id']}" in found.measured
    assert Node.objects.get(pk=newcomer["node_id"]).uuid_conflict

    beat(api, incumbent["credential"], report())
    assert status(incumbent["node_id"]) == CHECKED
    assert not Finding.objects.filter(card__node_id=incumbent["node_id"], metric="uuid").exists()

    beat(api, newcomer["credential"], report(gpus=gpus(OWN_UUID)))  # the conflict is gone
    assert status(newcomer["node_id"]) == CHECKED
    assert not Finding.objects.filter(card__node_id=newcomer["node_id"], metric="uuid").exists()
    assert not Node.objects.get(pk=newcomer["node_id"]).uuid_conflict


def test_two_gpus_of_one_machine_with_one_uuid_are_a_mismatch(api, bob):
    node = enroll(api, bob, "twins")
    twins = gpus(OWN_UUID) + [copy.deepcopy(H200) | {"uuid": OWN_UUID, "index": 1}]
    beat(api, node["credential"], report(gpus=twins))
    verified(node["node_id"], OWN_UUID)
    assert set(Card.objects.filter(node_id=node["node_id"]).values_list(
        "verification_status", flat=True)) == {"flagged"}
    assert Finding.objects.filter(card__node_id=node["node_id"], metric="uuid",
                                  severity="mismatch").count() == 2
