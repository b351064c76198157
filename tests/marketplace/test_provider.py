"""The provider dashboard: machines, cards, listing, enrolment tokens; mallory refused."""

import re

import pytest

from marketplace import services
from marketplace.models import EnrolmentToken, Listing, Node
from tests.factories import CardFactory, ListingFactory, NodeFactory

pytestmark = pytest.mark.django_db


def bob_card(bob, **kwargs):
    card = CardFactory(node=NodeFactory(owner=bob, name="bobs-box"), **kwargs)
    ListingFactory(card=card, is_listed=False, price_per_hour_micros=0)
    return card


def test_add_machine_shows_token_once_with_the_exact_commands(client, bob, settings):
    settings.RIGSHARE_PUBLIC_URL = "https://rigshare.example"
    client.force_login(bob)
    html = client.post("/provider/machines/add/").content.decode()
    token = re.search(r'id="enrolment-token">(rse_[^<]+)<', html).group(1)
    assert (f"python -m agent enroll --platform https://rigshare.example --token {token}"
            in html)
    assert "python -m agent run --engine-url" in html
    row = EnrolmentToken.objects.get(owner=bob)
    assert token.split("_")[1] == row.prefix and token not in row.digest
    dashboard = client.get("/provider/").content.decode()
    assert token not in dashboard and f"rse_{row.prefix}_…" in dashboard
    assert client.get("/provider/machines/add/").status_code == 405


def test_dashboard_lists_my_machines_cards_status_and_listing(client, bob, mallory):
    card = bob_card(bob)
    NodeFactory(owner=mallory, name="mallorys-box")
    client.force_login(bob)
    html = client.get("/provider/").content.decode()
    assert "bobs-box" in html and "mallorys-box" not in html
    assert "Online" in html and "99.00%" in html and card.name in html
    assert '<td class="listed">no</td>' in html


def test_list_a_card_at_a_price(client, bob):
    card = bob_card(bob)
    client.force_login(bob)
    prefix = f"card{card.pk}"
    response = client.post(f"/provider/cards/{card.pk}/listing/", {
        f"{prefix}-is_listed": "on", f"{prefix}-price_per_hour": "1.25",
        f"{prefix}-claimed_gpu_model": "RTX 4090", f"{prefix}-claimed_vram_gb": "24",
    }, follow=True)
    listing = Listing.objects.get(card=card)
    assert listing.is_listed and listing.price_per_hour_micros == 1_250_000
    assert listing.claimed_vram_gb == 24
    html = response.content.decode()
    assert '<td class="listed">yes</td>' in html and "$1.25/h" in html


@pytest.mark.parametrize("price, error", [
    ("", "This field is required"),
    ("-1", "greater than or equal to 0"),
    ("abc", "Enter a number"),
    ("0", "above zero"),
])
def test_listing_form_errors_are_shown_and_change_nothing(client, bob, price, error):
    card = bob_card(bob)
    client.force_login(bob)
    prefix = f"card{card.pk}"
    response = client.post(f"/provider/cards/{card.pk}/listing/", {
        f"{prefix}-is_listed": "on", f"{prefix}-price_per_hour": price}, follow=True)
    assert error in response.content.decode()
    assert not Listing.objects.get(card=card).is_listed


def test_forms_never_set_hardware_facts(client, bob):
    card = bob_card(bob)
    client.force_login(bob)
    prefix = f"card{card.pk}"
    client.post(f"/provider/cards/{card.pk}/listing/", {
        f"{prefix}-price_per_hour": "1", f"{prefix}-memory_total_mib": "999999",
        "memory_total_mib": "999999", "name": "NVIDIA H200"})
    client.post(f"/provider/machines/{card.node_id}/", {
        "name": "renamed", "region": "eu-west", "driver_version": "1", "status": "offline"})
    card.refresh_from_db()
    node = card.node
    node.refresh_from_db()
    assert card.memory_total_mib == 24564 and card.name == "NVIDIA GeForce RTX 4090"
    assert (node.name, node.region, node.status) == ("renamed", "eu-west", "online")
    assert node.driver_version == ""


def test_revoke_enrolment_token(client, bob):
    row, token = services.enrolment_token_create(owner=bob)
    client.force_login(bob)
    client.post(f"/provider/enrolments/{row.pk}/revoke/")
    row.refresh_from_db()
    assert row.state() == "revoked"
    with pytest.raises(services.EnrolmentRefused):
        services.node_enroll(token=token, hostname="x", agent_version="0")


def test_remove_machine_refuses_its_agent_and_unlists_cards(client, bob):
    card = bob_card(bob)
    Listing.objects.filter(card=card).update(is_listed=True, price_per_hour_micros=1)
    client.force_login(bob)
    client.post(f"/provider/machines/{card.node_id}/remove/")
    node = Node.objects.get(pk=card.node_id)
    assert node.credential_revoked_at is not None and node.status == "offline"
    assert not Listing.objects.get(card=card).is_listed


def test_mallory_is_refused_on_every_provider_action(client, bob, mallory):
    card = bob_card(bob)
    row, _ = services.enrolment_token_create(owner=bob)
    client.force_login(mallory)
    prefix = f"card{card.pk}"
    assert client.post(f"/provider/cards/{card.pk}/listing/", {
        f"{prefix}-is_listed": "on", f"{prefix}-price_per_hour": "0.01"}).status_code == 404
    assert client.get(f"/provider/machines/{card.node_id}/").status_code == 404
    assert client.post(f"/provider/machines/{card.node_id}/",
                       {"name": "pwned", "region": "x"}).status_code == 404
    assert client.post(f"/provider/machines/{card.node_id}/remove/").status_code == 404
    client.post(f"/provider/enrolments/{row.pk}/revoke/")
    row.refresh_from_db()
    card.node.refresh_from_db()
    assert row.state() == "active" and card.node.name == "bobs-box"
    assert card.node.credential_revoked_at is None
    assert not Listing.objects.get(card=card).is_listed
    html = client.get("/provider/").content.decode()
    assert "bobs-box" not in html and row.prefix not in html


def test_unlisted_card_page_is_only_for_its_owner(client, bob, mallory):
    card = bob_card(bob)
    client.force_login(mallory)
    assert client.get(f"/cards/{card.pk}/").status_code == 404
    client.force_login(bob)
    assert "This is your card" in client.get(f"/cards/{card.pk}/").content.decode()


def test_provider_pages_need_login(client, bob):
    card = bob_card(bob)
    for url in ["/provider/", f"/provider/machines/{card.node_id}/"]:
        assert client.get(url).status_code == 302
    assert client.post("/provider/machines/add/").status_code == 302
    assert not EnrolmentToken.objects.exists()


def test_dashboard_says_per_card_verification_rental_utilization_and_a_price_hint(
        client, bob, alice, mallory, fund, django_assert_max_num_queries):
    from datetime import timedelta

    from django.utils import timezone

    from marketplace.models import Card, Rental
    from tests.factories import listed_card

    now = timezone.now()
    mine = bob_card(bob, name="NVIDIA GeForce RTX 4090", first_seen_at=now - timedelta(days=60))
    Card.objects.filter(pk=mine.pk).update(verification_status="flagged",
                                           verification_problems=2)
    # Rented 3 of the last 30 days before, and rented now for an hour: 3 d 1 h of 30 d.
    Rental.objects.create(card=mine, renter=alice, price_per_hour_micros=1,
                          started_at=now - timedelta(days=10),
                          stopped_at=now - timedelta(days=7))
    Rental.objects.create(card=mine, renter=alice, price_per_hour_micros=1,
                          started_at=now - timedelta(hours=1))
    # Comparable: two verified 4090s of others at $0.40 and $0.60; an unverified one and a
    # card of bob's own do not count.
    for price, status, owner in ((400_000, "verified", mallory), (600_000, "verified", alice),
                                 (100_000, "unverified", alice), (50_000, "verified", bob)):
        other = listed_card(node=NodeFactory(owner=owner), name="NVIDIA GeForce RTX 4090",
                            listing__price_per_hour_micros=price)
        Card.objects.filter(pk=other.pk).update(verification_status=status)
    client.force_login(bob)
    html = client.get("/provider/").content.decode()
    row = re.search(rf'<tr data-card="{mine.pk}">.*?</tr>', html, re.S).group(0)
    assert "mismatch found" in row and "2 findings" in row
    assert "yes, since" in row
    assert '<td class="utilization">10%</td>' in row  # 73 h of 720 h
    assert "comparable: $0.50/h, the median of 2 verified NVIDIA GeForce RTX 4090 cards" in row
    assert "Earned, last 30 days" in html
    # A constant number of queries, whatever the number of machines and cards.
    with django_assert_max_num_queries(20) as few:
        client.get("/provider/")
    for _ in range(5):
        bob_card(bob)
    with django_assert_max_num_queries(len(few.captured_queries)):
        client.get("/provider/")
