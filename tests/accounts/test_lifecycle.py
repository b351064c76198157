"""The account's whole life: the holder's data download and the account's closure."""

import json

import pytest
from allauth.account.models import EmailAddress
from allauth.mfa.models import Authenticator
from django.test import Client

from accounts.models import PersonalToken, User
from accounts.services import personal_token_create
from billing import keys, ledger, selectors, services
from billing.models import Account, ApiKey, Entry, Payout, PayoutDestination, Transfer
from marketplace.models import Listing, Node
from tests.factories import NodeFactory, RentalFactory, listed_card

pytestmark = pytest.mark.django_db
USD = 1_000_000


def grant(user, micros, key=None):
    services.credits_grant(user=user, amount_micros=micros,
                           idempotency_key=key or f"grant:{user.pk}:{micros}")


def earn(provider, payer, micros, key="rent:1"):
    grant(payer, micros, key=f"g:{key}")
    services.time_charge(payer_id=payer.pk, provider_id=provider.pk, amount_micros=micros,
                         idempotency_key=key, reference="rental:1")


def test_the_data_download_holds_the_holders_data_and_no_one_elses(client, alice, mallory):
    grant(alice, 7 * USD)
    keys.api_key_create(user=alice, name="alice's script", spend_limit_micros=USD)
    keys.api_key_create(user=mallory, name="mallory's script", spend_limit_micros=USD)
    _, secret = personal_token_create(user=alice, name="ci")
    card = listed_card(node__owner=alice, name="NVIDIA GeForce RTX 4090")
    RentalFactory(renter=alice, card=listed_card(), stopped_at=card.first_seen_at)
    client.force_login(alice)
    response = client.get("/accounts/data.json")
    assert response["Content-Type"] == "application/json"
    assert response["Content-Disposition"].startswith("attachment;")
    data = json.loads(response.content)
    assert data["account"]["email"] == alice.email
    assert data["account"]["email_addresses"] == [
        {"email": alice.email, "verified": True, "primary": True}]
    assert data["billing"]["balances_micros"]["wallet"] == 7 * USD
    assert [k["name"] for k in data["billing"]["api_keys"]] == ["alice's script"]
    assert [t["name"] for t in data["account"]["rest_tokens"]] == ["ci"]
    assert data["marketplace"]["machines"][0]["cards"][0]["gpu"] == "NVIDIA GeForce RTX 4090"
    assert len(data["marketplace"]["rentals"]) == 1
    text = response.content.decode()
    assert "mallory" not in text and secret not in text  # nobody else's, and no secret
    assert client.post("/accounts/data.json").status_code == 405


def test_an_account_closes_anonymized_with_its_ledger_intact(client, alice, carol, mailoutbox):
    grant(alice, 3 * USD)
    key, token = keys.api_key_create(user=alice, name="k", spend_limit_micros=USD)
    personal_token_create(user=alice, name="ci")
    node = NodeFactory(owner=alice)
    listed_card(node=node)
    PayoutDestination.objects.create(provider=alice, method="paypal", holder_name="Alice",
                                     paypal_email="alice@example.com")
    entries_before = Entry.objects.count()
    client.force_login(alice)
    page = client.get("/accounts/close/").content.decode()
    assert 'id="close-credit"' in page and "$3.00" in page

    # The credit must be given up knowingly, and the address typed.
    refused = client.post("/accounts/close/", {"confirm_email": alice.email})
    assert "confirm that you give it up" in refused.content.decode()
    refused = client.post("/accounts/close/", {"confirm_email": "wrong@example.com",
                                               "give_up_credit": "on"})
    assert "not your account" in refused.content.decode()
    assert User.objects.get(pk=alice.pk).is_active

    done = client.post("/accounts/close/", {"confirm_email": alice.email,
                                            "give_up_credit": "on"})
    assert done.status_code == 302
    assert "_auth_user_id" not in client.session
    closed = User.objects.get(pk=alice.pk)
    assert closed.email == f"closed-{alice.pk}@closed.invalid" and not closed.is_active
    assert closed.closed_at and not closed.has_usable_password()
    assert not EmailAddress.objects.filter(user=closed).exists()
    assert not PayoutDestination.objects.filter(provider=closed).exists()
    assert not Authenticator.objects.filter(user=closed).exists()
    assert not PersonalToken.objects.filter(user=closed, revoked_at__isnull=True).exists()
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert keys.api_key_authenticate(token) is None
    assert Node.objects.get(pk=node.pk).credential_revoked_at is not None
    assert not Listing.objects.filter(card__node=node, is_listed=True).exists()
    # The books: nothing deleted, the credit moved to the platform by a transfer of its own.
    assert Entry.objects.count() == entries_before + 2
    forfeit = Transfer.objects.get(kind=Transfer.Kind.FORFEIT)
    assert forfeit.reference == f"user:{alice.pk}"
    assert ledger.balance(Account.Kind.WALLET, alice.pk) == 0
    assert selectors.ledger_problems() == []
    # The holder was told at the address they had.
    assert mailoutbox[-1].to == ["alice@example.com"]
    assert "closed" in mailoutbox[-1].subject
    # Nobody logs in to it again, with the old address or the new.
    for email in ["alice@example.com", closed.email]:
        response = Client().post("/accounts/login/", {"login": email,
                                                      "password": "correct horse battery"})
        assert response.status_code == 200


@pytest.mark.parametrize("situation, message", [
    ("renting", "You are renting a card"),
    ("rented", "Someone is renting one of your cards"),
    ("earnings", "unpaid earnings"),
    ("payout", "A payout you requested awaits review"),
])
def test_closure_is_refused_while_a_rental_runs_or_money_is_owed(
        client, alice, carol, situation, message, settings):
    settings.RIGSHARE_MIN_PAYOUT_MICROS = USD
    if situation == "renting":
        RentalFactory(renter=alice)
    elif situation == "rented":
        RentalFactory(card=listed_card(node__owner=alice), renter=carol)
    elif situation == "earnings":
        earn(alice, carol, 10 * USD)
    else:
        earn(alice, carol, 10 * USD)
        Payout.objects.create(provider=alice, amount_micros=8 * USD, destination="x")
    client.force_login(alice)
    page = client.get("/accounts/close/").content.decode()
    assert message in page and 'id="close-problems"' in page
    response = client.post("/accounts/close/", {"confirm_email": alice.email,
                                                "give_up_credit": "on"})
    assert message in response.content.decode()
    assert User.objects.get(pk=alice.pk).is_active and User.objects.get(pk=alice.pk).email == \
        alice.email


def test_nobody_closes_anothers_account(client, alice, mallory):
    client.force_login(mallory)
    client.post("/accounts/close/", {"confirm_email": alice.email})
    assert User.objects.get(pk=alice.pk).is_active
    assert User.objects.get(pk=mallory.pk).is_active  # her own address was not typed
    assert Client().get("/accounts/close/").status_code == 302
