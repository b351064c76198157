"""Cooling-off before a provider's money leaves (billing/payout_holds.py): a payout waits after
a change a thief makes first (the destination, two-factor turned on) and when it is the
account's first; earnings paid from card credit that can still be disputed cannot be
requested. Real ledger, real metering, the test-card gateway for card payments."""

import uuid
from datetime import timedelta

import pytest
from allauth.mfa.models import Authenticator
from django.utils import timezone

from billing import keys, payout_holds, services
from billing.gateway import SUCCEEDS
from billing.metering import Worker
from billing.models import Payment, Payout, PayoutDestination
from tests.billing.test_pages import USD, grant, price, spend
from tests.factories import UserFactory

pytestmark = [pytest.mark.django_db, pytest.mark.payout_holds]

DAY = timedelta(days=1)


@pytest.fixture
def operator(db):
    return UserFactory(email="ops@example.com", is_staff=True, is_superuser=True, two_factor=True)


@pytest.fixture
def holds(settings):
    settings.RIGSHARE_MIN_PAYOUT_MICROS = 1 * USD
    settings.RIGSHARE_PAYOUT_HOLD_AFTER_DESTINATION_H = 72
    settings.RIGSHARE_PAYOUT_HOLD_AFTER_TWO_FACTOR_H = 48
    settings.RIGSHARE_PAYOUT_HOLD_FIRST_H = 168
    settings.RIGSHARE_CARD_DISPUTE_WINDOW_DAYS = 120
    price(input_per_mtok=1_000_000, output_per_mtok=0)  # $1 per million prompt tokens


def served(renter, provider, usd: int) -> None:
    """`renter` spends `usd` on requests `provider` serves (the provider earns 85%)."""
    key, _ = keys.api_key_create(user=renter, name=f"k{uuid.uuid4().hex[:6]}", by_operator=True)
    spend(key, prompt=usd * 1_000_000, completion=0,
          worker=Worker(provider_id=provider.pk, reference="card:1"))


def bought(user, usd: int, *, days_ago: int = 0) -> Payment:
    payment = services.payment_create(user=user, amount_micros=usd * USD,
                                      idempotency_key=uuid.uuid4().hex, card_number=SUCCEEDS)
    assert payment.status == Payment.Status.SUCCEEDED
    if days_ago:
        Payment.objects.filter(pk=payment.pk).update(
            succeeded_at=timezone.now() - days_ago * DAY)
    return payment


def settled_in(provider, *, destination_days=40, two_factor_days=40, paid_before=True):
    """A provider whose destination and two-factor are that old, paid out before."""
    services.payout_destination_set(provider=provider, method="paypal", holder_name="Bob",
                                    paypal_email="bob@example.com")
    PayoutDestination.objects.filter(provider=provider).update(
        updated_at=timezone.now() - destination_days * DAY)
    Authenticator.objects.filter(user=provider, type=Authenticator.Type.TOTP).update(
        created_at=timezone.now() - two_factor_days * DAY)
    if paid_before:
        Payout.objects.create(provider=provider, amount_micros=1, status=Payout.Status.PAID,
                              requested_at=timezone.now() - 60 * DAY)


def test_a_settled_account_is_paid_at_once(holds, bob, carol, operator):
    grant(carol, 100 * USD)
    served(carol, bob, 100)
    settled_in(bob)
    payout = services.payout_request(provider=bob, amount_micros=85 * USD)
    assert payout.held_until is None
    assert services.payout_decide(payout_id=payout.pk, operator=operator,
                                  approve=True).status == Payout.Status.PAID


@pytest.mark.parametrize("change, hours, because", [
    ({"destination_days": 0}, 72, "the payout destination changed on"),
    ({"two_factor_days": 0}, 48, "two-factor authentication was turned on"),
    ({"paid_before": False}, 168, "it is the account's first payout"),
])
def test_a_payout_after_a_thiefs_first_change_waits(holds, client, bob, carol, operator, change,
                                                     hours, because):
    grant(carol, 100 * USD)
    served(carol, bob, 100)
    settled_in(bob, **change)
    now = timezone.now()
    payout = services.payout_request(provider=bob, amount_micros=50 * USD)
    assert payout.held_until is not None and because in payout.held_because
    assert abs(payout.held_until - (now + timedelta(hours=hours))) < timedelta(minutes=1)
    with pytest.raises(services.BillingError, match="Held until"):
        services.payout_decide(payout_id=payout.pk, operator=operator, approve=True)
    # The operator's "Approve and pay" says so and pays nothing.
    client.force_login(operator)
    answer = client.post("/admin/billing/payout/", {
        "action": "approve_and_pay", "_selected_action": [payout.pk]}, follow=True)
    assert f"Payout #{payout.pk}: Held until" in answer.content.decode()
    assert Payout.objects.get(pk=payout.pk).status == Payout.Status.REQUESTED
    # Rejecting is never held; paying is, until the time is up.
    paid = services.payout_decide(payout_id=payout.pk, operator=operator, approve=True,
                                  now=payout.held_until + timedelta(seconds=1))
    assert paid.status == Payout.Status.PAID


def test_the_security_emails_say_how_long_the_money_waits(holds, bob, carol, mailoutbox,
                                                           django_capture_on_commit_callbacks):
    grant(carol, 100 * USD)
    served(carol, bob, 100)
    with django_capture_on_commit_callbacks(execute=True):
        settled_in(bob, paid_before=False)
        payout = services.payout_request(provider=bob, amount_micros=10 * USD)
    changed, requested = (m.body for m in mailoutbox[-2:])
    assert "A payout requested in the next 72 hours waits" in changed
    assert (f"It cannot be paid before {payout.held_until:%Y-%m-%d %H:%M} UTC: it is the "
            "account's first payout.") in requested


def test_the_longest_wait_wins_and_the_page_says_it(holds, client, bob, carol):
    grant(carol, 100 * USD)
    served(carol, bob, 100)
    settled_in(bob, destination_days=0, two_factor_days=0, paid_before=False)
    wait = payout_holds.payout_wait(bob)
    assert wait.because == "it is the account's first payout"
    client.force_login(bob)
    page = client.get("/billing/payouts/").content.decode()
    assert 'id="payout-wait"' in page and "it is the account&#x27;s first payout" in page
    assert client.post("/billing/payouts/", {"amount": "10"}).status_code == 302
    page = client.get("/billing/payouts/").content.decode()
    held = Payout.objects.get(provider=bob)
    assert f'{held.held_until:%Y-%m-%d %H:%M}</span>' in page


def test_earnings_from_young_card_credit_cannot_be_requested(holds, client, bob, carol, alice):
    settled_in(bob)
    bought(carol, 100)
    served(carol, bob, 100)  # all of it from a card payment of today
    grant(alice, 100 * USD)
    served(alice, bob, 100)  # from a grant: nothing to dispute
    held = payout_holds.card_credit_held(bob.pk)
    assert held.amount_micros == 85 * USD and held.renters == 1
    assert abs(held.next_release - (timezone.now() + 120 * DAY)) < timedelta(minutes=1)
    with pytest.raises(services.BillingError, match=r"\$85.00 of your earnings were paid from "
                                                    r"card credit.*up to \$85.00 now"):
        services.payout_request(provider=bob, amount_micros=86 * USD)
    assert services.payout_request(provider=bob, amount_micros=85 * USD).amount_micros \
        == 85 * USD
    client.force_login(bob)
    page = client.get("/billing/payouts/").content.decode()
    assert '<dd id="card-hold">$85.00</dd>' in page and '<dd id="available">$0.00</dd>' in page
    # Past the dispute window it is the provider's to request.
    assert payout_holds.card_credit_held(bob.pk, now=timezone.now() + 121 * DAY).amount_micros \
        == 0


def test_a_wallet_spends_its_oldest_credit_first(holds, bob, carol):
    settled_in(bob)
    bought(carol, 100, days_ago=200)  # past the window: cannot be disputed any more
    bought(carol, 100)
    served(carol, bob, 100)  # the old payment's credit
    assert payout_holds.card_credit_held(bob.pk).amount_micros == 0
    served(carol, bob, 50)  # now the young one's: $50 of today's $150 of spending
    assert payout_holds.card_credit_held(bob.pk).amount_micros == 85 * USD * 150 // 100 // 3
    # What the wallet still holds is its newest credit: a grant after the card payment is
    # held back first, so the card credit it no longer holds was spent.
    grant(carol, 30 * USD)
    assert payout_holds.card_credit_held(bob.pk).amount_micros == 85 * USD * 150 // 100 // 3


def test_refunded_card_credit_holds_nothing_and_what_is_unspent_is_the_newest(holds, bob, carol, alice):
    settled_in(bob)
    bought(carol, 100)
    bought(carol, 100)
    served(carol, bob, 100)  # $100 of the wallet's $200 is still there: the newer payment
    assert payout_holds.card_credit_held(bob.pk).amount_micros == 85 * USD
    payment = bought(alice, 100)
    served(alice, bob, 40)
    Payment.objects.filter(pk=payment.pk).update(refunded_micros=100 * USD)
    # alice's payment was refunded: the credit is gone from the card's reach already.
    assert payout_holds.card_credit_held(bob.pk).amount_micros == 85 * USD


def test_rental_time_paid_from_young_card_credit_is_held_too(holds, bob, carol):
    settled_in(bob)
    bought(carol, 100)
    services.time_charge(payer_id=carol.pk, provider_id=bob.pk, amount_micros=40 * USD,
                         idempotency_key="rental:1:1", reference="rental:1")
    assert payout_holds.card_credit_held(bob.pk).amount_micros == 34 * USD
