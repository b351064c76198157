"""The operators' billing admin: every model has pages, ledger rows cannot be changed or
deleted, credit grants and payout decisions go through the services."""

import re

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import Permission

from billing import keys, ledger, selectors, services
from billing.gateway import get_gateway
from billing.metering import Worker
from billing.models import Account, ApiKey, Entry, ModelPrice, Payout, Transfer
from tests.billing.test_pages import MODEL, USD, grant, price, spend
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(db):
    return UserFactory(email="ops@example.com", is_staff=True, is_superuser=True, two_factor=True)


@pytest.fixture
def earning_bob(bob, carol):
    """bob has $85 of earnings: carol's $100 request served on bob's card."""
    price(input_per_mtok=100 * USD, output_per_mtok=0)
    grant(carol, 1000 * USD)
    key, _ = keys.api_key_create(user=carol, name="k")
    spend(key, prompt=1_000_000, completion=0, worker=Worker(provider_id=bob.pk,
                                                             reference="node:1"))
    services.payout_destination_set(provider=bob, method="bank", holder_name="Bob",
                                     iban="DE89 3704 0044 0532 0130 00")
    return bob


def _earnings(user) -> int:
    return selectors.user_balances(user.pk)[Account.Kind.EARNINGS]


def test_every_billing_model_has_admin_pages_that_load(client, operator, earning_bob, carol):
    client.force_login(operator)
    topup_payment = services.payment_create(user=carol, amount_micros=5 * USD,
                                            card_number="4242424242424242",
                                            idempotency_key="admin-test")
    assert topup_payment.status == "succeeded"
    refund = get_gateway().event("payment.refunded", topup_payment.gateway_ref,
                                 amount_micros=USD)  # a GatewayEvent row, a reversal
    services.webhook_handle(body=refund["body"], headers=refund["headers"])
    services.payout_request(provider=earning_bob, amount_micros=20 * USD)
    capped, _ = keys.api_key_create(user=carol, name="capped", spend_limit_micros=1000 * USD)
    spend(capped, prompt=10, completion=0)  # a KeySpend row
    for model in apps.get_app_config("billing").get_models():
        assert model in admin.site._registry, f"{model.__name__} has no admin"
        url = f"/admin/billing/{model._meta.model_name}/"
        assert client.get(url).status_code == 200, url
        first = model.objects.first()
        assert first is not None, model.__name__
        assert client.get(f"{url}{first.pk}/change/").status_code == 200, url


def test_ledger_rows_cannot_be_added_changed_or_deleted(client, operator, alice):
    grant(alice, USD)
    client.force_login(operator)
    transfer, entry = Transfer.objects.get(), Entry.objects.first()
    account = Account.objects.get(owner=alice)
    for url in [f"/admin/billing/transfer/{transfer.pk}/delete/",
                f"/admin/billing/entry/{entry.pk}/delete/",
                f"/admin/billing/account/{account.pk}/delete/",
                "/admin/billing/transfer/add/", "/admin/billing/entry/add/",
                "/admin/billing/account/add/", "/admin/billing/charge/add/"]:
        assert client.get(url).status_code == 403, url
    client.post(f"/admin/billing/account/{account.pk}/change/", {"balance_micros": 10 ** 12})
    account.refresh_from_db()
    assert account.balance_micros == USD
    page = client.get(f"/admin/billing/transfer/{transfer.pk}/change/").content.decode()
    assert "$1.00" in page and "-$1.00" in page  # the entries, inline
    changelist = client.get("/admin/billing/transfer/").content.decode()
    assert "delete_selected" not in changelist


def test_non_staff_are_refused(client, mallory):
    client.force_login(mallory)
    for url in ["/admin/billing/payout/", "/admin/billing/account/grant/",
                "/admin/billing/apikey/"]:
        assert client.get(url).status_code == 302, url


def test_grant_credit_from_the_admin(client, operator, alice):
    client.force_login(operator)
    assert "Grant credit" in client.get("/admin/billing/account/").content.decode()
    page = client.get("/admin/billing/account/grant/?email=alice@example.com")
    assert 'value="alice@example.com"' in page.content.decode()
    key = re.search(rb'name="idempotency_key" value="(\w+)"', page.content)[1].decode()
    data = {"email": "Alice@Example.com", "amount": "12.34", "memo": "goodwill",
            "idempotency_key": key}
    response = client.post("/admin/billing/account/grant/", data, follow=True)
    assert "Granted $12.34 to alice@example.com; their balance is now $12.34." in \
        response.content.decode()
    client.post("/admin/billing/account/grant/", data)  # a double submit grants once
    assert selectors.user_balances(alice.pk)[Account.Kind.WALLET] == 12_340_000
    assert Transfer.objects.get().memo == "goodwill"

    bad = client.post("/admin/billing/account/grant/", {
        "email": "nobody@example.com", "amount": "-1", "idempotency_key": key})
    assert bad.status_code == 200
    assert "No user has this email address." in bad.content.decode()
    assert "greater than or equal to 0.01" in bad.content.decode()
    assert Transfer.objects.count() == 1


def test_grant_credit_action_on_a_wallet(client, operator, alice, bob):
    grant(alice, USD)
    grant(bob, USD)
    client.force_login(operator)
    alices = Account.objects.get(owner=alice, kind="wallet")
    response = client.post("/admin/billing/account/", {
        "action": "grant_credit", "_selected_action": [alices.pk]})
    assert response["Location"] == "/admin/billing/account/grant/?email=alice%40example.com"
    both = Account.objects.filter(kind="wallet").values_list("pk", flat=True)
    response = client.post("/admin/billing/account/", {
        "action": "grant_credit", "_selected_action": list(both)}, follow=True)
    assert "Select exactly one wallet account." in response.content.decode()


def test_staff_without_the_permission_cannot_grant(client, alice):
    staff = UserFactory(is_staff=True, two_factor=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_account"))
    client.force_login(staff)
    assert client.get("/admin/billing/account/").status_code == 200
    assert client.get("/admin/billing/account/grant/").status_code == 403
    assert client.post("/admin/billing/account/grant/", {
        "email": "alice@example.com", "amount": "5", "idempotency_key": "a" * 32}
    ).status_code == 403
    assert not Transfer.objects.exists()


def test_approve_and_pay_moves_earnings_to_payouts(client, operator, earning_bob):
    paid = services.payout_request(provider=earning_bob, amount_micros=50 * USD)
    client.force_login(operator)
    response = client.post("/admin/billing/payout/", {
        "action": "approve_and_pay", "_selected_action": [paid.pk]}, follow=True)
    assert "1 payout(s) paid." in response.content.decode()
    paid.refresh_from_db()
    assert paid.status == Payout.Status.PAID and paid.decided_by == operator
    assert _earnings(earning_bob) == 35 * USD
    assert ledger.balance(Account.Kind.PAYOUTS) == 50 * USD
    # approving again moves nothing
    client.post("/admin/billing/payout/", {"action": "approve_and_pay",
                                           "_selected_action": [paid.pk]})
    assert _earnings(earning_bob) == 35 * USD

    rejected = services.payout_request(provider=earning_bob, amount_micros=30 * USD)
    client.post("/admin/billing/payout/", {"action": "reject", "_selected_action": [rejected.pk]})
    rejected.refresh_from_db()
    assert rejected.status == Payout.Status.REJECTED and _earnings(earning_bob) == 35 * USD


def test_a_payout_the_earnings_no_longer_cover_is_reported(client, operator, earning_bob,
                                                          settings):
    first = services.payout_request(provider=earning_bob, amount_micros=80 * USD)
    services.payout_decide(payout_id=first.pk, operator=operator, approve=False)
    second = services.payout_request(provider=earning_bob, amount_micros=80 * USD)
    services.payout_decide(payout_id=second.pk, operator=operator, approve=True)
    # A stale request, as if made before the other was paid.
    stale = Payout.objects.create(provider=earning_bob, amount_micros=80 * USD)
    client.force_login(operator)
    response = client.post("/admin/billing/payout/", {
        "action": "approve_and_pay", "_selected_action": [stale.pk]}, follow=True)
    assert "no longer cover this payout" in response.content.decode()
    stale.refresh_from_db()
    assert stale.status == Payout.Status.REQUESTED and _earnings(earning_bob) == 5 * USD


def test_model_prices_are_added_in_dollars_per_million_tokens(client, operator):
    client.force_login(operator)
    response = client.post("/admin/billing/modelprice/add/", {
        "model": MODEL, "input_usd_per_mtok": "0.15", "output_usd_per_mtok": "0.6",
        "effective_at_0": "2026-01-01", "effective_at_1": "00:00:00"})
    assert response.status_code == 302, response.content.decode()[:2000]
    row = ModelPrice.objects.get()
    assert (row.input_micros_per_mtok, row.output_micros_per_mtok) == (150_000, 600_000)
    listing = client.get("/admin/billing/modelprice/").content.decode()
    assert "$0.15" in listing and "$0.60" in listing
    # a price is never edited in place: a change is a new row
    client.post(f"/admin/billing/modelprice/{row.pk}/change/", {
        "model": MODEL, "input_usd_per_mtok": "9", "output_usd_per_mtok": "9"})
    row.refresh_from_db()
    assert row.input_micros_per_mtok == 150_000
    assert client.get(f"/admin/billing/modelprice/{row.pk}/delete/").status_code == 403


def test_api_keys_show_no_digest_and_revoke_through_the_service(client, operator, carol):
    row, token = keys.api_key_create(user=carol, name="k")
    assert keys.api_key_authenticate(token) is not None
    client.force_login(operator)
    page = client.get(f"/admin/billing/apikey/{row.pk}/change/").content.decode()
    assert row.digest not in page and f"rs_{row.prefix}_…" in client.get(
        "/admin/billing/apikey/").content.decode()
    client.post("/admin/billing/apikey/", {"action": "revoke", "_selected_action": [row.pk]})
    assert ApiKey.objects.get().revoked_at is not None
    assert keys.api_key_authenticate(token) is None
