import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from marketplace import services
from marketplace.models import Card, Node, Rental
from tests.factories import NodeFactory, UserFactory, listed_card

pytestmark = pytest.mark.django_db


def test_rent_until_stopped_records_exact_start_and_stop(alice, fund):
    fund(alice)
    card = listed_card(listing__price_per_hour_micros=1_250_000)
    start = timezone.now()
    rental = services.rental_start(renter=alice, card_id=card.pk, now=start)
    assert rental.started_at == start and rental.ends_at is None and rental.is_active
    assert rental.price_per_hour_micros == 1_250_000
    stop = start + timedelta(seconds=61, microseconds=5)
    services.rental_stop(rental_id=rental.pk, renter=alice, now=stop)
    rental.refresh_from_db()
    assert rental.stopped_at == stop and rental.stop_reason == "requested"
    assert rental.elapsed_seconds() == 61
    # Stopping twice changes nothing.
    services.rental_stop(rental_id=rental.pk, renter=alice, now=stop + timedelta(hours=1))
    rental.refresh_from_db()
    assert rental.stopped_at == stop


def test_rent_for_hours_ends_at_exactly_the_booked_time(alice, fund):
    fund(alice)
    card = listed_card()
    start = timezone.now()
    rental = services.rental_start(renter=alice, card_id=card.pk, hours=3, now=start)
    assert rental.ends_at == start + timedelta(hours=3)
    assert services.rentals_end_due(now=start + timedelta(hours=2)) == 0
    assert services.rentals_end_due(now=start + timedelta(hours=3, minutes=7)) == 1
    rental.refresh_from_db()
    assert rental.stopped_at == start + timedelta(hours=3) and rental.stop_reason == "expired"


@pytest.mark.parametrize("setup, message", [
    (lambda card, alice: card.listing.__class__.objects.filter(pk=card.listing.pk).update(
        is_listed=False, price_per_hour_micros=0), "not for rent"),
    (lambda card, alice: Node.objects.filter(pk=card.node_id).update(
        status=Node.Status.OFFLINE), "offline"),
    (lambda card, alice: Node.objects.filter(pk=card.node_id).update(owner=alice),
     "your own card"),
    (lambda card, alice: Node.objects.filter(pk=card.node_id).update(needs_review=True),
     "under review"),
])
def test_rent_refusals(alice, fund, setup, message):
    fund(alice)
    card = listed_card()
    setup(card, alice)
    with pytest.raises(services.RentalRefused, match=message):
        services.rental_start(renter=alice, card_id=card.pk)
    assert not Rental.objects.exists()


def test_second_renter_is_refused_while_the_card_is_rented(alice, carol, fund):
    fund(alice)
    fund(carol)
    card = listed_card()
    services.rental_start(renter=alice, card_id=card.pk)
    with pytest.raises(services.RentalRefused, match="Someone else"):
        services.rental_start(renter=carol, card_id=card.pk)


def _rent_at_once(card, renters) -> list:
    barrier = threading.Barrier(len(renters))
    results: list = []

    def rent(user):
        try:
            barrier.wait()
            results.append(services.rental_start(renter=user, card_id=card.pk))
        except services.RentalRefused as exc:
            results.append(exc)
        finally:
            connection.close()  # each thread has its own; leave none behind

    threads = [threading.Thread(target=rent, args=(u,)) for u in renters]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


@pytest.mark.django_db(transaction=True)
def test_two_renters_at_once_exactly_one_wins(fund):
    """Real threads on PostgreSQL, released together by a barrier, several rounds."""
    for _ in range(5):
        card = listed_card()
        renters = [fund(UserFactory()) for _ in range(8)]
        results = _rent_at_once(card, renters)
        wins = [r for r in results if isinstance(r, Rental)]
        losses = [r for r in results if isinstance(r, services.RentalRefused)]
        assert len(wins) == 1 and len(losses) == len(renters) - 1
        assert all("Someone else has just rented" in str(e) for e in losses)
        assert Rental.objects.filter(card=card, stopped_at__isnull=True).count() == 1


def test_rent_page_and_flow_through_the_web(client, alice, bob, fund):
    fund(alice)
    card = listed_card(node=NodeFactory(owner=bob), listing__claimed_gpu_model="RTX 4090 24GB",
                       listing__price_per_hour_micros=450_000)
    page = client.get(f"/cards/{card.pk}/")
    html = page.content.decode()
    assert page.status_code == 200
    for text in ["24564 MiB", "8.9", "Gen 4 x16", "450 W", card.public_id, "RTX 4090 24GB",
                 "$0.45/h", "Log in to rent", 'class="uptime"']:
        assert text in html
    assert card.uuid not in html  # a competitor must not be able to copy it
    client.force_login(alice)
    assert "rent-button" in client.get(f"/cards/{card.pk}/").content.decode()
    response = client.post(f"/cards/{card.pk}/rent/", {"mode": "hours", "hours": "2"},
                           follow=True)
    assert response.redirect_chain[-1][0] == "/rentals/"
    rental = Rental.objects.get(card=card, renter=alice)
    assert rental.ends_at - rental.started_at == timedelta(hours=2)
    assert f'data-rental="{rental.pk}"' in response.content.decode()
    assert "rented right now" not in client.get(f"/cards/{card.pk}/").content.decode()
    client.post(f"/rentals/{rental.pk}/stop/")
    rental.refresh_from_db()
    assert rental.stopped_at is not None
    past = client.get("/rentals/").context["past"]
    assert [r.pk for r in past] == [rental.pk]


def test_rent_form_errors_are_shown(client, alice, fund):
    fund(alice)
    card = listed_card()
    client.force_login(alice)
    response = client.post(f"/cards/{card.pk}/rent/", {"mode": "hours"}, follow=True)
    assert "How many hours?" in response.content.decode()
    response = client.post(f"/cards/{card.pk}/rent/", {"mode": "hours", "hours": "0"},
                           follow=True)
    assert "greater than or equal to 1" in response.content.decode()
    assert not Rental.objects.exists()


def test_losing_renter_sees_a_clear_message(client, alice, carol, fund):
    fund(alice)
    fund(carol)
    card = listed_card()
    services.rental_start(renter=alice, card_id=card.pk)
    client.force_login(carol)
    response = client.post(f"/cards/{card.pk}/rent/", {"mode": "until_stopped"}, follow=True)
    assert "Someone else has just rented this card." in response.content.decode()


def test_mallory_cannot_see_or_stop_someone_elses_rental(client, alice, mallory, fund):
    fund(alice)
    rental = services.rental_start(renter=alice, card_id=listed_card().pk)
    client.force_login(mallory)
    assert client.post(f"/rentals/{rental.pk}/stop/").status_code == 404
    assert client.get("/rentals/").context["active"] == []
    rental.refresh_from_db()
    assert rental.is_active


def test_rental_pages_need_login(client):
    card = listed_card()
    assert client.get("/rentals/").status_code == 302
    assert client.post(f"/cards/{card.pk}/rent/", {"mode": "until_stopped"}).status_code == 302
    assert not Rental.objects.exists()


def test_a_flagged_card_is_rented_only_once_the_renter_confirms_its_findings(
        client, alice, fund):
    fund(alice)
    card = listed_card()
    Card.objects.filter(pk=card.pk).update(verification_status=Card.Verification.FLAGGED)
    client.force_login(alice)
    page = client.get(f"/cards/{card.pk}/").content.decode()
    assert 'id="flagged-warning"' in page and 'name="accept_flagged"' in page
    # Without the confirmation (a browser without `required`, a script): refused, nothing rented.
    response = client.post(f"/cards/{card.pk}/rent/", {"mode": "until_stopped"}, follow=True)
    assert "Verification flagged this card" in response.content.decode()
    assert not Rental.objects.exists()
    with pytest.raises(services.FlaggedCardNotAccepted):
        services.rental_start(renter=alice, card_id=card.pk)
    client.post(f"/cards/{card.pk}/rent/", {"mode": "until_stopped", "accept_flagged": "on"})
    assert Rental.objects.get().card_id == card.pk


def test_a_flagged_card_is_rented_through_the_api_only_with_accept_flagged(alice, fund):
    from rest_framework.test import APIClient

    fund(alice)
    card = listed_card()
    Card.objects.filter(pk=card.pk).update(verification_status=Card.Verification.FLAGGED)
    api = APIClient()
    api.force_authenticate(alice)
    refused = api.post("/api/rentals/", {"card": card.pk}, format="json")
    assert refused.status_code == 400 and "flagged" in refused.json()["card"][0]
    assert api.post("/api/rentals/", {"card": card.pk, "accept_flagged": True},
                    format="json").status_code == 201
    # An unflagged card needs no confirmation.
    other = listed_card()
    assert api.post("/api/rentals/", {"card": other.pk}, format="json").status_code == 201
