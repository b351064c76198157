"""Rentals are charged per second from the renter's prepaid balance; the provider earns the
price less the platform fee; offline time is not charged; at zero the rental stops itself."""

from datetime import UTC, datetime, timedelta

import pytest

from billing import ledger
from billing.models import Account, Transfer
from marketplace import services, uptime
from marketplace.models import Node, NodeStatusChange, Rental
from tests.factories import NodeFactory, listed_card

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 2, 10, 0, tzinfo=UTC)
PRICE = 3_600_000  # $3.60 an hour: 1,000 micro-dollars a second


def wallet(user):
    return ledger.balance(Account.Kind.WALLET, user.pk)


def earnings(user):
    return ledger.balance(Account.Kind.EARNINGS, user.pk)


@pytest.fixture
def rented(alice, bob, fund):
    fund(alice, 10_000_000)
    card = listed_card(node=NodeFactory(owner=bob), listing__price_per_hour_micros=PRICE)
    NodeStatusChange.objects.create(node=card.node, status="online", at=T0 - timedelta(days=1))
    return services.rental_start(renter=alice, card_id=card.pk, now=T0)


def test_charged_per_second_and_provider_earns_price_less_fee(rented, alice, bob, settings):
    settings.RIGSHARE_PLATFORM_FEE_BPS = 1500
    services.rental_charge(rental_id=rented.pk, now=T0 + timedelta(seconds=90))
    rented.refresh_from_db()
    assert rented.billed_seconds == 90 and rented.charged_micros == 90_000
    assert wallet(alice) == 10_000_000 - 90_000
    assert earnings(bob) == 76_500  # 85% of 90,000
    assert ledger.balance(Account.Kind.PLATFORM_REVENUE) == 13_500


def test_charging_is_idempotent_per_interval_and_never_drifts(rented, alice):
    for second in range(1, 8):
        when = T0 + timedelta(seconds=second * 7 + 0.4)
        services.rental_charge(rental_id=rented.pk, now=when)
        services.rental_charge(rental_id=rented.pk, now=when)  # a retried task
    rented.refresh_from_db()
    assert rented.billed_seconds == 49
    assert rented.charged_micros == 49_000 == 10_000_000 - wallet(alice)
    assert Transfer.objects.filter(kind="rental").count() == 7


def test_offline_time_is_not_charged_and_is_shown(rented, alice, client):
    node = rented.card.node
    NodeStatusChange.objects.create(node=node, status="offline", at=T0 + timedelta(seconds=100))
    NodeStatusChange.objects.create(node=node, status="online", at=T0 + timedelta(seconds=400))
    services.rental_charge(rental_id=rented.pk, now=T0 + timedelta(seconds=600))
    rented.refresh_from_db()
    assert rented.offline_seconds == 300 and rented.billed_seconds == 300
    assert rented.charged_micros == 300_000
    client.force_login(alice)
    assert "5 min 00 s offline, not charged" in client.get("/rentals/").content.decode()


def test_stop_charges_up_to_the_stop(rented, alice):
    services.rental_stop(rental_id=rented.pk, renter=alice, now=T0 + timedelta(seconds=61))
    rented.refresh_from_db()
    assert rented.charged_micros == 61_000 and rented.charged_until == rented.stopped_at
    assert services.rentals_charge(now=T0 + timedelta(hours=5)) == 0
    rented.refresh_from_db()
    assert rented.charged_micros == 61_000


def test_rental_stops_itself_when_the_balance_runs_out(rented, alice, bob):
    services.rental_charge(rental_id=rented.pk, now=T0 + timedelta(hours=4))
    rented.refresh_from_db()
    assert wallet(alice) == 0
    assert rented.stop_reason == Rental.StopReason.BALANCE
    assert rented.charged_micros == 10_000_000 and rented.billed_seconds == 10_000
    assert rented.stopped_at == T0 + timedelta(seconds=10_000)
    assert earnings(bob) > 0


def test_renter_is_warned_when_balance_covers_less_than_ten_minutes(rented, alice, client):
    client.force_login(alice)
    assert "less than 10 minutes" not in client.get("/rentals/").content.decode()
    services.rental_charge(rental_id=rented.pk, now=T0 + timedelta(seconds=9_700))
    html = client.get("/rentals/").content.decode()
    assert "less than 10 minutes" in html
    assert "less than 10 minutes" in client.get(f"/cards/{rented.card_id}/").content.decode()


def test_rent_needs_ten_minutes_of_balance(mallory):
    card = listed_card(listing__price_per_hour_micros=PRICE)
    with pytest.raises(services.RentalRefused, match="Top up"):
        services.rental_start(renter=mallory, card_id=card.pk)
    assert not Rental.objects.exists()


def test_the_beat_task_charges_every_active_rental(rented, alice, fund):
    other = services.rental_start(renter=fund(alice), card_id=listed_card(
        listing__price_per_hour_micros=PRICE).pk, now=T0)
    assert services.rentals_charge(now=T0 + timedelta(seconds=30)) == 2
    for rental in (rented, other):
        rental.refresh_from_db()
        assert rental.charged_micros == 30_000


def test_offline_seconds_arithmetic():
    changes = [(T0 + timedelta(seconds=10), "offline"), (T0 + timedelta(seconds=25), "online"),
               (T0 + timedelta(seconds=50), "offline")]
    assert uptime.offline_seconds(changes, status_at_start="online", start=T0,
                                  end=T0 + timedelta(seconds=60)) == 25
    assert uptime.offline_seconds([], status_at_start="offline", start=T0,
                                  end=T0 + timedelta(seconds=60)) == 60
    assert uptime.offline_seconds(changes, status_at_start="online",
                                  start=T0 + timedelta(seconds=30),
                                  end=T0 + timedelta(seconds=40)) == 0


def test_node_status_at_start_comes_from_history(rented):
    Node.objects.filter(pk=rented.card.node_id).update(status="online")
    NodeStatusChange.objects.create(node=rented.card.node, status="offline",
                                    at=T0 - timedelta(seconds=5))
    services.rental_charge(rental_id=rented.pk, now=T0 + timedelta(seconds=20))
    rented.refresh_from_db()
    assert rented.billed_seconds == 0 and rented.offline_seconds == 20
