"""The node-agent protocol (docs/agent-protocol.md) as the platform serves it."""

import copy
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from marketplace import selectors, services
from marketplace.models import Card, EnrolmentToken, Node, NodeStatusChange, NodeUptimeHour

pytestmark = pytest.mark.django_db

H200 = {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-11111111-2222-3333-4444-555555555555",
        "memory_total_mib": 143771, "compute_capability": "9.0", "pcie_gen_current": 5,
        "pcie_gen_max": 5, "pcie_width_current": 16, "pcie_width_max": 16, "power_limit_w": 700}


def report(**overrides):
    body = {
        "agent_version": "0.1.0", "hostname": "gpu-box-1", "os": "Linux 6.8.0",
        "simulated": False, "nvidia": True, "driver_version": "560.35.03", "cuda_version": "12.6",
        "gpus": [copy.deepcopy(H200)],
        "engine": {"url": "http://127.0.0.1:8000", "reachable": True,
                   "models": ["Qwen/Qwen3-27B"], "error": None},
    }
    body.update(overrides)
    return body


def enroll(api, owner, hostname="gpu-box-1"):
    _, token = services.enrolment_token_create(owner=owner)
    response = api.post("/api/agent/enroll/", {"token": token, "hostname": hostname,
                                               "agent_version": "0.1.0"}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def beat(api, credential, body):
    return api.post("/api/agent/heartbeat/", body, format="json",
                    HTTP_AUTHORIZATION=f"Bearer {credential}")


def test_enroll_creates_node_for_token_owner_and_spends_token(api, bob):
    _, token = services.enrolment_token_create(owner=bob)
    response = api.post("/api/agent/enroll/", {"token": token, "hostname": "box"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["credential"].startswith("rsn_") and body["heartbeat_interval_s"] == 10
    node = Node.objects.get(pk=body["node_id"])
    assert node.owner == bob and node.name == "box"
    # Stored as prefix + HMAC: the credential itself is nowhere in the row.
    assert body["credential"] not in (node.credential_digest, node.credential_prefix)
    row = EnrolmentToken.objects.get(owner=bob)
    assert row.used_at is not None and row.node == node and token not in row.digest

    again = api.post("/api/agent/enroll/", {"token": token}, format="json")
    assert again.status_code == 401
    assert "already been used" in again.json()["detail"]
    assert Node.objects.count() == 1


def test_enroll_refuses_expired_revoked_and_forged_tokens(api, bob):
    row, token = services.enrolment_token_create(owner=bob)
    EnrolmentToken.objects.filter(pk=row.pk).update(expires_at=timezone.now())
    response = api.post("/api/agent/enroll/", {"token": token}, format="json")
    assert response.status_code == 401 and "expired" in response.json()["detail"]

    row, token = services.enrolment_token_create(owner=bob)
    assert services.enrolment_token_revoke(owner=bob, token_id=row.pk)
    response = api.post("/api/agent/enroll/", {"token": token}, format="json")
    assert response.status_code == 401 and "revoked" in response.json()["detail"]

    _, token = services.enrolment_token_create(owner=bob)
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    assert api.post("/api/agent/enroll/", {"token": forged}, format="json").status_code == 401
    assert api.post("/api/agent/enroll/", {"token": "nonsense"}, format="json").status_code == 401
    missing = api.post("/api/agent/enroll/", {}, format="json")
    assert missing.status_code == 400 and "token" in missing.json()
    assert Node.objects.count() == 0


def test_enrolment_token_expires_after_24_hours(bob):
    row, _ = services.enrolment_token_create(owner=bob)
    assert row.expires_at - row.created_at == timedelta(hours=24)


def test_first_heartbeat_creates_node_facts_and_one_card_per_gpu(api, bob):
    enrolled = enroll(api, bob)
    second = dict(H200, index=1, uuid="GPU-99999999-2222-3333-4444-555555555555")
    response = beat(api, enrolled["credential"], report(gpus=[H200, second]))
    assert response.status_code == 200, response.content
    assert response.json() == {"node_id": enrolled["node_id"], "status": "online",
                               "needs_review": False, "heartbeat_interval_s": 10, "jobs": [],
                               # Its first run starts: its GPUs' draw is asked for at once.
                               "report_power": True}
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.status == "online" and node.last_heartbeat_at is not None
    assert (node.driver_version, node.cuda_version, node.agent_version) == (
        "560.35.03", "12.6", "0.1.0")
    assert node.engine_models == ["Qwen/Qwen3-27B"] and node.engine_reachable
    cards = list(node.cards.order_by("index"))
    assert [c.index for c in cards] == [0, 1]
    assert cards[0].name == "NVIDIA H200" and cards[0].memory_total_mib == 143771
    assert cards[0].compute_capability == "9.0" and cards[0].power_limit_w == 700
    assert (cards[0].pcie_gen_max, cards[0].pcie_width_max) == (5, 16)
    assert all(not c.listing.is_listed for c in cards)  # the provider lists, not the agent
    assert NodeStatusChange.objects.filter(node=node, status="online").count() == 1
    assert NodeUptimeHour.objects.get(node=node).heartbeats == 1
    assert node.hardware_changed_at is None  # the first report is the baseline


def test_later_heartbeats_update_facts_and_notice_hardware_changes(api, bob):
    enrolled = enroll(api, bob)
    beat(api, enrolled["credential"], report())
    beat(api, enrolled["credential"], report(gpus=[dict(H200, pcie_gen_current=1)]))
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.hardware_changed_at is None  # an idle link downshifting is not a change
    assert node.cards.get().pcie_gen_current == 1

    beat(api, enrolled["credential"], report(gpus=[dict(H200, power_limit_w=400)]))
    node.refresh_from_db()
    assert node.hardware_changed_at is not None
    assert node.cards.get().power_limit_w == 400
    assert NodeUptimeHour.objects.get(node=node).heartbeats == 3


def test_nvlink_links_land_on_the_card_and_an_older_agent_may_leave_them_out(api, bob):
    enrolled = enroll(api, bob)
    node = Node.objects.get(pk=enrolled["node_id"])
    assert beat(api, enrolled["credential"], report()).status_code == 200  # no field: older
    assert node.cards.get().nvlink_links is None
    beat(api, enrolled["credential"], report(gpus=[dict(H200, nvlink_links=None)]))
    assert node.cards.get().nvlink_links is None
    # The agent, upgraded, starts to count them: stored, and not a new machine to verify.
    beat(api, enrolled["credential"], report(gpus=[dict(H200, nvlink_links=18)]))
    node.refresh_from_db()
    assert node.cards.get().nvlink_links == 18 and node.hardware_changed_at is None
    # Links gone down between two counts: the hardware is not what was verified.
    beat(api, enrolled["credential"], report(gpus=[dict(H200, nvlink_links=12)]))
    node.refresh_from_db()
    assert node.cards.get().nvlink_links == 12 and node.hardware_changed_at is not None


@pytest.mark.parametrize(("links", "nvlink"), [((18, 18), True), ((18, 0), False),
                                               ((None, None), False)])
def test_the_engine_configuration_reads_nvlink_from_the_cards(api, bob, links, nvlink):
    enrolled = enroll(api, bob)
    gpus = [dict(H200, index=i, uuid=f"GPU-{i}9999999-2222-3333-4444-555555555555",
                 nvlink_links=count) for i, count in enumerate(links)]
    assert beat(api, enrolled["credential"], report(gpus=gpus)).status_code == 200
    inputs = selectors.node_engine_inputs(Node.objects.get(pk=enrolled["node_id"]))
    assert len(inputs["node"].gpus) == 2 and inputs["node"].nvlink is nvlink


def test_driver_change_is_a_hardware_change(api, bob):
    enrolled = enroll(api, bob)
    beat(api, enrolled["credential"], report())
    beat(api, enrolled["credential"], report(driver_version="570.1"))
    assert Node.objects.get(pk=enrolled["node_id"]).hardware_changed_at is not None


def test_a_gpu_that_disappears_is_marked_absent_and_unlisted(api, bob):
    enrolled = enroll(api, bob)
    second = dict(H200, index=1, uuid="GPU-99999999-2222-3333-4444-555555555555")
    beat(api, enrolled["credential"], report(gpus=[H200, second]))
    card = Card.objects.get(node_id=enrolled["node_id"], index=1)
    services.listing_update(owner=bob, card_id=card.pk, is_listed=True,
                            price_per_hour_micros=2_000_000)
    beat(api, enrolled["credential"], report(gpus=[H200]))
    card.refresh_from_db()
    assert not card.present and not card.listing.is_listed


def test_machine_without_nvidia_gpu_is_stored_without_cards(api, bob):
    enrolled = enroll(api, bob)
    response = beat(api, enrolled["credential"], report(nvidia=False, gpus=[],
                                                        driver_version=None, cuda_version=None))
    assert response.status_code == 200
    node = Node.objects.get(pk=enrolled["node_id"])
    assert not node.has_nvidia and node.cards.count() == 0 and node.driver_version == ""


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b.pop("gpus"), "gpus"),
    (lambda b: b["gpus"][0].pop("name"), "gpus"),
    (lambda b: b["gpus"][0].update(memory_total_mib="lots"), "gpus"),
    (lambda b: b["gpus"][0].update(index=-1), "gpus"),
    (lambda b: b.update(gpus=[H200, H200]), "gpus"),
    (lambda b: b.update(gpus=[dict(H200, index=i) for i in range(65)]), "gpus"),
    (lambda b: b["engine"].update(models=["m"] * 257), "engine"),
    (lambda b: b.update(hostname="h" * 300), "hostname"),
    (lambda b: b.pop("engine"), "engine"),
    (lambda b: b.update(nvidia="perhaps"), "nvidia"),
    (lambda b: b["gpus"][0].update(nvlink_links=-1), "gpus"),
    (lambda b: b["gpus"][0].update(nvlink_links=65), "gpus"),
])
def test_malformed_heartbeat_is_refused_naming_the_field_and_changes_nothing(
        api, bob, mutate, field):
    enrolled = enroll(api, bob)
    body = report()
    mutate(body)
    response = beat(api, enrolled["credential"], body)
    assert response.status_code == 400
    assert field in response.json()
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.last_heartbeat_at is None and node.cards.count() == 0
    assert not NodeUptimeHour.objects.exists()


def test_oversized_heartbeat_is_refused(api, bob):
    enrolled = enroll(api, bob)
    body = report()
    body["os"] = "x" * (300 * 1024)
    response = beat(api, enrolled["credential"], body)
    assert response.status_code == 400 and "body" in response.json()
    assert Node.objects.get(pk=enrolled["node_id"]).last_heartbeat_at is None


def test_heartbeat_that_is_not_json_gets_400(api, bob):
    enrolled = enroll(api, bob)
    response = api.post("/api/agent/heartbeat/", "{not json", content_type="application/json",
                        HTTP_AUTHORIZATION=f"Bearer {enrolled['credential']}")
    assert response.status_code == 400


def test_heartbeat_credentials(api, bob):
    enrolled = enroll(api, bob)
    assert api.post("/api/agent/heartbeat/", report(), format="json").status_code == 401
    assert beat(api, "rsn_000000000000_nope", report()).status_code == 401
    assert beat(api, enrolled["credential"] + "x", report()).status_code == 401
    assert services.node_revoke(owner=bob, node_id=enrolled["node_id"])
    response = beat(api, enrolled["credential"], report())
    assert response.status_code == 403 and "revoked" in response.json()["detail"]
    assert Node.objects.get(pk=enrolled["node_id"]).last_heartbeat_at is None


def test_gpu_uuid_already_registered_elsewhere_flags_the_newcomer_only(api, bob, mallory):
    first = enroll(api, bob, "honest")
    beat(api, first["credential"], report())
    spoofer = enroll(api, mallory, "spoofer")
    response = beat(api, spoofer["credential"], report())
    assert response.status_code == 200 and response.json()["needs_review"] is True
    node = Node.objects.get(pk=spoofer["node_id"])
    assert node.uuid_conflict and not node.needs_review
    assert node.cards.get().uuid == H200["uuid"]  # stored, not dropped
    # The incumbent's next heartbeats see the copy too, and it stays clear.
    reply = beat(api, first["credential"], report()).json()
    assert reply["needs_review"] is False
    assert not Node.objects.get(pk=first["node_id"]).held_out


def test_node_marked_offline_after_three_missed_heartbeats(api, bob):
    enrolled = enroll(api, bob)
    beat(api, enrolled["credential"], report())
    node = Node.objects.get(pk=enrolled["node_id"])
    last = node.last_heartbeat_at
    assert services.nodes_mark_offline(now=last + timedelta(seconds=29)) == []
    assert services.nodes_mark_offline(now=last + timedelta(seconds=31)) == [node.pk]
    node.refresh_from_db()
    assert node.status == "offline"
    assert list(node.status_changes.order_by("at").values_list("status", flat=True)) == [
        "online", "offline"]
    beat(api, enrolled["credential"], report())
    node.refresh_from_db()
    assert node.status == "online" and node.status_changes.count() == 3


DEEP = b"[" * 50_000 + b"]" * 50_000


@pytest.mark.parametrize("path", ["/api/agent/enroll/", "/api/agent/heartbeat/"])
def test_a_body_nested_too_deeply_is_a_400_not_a_500(client, bob, path):
    """Python's json gives up with RecursionError: answered like any other malformed body."""
    enrolled = enroll(APIClient(), bob)
    response = client.post(path, data=b'{"token": ' + DEEP + b"}",
                           content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {enrolled['credential']}")
    assert response.status_code == 400 and "nested too deeply" in response.json()["detail"]


def test_the_rest_api_refuses_deep_nesting_for_a_logged_in_user_too(client, alice):
    client.force_login(alice)
    response = client.post("/api/rentals/", data=b'{"card_id": ' + DEEP + b"}",
                           content_type="application/json")
    assert response.status_code == 400
