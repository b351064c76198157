"""Engine keys (marketplace/engine_keys.py): issued at enrolment, handed to the agent in the
heartbeat answer, sent by the platform only once the agent says its engine runs with the key,
rotated by the owner or an operator."""

import pytest
from django.urls import reverse

from marketplace import engine_keys, services
from marketplace.models import Node
from tests.marketplace.test_agent_api import beat, enroll, report

pytestmark = pytest.mark.django_db


def engine(**keys):
    return {"url": "http://127.0.0.1:8000", "reachable": True, "models": ["Qwen/Qwen3-27B"],
            "error": None, **keys}


def test_sealed_at_rest_and_unreadable_under_another_secret(settings):
    key = engine_keys.issue()
    sealed = engine_keys.seal(key)
    assert key not in sealed and engine_keys.unseal(sealed) == key
    assert len(engine_keys.fingerprint(key)) == 16 and engine_keys.fingerprint("") == ""
    settings.SECRET_KEY = "another secret key, another derived key"
    assert engine_keys.unseal(sealed) == ""
    assert engine_keys.unseal("not a token") == ""


def test_enrolment_issues_a_key_the_platform_sends_once_the_engine_runs_with_it(api, bob):
    enrolled = enroll(api, bob)
    key = enrolled["engine_key"]
    node = Node.objects.get(pk=enrolled["node_id"])
    assert key.startswith("rsk_") and key not in node.engine_key_next
    assert engine_keys.unseal(node.engine_key_next) == key
    assert node.engine_key_sealed == "" and node.engine_key_fingerprint == ""
    fingerprint = engine_keys.fingerprint(key)

    # The agent holds it, the engine does not run with it yet: nothing is sent to the engine.
    answer = beat(api, enrolled["credential"], report(engine=engine(key_held=fingerprint)))
    assert answer.status_code == 200 and "engine_key" not in answer.json()
    node.refresh_from_db()
    assert node.engine_key_sealed == "" and node.engine_key_next

    answer = beat(api, enrolled["credential"], report(engine=engine(
        key_held=fingerprint, key_fingerprint=fingerprint)))
    assert "engine_key" not in answer.json()
    node.refresh_from_db()
    assert engine_keys.unseal(node.engine_key_sealed) == key
    assert (node.engine_key_fingerprint, node.engine_key_next) == (fingerprint, "")


def test_an_agent_without_the_key_is_handed_it_an_older_agent_is_not(api, bob):
    enrolled = enroll(api, bob)
    lost = beat(api, enrolled["credential"], report(engine=engine(key_held=None)))
    assert lost.json()["engine_key"] == {
        "key": enrolled["engine_key"], "fingerprint": engine_keys.fingerprint(
            enrolled["engine_key"])}
    older = beat(api, enrolled["credential"], report())  # says nothing of keys
    assert "engine_key" not in older.json()
    refused = beat(api, enrolled["credential"], report(engine=engine(key_held="not-hex")))
    assert refused.status_code == 400


def test_a_node_enrolled_before_engine_keys_gets_one_at_its_next_heartbeat(api, bob):
    enrolled = enroll(api, bob)
    Node.objects.filter(pk=enrolled["node_id"]).update(engine_key_next="")
    answer = beat(api, enrolled["credential"], report(engine=engine(key_held=None))).json()
    node = Node.objects.get(pk=enrolled["node_id"])
    assert answer["engine_key"]["key"] == engine_keys.unseal(node.engine_key_next)


def test_rotation_keeps_sending_the_old_key_until_the_engine_runs_with_the_new(api, bob):
    enrolled = enroll(api, bob)
    old = enrolled["engine_key"]
    old_fp = engine_keys.fingerprint(old)
    beat(api, enrolled["credential"], report(engine=engine(key_held=old_fp,
                                                           key_fingerprint=old_fp)))
    node = Node.objects.get(pk=enrolled["node_id"])
    assert services.node_engine_key_rotate(node_id=node.pk, owner=bob)

    offered = beat(api, enrolled["credential"], report(engine=engine(
        key_held=old_fp, key_fingerprint=old_fp))).json()["engine_key"]
    new = offered["key"]
    assert new != old and offered["fingerprint"] == engine_keys.fingerprint(new)
    # Held, the engine draining on the old key: still the old one.
    beat(api, enrolled["credential"], report(engine=engine(
        key_held=offered["fingerprint"], key_fingerprint=old_fp)))
    node.refresh_from_db()
    assert engine_keys.unseal(node.engine_key_sealed) == old
    # Restarted with the new key: from now on the new one.
    beat(api, enrolled["credential"], report(engine=engine(
        key_held=offered["fingerprint"], key_fingerprint=offered["fingerprint"])))
    node.refresh_from_db()
    assert engine_keys.unseal(node.engine_key_sealed) == new and not node.engine_key_next


def test_only_the_owner_rotates_from_the_machine_page(client, bob, mallory):
    _, token = services.enrolment_token_create(owner=bob)
    node = services.node_enroll(token=token, hostname="box", agent_version="0.1.0").node
    before = node.engine_key_next
    url = reverse("marketplace:engine_key_rotate", args=[node.pk])
    client.force_login(mallory)
    assert client.post(url).status_code == 404
    assert not services.node_engine_key_rotate(node_id=node.pk, owner=mallory)
    node.refresh_from_db()
    assert node.engine_key_next == before
    client.force_login(bob)
    assert client.get(url).status_code == 405
    response = client.post(url)
    assert response.status_code == 302 and response["Location"].endswith("#engine-key")
    node.refresh_from_db()
    assert node.engine_key_next != before
    page = client.get(reverse("marketplace:node_edit", args=[node.pk]))
    assert b"Rotate engine key" in page.content
    assert engine_keys.unseal(node.engine_key_next).encode() not in page.content


def test_keys_sealed_under_an_old_secret_are_replaced(api, bob, settings):
    enrolled = enroll(api, bob)
    fingerprint = engine_keys.fingerprint(enrolled["engine_key"])
    beat(api, enrolled["credential"], report(engine=engine(key_held=fingerprint,
                                                           key_fingerprint=fingerprint)))
    # As after a change of SECRET_KEY: the stored key cannot be read any more.
    real_secret = settings.SECRET_KEY
    settings.SECRET_KEY = "the secret key the platform had before, long enough to be one"
    Node.objects.filter(pk=enrolled["node_id"]).update(
        engine_key_sealed=engine_keys.seal(enrolled["engine_key"]))
    settings.SECRET_KEY = real_secret
    answer = beat(api, enrolled["credential"], report(engine=engine(
        key_held=fingerprint, key_fingerprint=fingerprint))).json()
    node = Node.objects.get(pk=enrolled["node_id"])
    assert answer["engine_key"]["key"] == engine_keys.unseal(node.engine_key_next)
    assert answer["engine_key"]["key"] != enrolled["engine_key"]
