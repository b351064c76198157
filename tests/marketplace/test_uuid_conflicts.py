"""GPU identity a competitor cannot hijack: a UUID reported by a second node flags the
newcomer only, keeps the incumbent listed, clears itself, and is never published in full."""

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace import selectors, services
from marketplace.models import Card, Node, UuidConflict
from tests.factories import UserFactory
from tests.marketplace.test_agent_api import H200, beat, enroll, report

pytestmark = pytest.mark.django_db

OTHER_UUID = "GPU-99999999-8888-7777-6666-555555555555"


def listed(node_id, owner):
    card = Card.objects.get(node_id=node_id)
    services.listing_update(owner=owner, card_id=card.pk, is_listed=True,
                            price_per_hour_micros=2_000_000)
    return card


@pytest.fixture
def incumbent(api, bob):
    node = enroll(api, bob, "honest")
    assert beat(api, node["credential"], report()).status_code == 200
    listed(node["node_id"], bob)
    return node


@pytest.fixture
def thief(api, mallory, incumbent):
    node = enroll(api, mallory, "thief")
    assert beat(api, node["credential"], report()).status_code == 200
    listed(node["node_id"], mallory)
    return node


def catalog_nodes():
    return {card.node_id for card in selectors.cards_for_catalog({})}


def test_the_newcomer_is_flagged_and_kept_out_the_incumbent_stays_listed(api, incumbent, thief):
    for _ in range(3):  # both keep heartbeating: the incumbent is never dragged in
        beat(api, incumbent["credential"], report())
        beat(api, thief["credential"], report())
    assert Node.objects.get(pk=thief["node_id"]).uuid_conflict
    assert not Node.objects.get(pk=incumbent["node_id"]).held_out
    assert catalog_nodes() == {incumbent["node_id"]}
    conflict = UuidConflict.objects.get()
    assert (conflict.node_id, conflict.incumbent_id, conflict.closed_at) == (
        thief["node_id"], incumbent["node_id"], None)


def test_a_newcomer_cannot_be_rented(api, alice, thief):
    card = Card.objects.get(node_id=thief["node_id"])
    with pytest.raises(services.RentalRefused, match="under review"):
        services.rental_start(renter=alice, card_id=card.pk)


def test_the_flag_clears_itself_when_the_newcomer_stops_and_the_history_stays(
        api, incumbent, thief):
    gpu = dict(H200, uuid=OTHER_UUID)
    beat(api, thief["credential"], report(gpus=[gpu]))
    thief_node = Node.objects.get(pk=thief["node_id"])
    assert not thief_node.uuid_conflict
    conflict = UuidConflict.objects.get()
    assert conflict.closed_at is not None and "no longer reports" in conflict.closed_because
    assert catalog_nodes() == {incumbent["node_id"], thief["node_id"]}


def test_the_incumbent_letting_go_of_the_uuid_clears_the_newcomer(api, incumbent, thief):
    """The documented rule: the UUID passes on when its first node stops reporting it (the GPU
    was moved), is removed by its owner, or has been silent for a week."""
    beat(api, incumbent["credential"], report(gpus=[dict(H200, uuid=OTHER_UUID)]))
    beat(api, thief["credential"], report())
    assert not Node.objects.get(pk=thief["node_id"]).uuid_conflict
    assert "no longer holds it" in UuidConflict.objects.get().closed_because


def test_a_removed_incumbent_lets_go(api, bob, incumbent, thief):
    services.node_revoke(owner=bob, node_id=incumbent["node_id"])
    beat(api, thief["credential"], report())
    assert not Node.objects.get(pk=thief["node_id"]).uuid_conflict


def test_an_incumbent_offline_for_a_week_lets_go_and_reclaims_when_back(api, incumbent, thief):
    Node.objects.filter(pk=incumbent["node_id"]).update(
        last_heartbeat_at=timezone.now() - services.UUID_RELEASE_AFTER - timedelta(hours=1))
    beat(api, thief["credential"], report())
    assert not Node.objects.get(pk=thief["node_id"]).uuid_conflict
    # Back again, it reported the GPU first: the other is the newcomer once more.
    beat(api, incumbent["credential"], report())
    beat(api, thief["credential"], report())
    assert Node.objects.get(pk=thief["node_id"]).uuid_conflict
    assert not Node.objects.get(pk=incumbent["node_id"]).held_out
    assert UuidConflict.objects.filter(closed_at__isnull=True).count() == 1
    assert UuidConflict.objects.count() == 2


def test_a_brief_outage_of_the_incumbent_changes_nothing(api, incumbent, thief):
    Node.objects.filter(pk=incumbent["node_id"]).update(
        status=Node.Status.OFFLINE, last_heartbeat_at=timezone.now() - timedelta(hours=6))
    beat(api, thief["credential"], report())
    assert Node.objects.get(pk=thief["node_id"]).uuid_conflict


def test_no_page_or_api_shows_a_full_uuid_to_the_public(client, api, bob, incumbent):
    card = Card.objects.get(node_id=incumbent["node_id"])
    page = client.get(f"/cards/{card.pk}/").content.decode()
    assert H200["uuid"] not in page and card.public_id in page
    assert card.public_id.startswith("gpu-") and len(card.public_id) == 16
    listing = api.get("/api/cards/").content.decode() + api.get(
        f"/api/cards/{card.pk}/").content.decode()
    assert H200["uuid"] not in listing
    client.force_login(UserFactory(email="renter@example.com"))
    assert H200["uuid"] not in client.get(f"/cards/{card.pk}/").content.decode()
    client.force_login(bob)
    assert H200["uuid"] in client.get(f"/cards/{card.pk}/").content.decode()
    client.force_login(UserFactory(email="staff@example.com", is_staff=True, two_factor=True))
    assert H200["uuid"] in client.get(f"/cards/{card.pk}/").content.decode()


def test_a_providers_email_is_shown_to_them_and_staff_only(client, bob, incumbent):
    card = Card.objects.get(node_id=incumbent["node_id"])
    page = client.get(f"/cards/{card.pk}/").content.decode()
    assert "bob@example.com" not in page and f"Provider #{bob.pk}" in page
    client.force_login(UserFactory(email="renter@example.com"))
    assert "bob@example.com" not in client.get(f"/cards/{card.pk}/").content.decode()
    client.force_login(bob)
    assert "bob@example.com" in client.get(f"/cards/{card.pk}/").content.decode()


def test_both_owners_are_told_on_their_dashboards(client, bob, mallory, incumbent, thief):
    client.force_login(bob)
    html = client.get("/provider/").content.decode()
    assert "Another machine reports the UUID" in html and "stays listed" in html
    client.force_login(mallory)
    html = client.get("/provider/").content.decode()
    assert "was reported first by another machine" in html and "kept out" in html
    # Neither learns the other's identity from it.
    assert "honest" not in html
