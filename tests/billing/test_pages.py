"""Billing pages: buying credit (the three test cards, confirmation, the webhook), receipts,
transactions and their CSV, API keys, usage, payouts. Mallory is refused everywhere."""

import csv
import io
import re
import uuid
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone

from billing import charts, keys, metering, selectors, services
from billing.gateway import DECLINES, REQUIRES_CONFIRMATION, SUCCEEDS, get_gateway
from billing.keys import KeyInfo
from billing.metering import Usage, Worker
from billing.models import (
    Account,
    ApiKey,
    Charge,
    ModelPrice,
    Payment,
    Payout,
    PayoutDestination,
    Transfer,
)
from billing.pricing import format_usd, format_usd_exact, micros_to_usd, usd_to_micros
from tests.factories import price_at

pytestmark = pytest.mark.django_db

USD = 1_000_000
MODEL = "llama-3.1-8b"
OTHER_MODEL = "qwen-2.5-72b"


# --- helpers shared by the billing test modules ---

def grant(user, micros: int = 100 * USD) -> None:
    services.credits_grant(user=user, amount_micros=micros, idempotency_key=f"t:{uuid.uuid4()}")


def price(model: str = MODEL, *, input_per_mtok: int = 200_000,
          output_per_mtok: int = 600_000) -> ModelPrice:
    return ModelPrice.objects.create(model=model, input_micros_per_mtok=input_per_mtok,
                                     output_micros_per_mtok=output_per_mtok,
                                     effective_at=timezone.now() - timedelta(days=400))


def spend(key_row: ApiKey, *, model: str = MODEL, prompt: int = 1000, completion: int = 500,
          when=None, worker: Worker | None = None):
    """One metered request through the real services: reserve the worst case (twice the
    tokens it will use), then settle what it used."""
    price_now = price_at(model, when)
    request_id = uuid.uuid4().hex
    held = metering.reserve(key=KeyInfo.of(key_row), model=model, price=price_now,
                            max_cost=metering.max_cost_micros(price_now, prompt_tokens=prompt,
                                                              max_tokens=2 * completion + 1),
                            request_id=request_id, tokens=prompt + completion, now=when)
    return metering.settle(hold=held, usage=Usage(prompt, completion), worker=worker, now=when)


def wallet(user) -> int:
    return selectors.user_balances(user.pk)[Account.Kind.WALLET]


def form_key(response) -> str:
    match = re.search(rb'name="idempotency_key" value="([0-9a-f]{32})"', response.content)
    assert match, "the form carries no idempotency key"
    return match.group(1).decode()


def topup(client, *, card: str, amount: str = "25.00", key: str | None = None):
    key = key or form_key(client.get("/billing/"))
    return client.post("/billing/", {"amount": amount, "card_number": card,
                                     "idempotency_key": key})


def csv_rows(response) -> list[list[str]]:
    return list(csv.reader(io.StringIO(response.content.decode())))


# --- every page needs a login ---

PAGES = ["/billing/", "/billing/transactions/", "/billing/transactions.csv", "/billing/keys/",
         "/billing/usage/", "/billing/payouts/", "/billing/statement.csv",
         "/billing/payments/1/", "/billing/test-gateway/tpay_x/", "/billing/keys/1/"]


@pytest.mark.parametrize("url", PAGES)
def test_anonymous_is_sent_to_log_in(client, url):
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


def test_anonymous_cannot_post_either(client, alice):
    key, _ = keys.api_key_create(user=alice, name="k", spend_limit_micros=USD)
    for url in ["/billing/", f"/billing/keys/{key.pk}/revoke/", "/billing/payouts/"]:
        response = client.post(url, {"amount": "50", "card_number": SUCCEEDS})
        assert response.status_code == 302, url
    assert not Payment.objects.exists() and not Payout.objects.exists()
    assert ApiKey.objects.get().revoked_at is None


def test_nav_links_to_billing_and_developer_access(client, alice):
    client.force_login(alice)
    html = client.get("/billing/").content.decode()
    for url in ["/billing/", "/billing/usage/", "/developers/"]:
        assert f'href="{url}"' in html
    assert 'href="/billing/keys/"' in client.get("/developers/").content.decode()


# --- buying credit ---

def test_overview_shows_balance_held_credit_and_the_test_cards(client, carol):
    grant(carol, 10 * USD)
    price()
    key, _ = keys.api_key_create(user=carol, name="k")
    price_now = price_at(MODEL)
    metering.reserve(key=KeyInfo.of(key), model=MODEL, price=price_now, max_cost=2 * USD,
                     request_id="in-flight", tokens=10)
    client.force_login(carol)
    html = client.get("/billing/").content.decode()
    assert '<dd class="price" id="balance">$8.00</dd>' in html
    assert '<dd id="held">$2.00</dd>' in html
    for card in (SUCCEEDS, DECLINES, REQUIRES_CONFIRMATION):
        assert card in html
    assert "request:in-flight" in html  # recent transactions
    metering.release(request_id="in-flight")


def test_a_good_card_buys_credit_and_shows_the_receipt(client, alice):
    client.force_login(alice)
    response = topup(client, card="4242 4242 4242 4242", amount="25.50")
    payment = Payment.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/billing/payments/{payment.pk}/"
    assert payment.status == Payment.Status.SUCCEEDED and payment.user == alice
    assert wallet(alice) == 25_500_000
    html = client.get(response["Location"]).content.decode()
    assert payment.receipt_number in html and "$25.50" in html and "ending 4242" in html
    assert payment.succeeded_at.strftime("%Y-%m-%d") in html


def test_a_double_submit_charges_once(client, alice):
    client.force_login(alice)
    key = form_key(client.get("/billing/"))
    first = topup(client, card=SUCCEEDS, key=key)
    second = topup(client, card=SUCCEEDS, key=key)
    assert first["Location"] == second["Location"]
    assert Payment.objects.count() == 1 and Transfer.objects.filter(kind="purchase").count() == 1
    assert wallet(alice) == 25 * USD
    assert "charged once" in client.get(second["Location"]).content.decode()


def test_each_rendered_form_has_its_own_key(client, alice):
    client.force_login(alice)
    assert form_key(client.get("/billing/")) != form_key(client.get("/billing/"))
    topup(client, card=SUCCEEDS)
    topup(client, card=SUCCEEDS)
    assert wallet(alice) == 50 * USD


def test_the_same_form_key_of_two_users_names_two_payments(client, alice, mallory):
    key = uuid.uuid4().hex
    client.force_login(alice)
    topup(client, card=SUCCEEDS, key=key)
    client.force_login(mallory)
    response = topup(client, card=SUCCEEDS, key=key, amount="5")
    assert Payment.objects.get(pk=response["Location"].split("/")[-2]).user == mallory
    assert wallet(alice) == 25 * USD and wallet(mallory) == 5 * USD


def test_a_declined_card_shows_an_error_and_moves_no_money(client, alice):
    client.force_login(alice)
    key = form_key(client.get("/billing/"))
    response = topup(client, card=DECLINES, key=key)
    assert response.status_code == 200
    assert "Your card was declined." in response.content.decode()
    assert f'value="{DECLINES}"' not in response.content.decode()  # never echoed back
    assert Payment.objects.get().status == Payment.Status.DECLINED
    assert not Transfer.objects.exists() and wallet(alice) == 0
    # The next try is a new payment: the re-rendered form carries a fresh key.
    assert form_key(response) != key
    assert topup(client, card=SUCCEEDS, key=form_key(response)).status_code == 302
    assert wallet(alice) == 25 * USD


def test_an_unknown_card_number_is_declined_by_the_test_gateway(client, alice):
    client.force_login(alice)
    response = topup(client, card="5555555555554444")
    assert "accepts only its test card numbers" in response.content.decode()
    assert wallet(alice) == 0


@pytest.mark.parametrize("amount,card,message", [
    ("0.50", SUCCEEDS, "greater than or equal to 1"),
    ("10000.01", SUCCEEDS, "less than or equal to 10000"),
    ("ten", SUCCEEDS, "Enter a number"),
    ("1.001", SUCCEEDS, "decimal places"),
    ("25", "4242-4242", "12 to 19 digits"),
    ("25", "", "This field is required"),
])
def test_bad_input_is_a_form_error_and_charges_nothing(client, alice, amount, card, message):
    client.force_login(alice)
    response = topup(client, card=card, amount=amount)
    assert response.status_code == 200 and message in response.content.decode()
    assert not Payment.objects.exists() and wallet(alice) == 0


def test_a_forged_form_key_is_a_form_error(client, alice):
    client.force_login(alice)
    response = topup(client, card=SUCCEEDS, key="x" * 40)
    assert response.status_code == 200 and "reload the page" in response.content.decode()
    assert not Payment.objects.exists()


def test_a_card_that_needs_confirmation_pays_only_once_approved(client, alice, mallory):
    client.force_login(alice)
    response = topup(client, card=REQUIRES_CONFIRMATION, amount="40")
    payment = Payment.objects.get()
    confirm_url = f"/billing/test-gateway/{payment.gateway_ref}/"
    assert response["Location"] == confirm_url
    assert payment.status == Payment.Status.REQUIRES_CONFIRMATION and wallet(alice) == 0
    assert "Approve" in client.get(confirm_url).content.decode()

    client.force_login(mallory)
    assert client.get(confirm_url).status_code == 404
    assert client.post(confirm_url).status_code == 404
    assert client.get(f"/billing/payments/{payment.pk}/").status_code == 404
    assert wallet(alice) == 0

    client.force_login(alice)
    approved = client.post(confirm_url)
    assert approved["Location"] == f"/billing/payments/{payment.pk}/"
    payment.refresh_from_db()
    assert payment.status == Payment.Status.SUCCEEDED and payment.receipt_number
    assert wallet(alice) == 40 * USD
    assert client.post(confirm_url)["Location"] == approved["Location"]  # again: nothing moves
    assert wallet(alice) == 40 * USD
    assert payment.receipt_number in client.get(approved["Location"]).content.decode()


def test_a_receipt_is_its_owners_alone(client, alice, mallory):
    client.force_login(alice)
    payment_url = topup(client, card=SUCCEEDS)["Location"]
    client.force_login(mallory)
    assert client.get(payment_url).status_code == 404
    assert client.get("/billing/payments/999999/").status_code == 404


# --- the payment webhook ---

def _pending_payment(client, user) -> Payment:
    client.force_login(user)
    topup(client, card=REQUIRES_CONFIRMATION, amount="30")
    client.logout()
    return Payment.objects.get(user=user)


def _deliver(client, body: bytes, signature: str):
    return client.post("/billing/webhooks/payments/", body, content_type="application/json",
                       HTTP_X_RIGSHARE_SIGNATURE=signature)


def test_the_webhook_credits_once_however_often_it_is_replayed(client, alice):
    payment = _pending_payment(client, alice)
    event = get_gateway().confirm(gateway_ref=payment.gateway_ref)
    for _ in range(3):
        response = _deliver(client, event["body"], event["headers"]["X-Rigshare-Signature"])
        assert response.status_code == 200 and response.json()["status"] == "succeeded"
    assert wallet(alice) == 30 * USD
    assert Transfer.objects.filter(kind="purchase").count() == 1
    # A second, different event for the same payment changes nothing either.
    again = get_gateway().confirm(gateway_ref=payment.gateway_ref)
    assert _deliver(client, again["body"], again["headers"]["X-Rigshare-Signature"]).status_code == 200
    assert wallet(alice) == 30 * USD


def test_the_webhook_refuses_a_bad_signature(client, alice):
    payment = _pending_payment(client, alice)
    event = get_gateway().confirm(gateway_ref=payment.gateway_ref)
    assert _deliver(client, event["body"], "0" * 64).status_code == 400
    assert _deliver(client, event["body"], "").status_code == 400
    assert client.post("/billing/webhooks/payments/", event["body"],
                       content_type="application/json").status_code == 400
    forged = event["body"].replace(b"payment.succeeded", b"payment.succeeded ")
    assert _deliver(client, forged, event["headers"]["X-Rigshare-Signature"]).status_code == 400
    payment.refresh_from_db()
    assert payment.status == Payment.Status.REQUIRES_CONFIRMATION and wallet(alice) == 0


def test_the_webhook_answers_bad_events_with_4xx_not_500(client, alice):
    gateway = get_gateway()
    unknown = gateway.event("payment.succeeded", "tpay_nobody")
    assert _deliver(client, unknown["body"], unknown["headers"]["X-Rigshare-Signature"]).status_code == 400
    refund = gateway.event("payment.refunded", "tpay_nobody", amount_micros=USD)
    assert _deliver(client, refund["body"],
                    refund["headers"]["X-Rigshare-Signature"]).status_code == 400
    other = gateway.event("payment.renamed", "tpay_nobody")
    response = _deliver(client, other["body"], other["headers"]["X-Rigshare-Signature"])
    assert response.status_code == 200 and response.json() == {"status": "ignored"}
    client.force_login(alice)
    topup(client, card=DECLINES)
    declined = gateway.event("payment.succeeded", Payment.objects.get().gateway_ref)
    assert _deliver(client, declined["body"], declined["headers"]["X-Rigshare-Signature"]).status_code == 409
    assert client.get("/billing/webhooks/payments/").status_code == 405
    assert wallet(alice) == 0


def test_the_webhook_needs_no_csrf_token(alice):
    from django.test import Client

    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice)
    strict.get("/billing/")
    # A browser form post without the token is refused...
    assert strict.post("/billing/", {"amount": "25", "card_number": SUCCEEDS}).status_code == 403
    payment = _pending_payment(Client(), alice)
    event = get_gateway().confirm(gateway_ref=payment.gateway_ref)
    # ...while the processor, who has no session, is let in by its signature.
    assert _deliver(strict, event["body"], event["headers"]["X-Rigshare-Signature"]).status_code == 200
    assert wallet(alice) == 30 * USD


# --- transactions and CSV ---

def test_transactions_list_the_users_entries_newest_first_with_running_balances(
        client, alice, mallory):
    grant(alice, 10 * USD)
    services.credits_grant(user=alice, amount_micros=5 * USD, idempotency_key="t:second",
                           memo="welcome back")
    grant(mallory, 77 * USD)
    client.force_login(alice)
    html = client.get("/billing/transactions/").content.decode()
    assert html.index("welcome back") < html.index("$10.00")
    assert '<td class="balance">$15.00</td>' in html and '<td class="balance">$10.00</td>' in html
    assert "$77.00" not in html


def test_transactions_page_runs_a_fixed_number_of_queries(
        client, alice, django_assert_max_num_queries):
    for _ in range(120):
        grant(alice, USD)
    client.force_login(alice)
    with django_assert_max_num_queries(6):
        first = client.get("/billing/transactions/")
    assert first.content.decode().count("data-line=") == 50
    seen, page, pages = [], first, 0
    while True:  # older, page by page, to the end: every line once
        pages += 1
        seen += page.context["lines"]
        if not page.context["older"]:
            break
        with django_assert_max_num_queries(6):
            page = client.get("/billing/transactions/", {"before": page.context["older"]})
    assert pages == 3 and len(seen) == 120 == len({line.cursor for line in seen})
    # the oldest line's running balance is the first grant's
    assert '<td class="balance">$1.00</td>' in page.content.decode()
    for bad in ("abc", "9" * 40, "12_x", ""):
        assert client.get("/billing/transactions/", {"before": bad}).status_code == 200


def test_a_request_is_one_line_of_the_statement_and_purchases_stay_in_view(client, carol):
    """A request's reserve, settle and give-back are one line, its net cost: a hundred requests
    do not push a purchase off the overview's recent transactions by more than their count."""
    price()
    grant(carol, 10 * USD)
    key, _ = keys.api_key_create(user=carol, name="k")
    charges = [spend(key, prompt=1234, completion=567) for _ in range(3)]
    client.force_login(carol)
    lines = client.get("/billing/transactions/").context["lines"]
    assert [line.kind for line in lines] == ["request"] * 3 + ["grant"]
    assert all(line.amount_micros == -c.cost_micros for line, c in zip(lines[:3], reversed(charges), strict=True))
    assert lines[0].balance_after_micros == 10 * USD - sum(c.cost_micros for c in charges)
    assert lines[0].model == MODEL
    overview = client.get("/billing/").content.decode()
    assert overview.count('data-kind="request"') == 3 and overview.count('data-kind="grant"') == 1
    assert f"{format_usd_exact(-charges[0].cost_micros)}" in overview  # to the micro-dollar


def test_a_request_in_flight_shows_its_held_credit(client, carol):
    price()
    grant(carol, 10 * USD)
    key, _ = keys.api_key_create(user=carol, name="k")
    held = metering.reserve(key=KeyInfo.of(key), model=MODEL, price=price_at(MODEL),
                            max_cost=1_000, request_id="in-flight", tokens=10)
    client.force_login(carol)
    line = client.get("/billing/transactions/").context["lines"][0]
    assert line.kind == "request" and line.requests_pending
    assert line.amount_micros == 0  # held is still the user's credit
    assert "credit held" in client.get("/billing/transactions/").content.decode()
    assert held.amount_micros > 0


def test_overview_runs_a_fixed_number_of_queries(client, alice, django_assert_max_num_queries):
    for _ in range(30):
        grant(alice, USD)
    client.force_login(alice)
    with django_assert_max_num_queries(6):
        assert client.get("/billing/").status_code == 200


def test_transactions_csv_is_an_attachment_in_exact_dollars(
        client, carol, mallory, django_assert_max_num_queries):
    price()
    grant(carol, 10 * USD)
    grant(mallory, 3 * USD)
    key, _ = keys.api_key_create(user=carol, name="k")
    charge = spend(key, prompt=1234, completion=567)
    client.force_login(carol)
    with django_assert_max_num_queries(4):
        response = client.get("/billing/transactions.csv")
    assert response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"].startswith('attachment; filename="rigshare-transactions-')
    rows = csv_rows(response)
    assert rows[0] == ["date_utc", "account", "kind", "reference", "memo", "amount_usd",
                       "balance_after_usd"]
    body = rows[1:]
    # grant (wallet), reserve (wallet, holds), settle (holds, wallet): newest first
    assert len(body) == 5
    assert [r[2] for r in body] == ["settle", "settle", "reserve", "reserve", "grant"]
    assert body[-1][1:] == ["wallet", "grant", f"user:{carol.pk}", "", "10.000000", "10.000000"]
    assert all(re.fullmatch(r"-?\d+\.\d{6}", r[5]) for r in body)
    wallet_rows = [r for r in body if r[1] == "wallet"]
    final = Decimal(wallet_rows[0][6])
    assert final == micros_to_usd(10 * USD - charge.cost_micros) == micros_to_usd(wallet(carol))
    assert sum(Decimal(r[5]) for r in body if r[1] == "holds") == 0
    assert "3.000000" not in response.content.decode()


def test_csv_cells_never_start_like_a_formula(client, alice):
    services.credits_grant(user=alice, amount_micros=USD, idempotency_key="t:formula",
                           memo='=HYPERLINK("http://evil.example","x")')
    client.force_login(alice)
    memo = csv_rows(client.get("/billing/transactions.csv"))[1][4]
    assert memo == """'=HYPERLINK("http://evil.example","x")"""


# --- API keys ---

def test_a_new_key_is_shown_once_and_listed_by_its_prefix(client, carol):
    client.force_login(carol)
    response = client.post("/billing/keys/", {
        "name": "ci", "spend_limit": "20", "spend_period": "weekly",
        "allowed_models": f"{MODEL}, {OTHER_MODEL}, {MODEL}", "requests_per_minute": "60",
        "tokens_per_minute": ""})
    assert response.status_code == 200
    token = re.search(r'<pre id="new-key">(rs_\w+_[\w-]+)</pre>', response.content.decode())[1]
    key = ApiKey.objects.get()
    assert token.startswith(f"rs_{key.prefix}_") and token not in key.digest
    assert key.spend_limit_micros == 20 * USD and key.spend_period == "weekly"
    assert key.allowed_models == [MODEL, OTHER_MODEL] and key.requests_per_minute == 60
    assert key.tokens_per_minute is None
    assert keys.api_key_authenticate(token).key_id == key.pk
    listing = client.get("/billing/keys/").content.decode()
    assert token not in listing and f"rs_{key.prefix}_…" in listing
    assert "$0.00 of $20.00 weekly" in listing and "60 requests/min" in listing


def test_the_key_list_shows_this_periods_spend(client, carol, django_assert_max_num_queries):
    price()
    grant(carol)
    key, _ = keys.api_key_create(user=carol, name="capped", spend_limit_micros=5 * USD)
    charge = spend(key)
    for i in range(20):
        keys.api_key_create(user=carol, name=f"k{i}")
    client.force_login(carol)
    with django_assert_max_num_queries(5):
        html = client.get("/billing/keys/").content.decode()
    assert f"{format_usd(charge.cost_micros)} of $5.00 monthly" in html


@pytest.mark.parametrize("data,message", [
    ({"name": ""}, "This field is required"),
    ({"name": "x", "requests_per_minute": "0"}, "greater than or equal to 1"),
    ({"name": "x", "spend_limit": "-1"}, "greater than or equal to 0"),
    ({"name": "x", "spend_period": "hourly"}, "Select a valid choice"),
    ({"name": "x", "allowed_models": "a" * 201}, "at most 200 characters"),
])
def test_a_bad_key_form_is_a_form_error(client, carol, data, message):
    client.force_login(carol)
    response = client.post("/billing/keys/", {"spend_period": "monthly", **data})
    assert response.status_code == 200 and message in response.content.decode()
    assert not ApiKey.objects.exists()


def test_revoking_a_key_refuses_it_at_once(client, carol, mallory):
    key, token = keys.api_key_create(user=carol, name="k")
    assert keys.api_key_authenticate(token) is not None  # now cached
    client.force_login(mallory)
    assert client.post(f"/billing/keys/{key.pk}/revoke/").status_code == 404
    assert keys.api_key_authenticate(token) is not None
    client.force_login(carol)
    assert client.get(f"/billing/keys/{key.pk}/revoke/").status_code == 405
    assert client.post(f"/billing/keys/{key.pk}/revoke/")["Location"] == "/billing/keys/"
    assert keys.api_key_authenticate(token) is None
    assert "revoked" in client.get("/billing/keys/").content.decode()
    assert client.post(f"/billing/keys/{key.pk}/revoke/").status_code == 404


def test_editing_a_keys_limits(client, carol, mallory):
    key, token = keys.api_key_create(user=carol, name="k", allowed_models=[MODEL])
    assert keys.api_key_authenticate(token).allowed_models == (MODEL,)
    client.force_login(mallory)
    assert client.get(f"/billing/keys/{key.pk}/").status_code == 404
    assert client.post(f"/billing/keys/{key.pk}/", {"name": "mine", "spend_period": "daily"}
                       ).status_code == 404
    client.force_login(carol)
    page = client.get(f"/billing/keys/{key.pk}/").content.decode()
    assert MODEL in page
    response = client.post(f"/billing/keys/{key.pk}/", {
        "name": "renamed", "spend_period": "daily", "spend_limit": "3.50",
        "allowed_models": "", "tokens_per_minute": "1000"})
    assert response["Location"] == "/billing/keys/"
    key.refresh_from_db()
    assert (key.name, key.spend_limit_micros, key.spend_period, key.allowed_models,
            key.tokens_per_minute) == ("renamed", 3_500_000, "daily", [], 1000)
    info = keys.api_key_authenticate(token)  # the cached copy went with the edit
    assert info.allowed_models == () and info.tokens_per_minute == 1000


# --- usage ---

def _usage_fixture(carol, bob):
    price()
    price(OTHER_MODEL, input_per_mtok=1_000_000, output_per_mtok=3_000_000)
    grant(carol)
    first, _ = keys.api_key_create(user=carol, name="first")
    second, _ = keys.api_key_create(user=carol, name="second")
    now = timezone.now()
    yesterday = now - timedelta(days=1)
    worker = Worker(provider_id=bob.pk, reference="card:1")
    spend(first, prompt=1000, completion=500, when=yesterday, worker=worker)
    spend(first, prompt=3000, completion=1500, when=yesterday)
    spend(second, model=OTHER_MODEL, prompt=2000, completion=1000, when=yesterday)
    spend(second, prompt=100, completion=50, when=now)
    return first, second, now, yesterday


def test_usage_per_day_and_model(client, carol, bob, mallory):
    first, second, now, yesterday = _usage_fixture(carol, bob)
    client.force_login(carol)
    response = client.get("/billing/usage/")
    rows = response.context["rows"]
    assert [(r["day"], r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"])
            for r in rows] == [
        (now.date(), MODEL, 1, 100, 50),
        (yesterday.date(), MODEL, 2, 4000, 2000),
        (yesterday.date(), OTHER_MODEL, 1, 2000, 1000),
    ]
    # 4000 in x $0.20 + 2000 out x $0.60 per 1M, each request rounded up to the micro-dollar
    assert rows[1]["cost_micros"] == 200 + 300 + 600 + 900
    assert rows[2]["cost_micros"] == 2000 + 3000
    total = sum(Charge.objects.filter(user=carol).values_list("cost_micros", flat=True))
    html = response.content.decode()
    assert f'<td id="total-cost">{format_usd_exact(total)}</td>' in html
    assert html.count("<rect ") == 2  # two days with a cost

    only_first = client.get(f"/billing/usage/?key={first.pk}").context["rows"]
    assert [(r["model"], r["requests"]) for r in only_first] == [(MODEL, 2)]

    client.force_login(mallory)
    assert client.get(f"/billing/usage/?key={first.pk}").status_code == 404
    assert client.get("/billing/usage/").context["rows"] == []
    assert client.get("/billing/usage/?key=abc").status_code == 404


def test_usage_period_choice(client, carol, bob):
    _usage_fixture(carol, bob)
    client.force_login(carol)
    assert client.get("/billing/usage/?days=7").context["days"] == 7
    assert client.get("/billing/usage/?days=9999").context["days"] == 30
    assert client.get("/billing/usage/?days=x").status_code == 200


def test_usage_aggregates_in_one_query(client, carol, django_assert_max_num_queries):
    price()
    price(OTHER_MODEL)
    grant(carol)
    key, _ = keys.api_key_create(user=carol, name="k")
    now = timezone.now()
    for i in range(60):
        spend(key, model=(MODEL, OTHER_MODEL)[i % 3 == 0], when=now - timedelta(days=i % 10))
    client.force_login(carol)
    with django_assert_max_num_queries(5) as queries:
        response = client.get(f"/billing/usage/?key={key.pk}")
    assert sum("GROUP BY" in q["sql"] for q in queries.captured_queries) == 1
    assert len(response.context["rows"]) == 20  # 10 days x 2 models
    assert sum(r["requests"] for r in response.context["rows"]) == 60


def test_cost_per_day_chart_geometry():
    days = charts.days_ending(date(2026, 3, 10), 4)
    assert days == [date(2026, 3, 7), date(2026, 3, 8), date(2026, 3, 9), date(2026, 3, 10)]
    chart = charts.cost_per_day_chart(days, {date(2026, 3, 8): 1_000, date(2026, 3, 10): 250},
                                      fmt=format_usd_exact, width=400, height=102)
    assert [(b.x, b.height) for b in chart.bars] == [(101.0, 100.0), (301.0, 25.0)]
    assert all(b.y + b.height == 102 for b in chart.bars)
    assert chart.bars[0].title == "2026-03-08: $0.001" and chart.max_label == "$0.001"
    assert (chart.first_label, chart.last_label) == ("Mar 07", "Mar 10")
    assert charts.cost_per_day_chart(days, {}).bars == []
    tiny = charts.cost_per_day_chart(days, {days[0]: 1, days[1]: 10 ** 9})
    assert tiny.bars[0].height == 2  # a day with any cost stays visible


def test_money_formatting():
    """Balances and prices in cents; the exact form where per-token amounts need it."""
    assert format_usd(0) == "$0.00" and format_usd(1_234_560_000) == "$1,234.56"
    # The amounts a renter once saw side by side on one site, now one rule:
    assert [format_usd(m) for m in (74_970_500, 79_967_000, 19_999_917)] == [
        "$74.97", "$79.97", "$20.00"]
    assert format_usd(5_000) == "$0.01" and format_usd(4_999) == "$0.00"  # half away from 0
    assert format_usd(-4_200) == "$0.00" and format_usd(-1_234_567) == "-$1.23"
    assert format_usd_exact(1) == "$0.000001" and format_usd_exact(-4_200) == "-$0.0042"
    assert format_usd_exact(12_500_000) == "$12.50"
    assert micros_to_usd(-1) == Decimal("-0.000001") and str(micros_to_usd(10 * USD)) == "10.000000"
    assert usd_to_micros(Decimal("12.345678")) == 12_345_678


# --- payouts ---

def _earn(bob, carol, micros_cost: int) -> None:
    """Give bob earnings: carol's request served on bob's card."""
    price(input_per_mtok=micros_cost, output_per_mtok=0)
    grant(carol, 1000 * USD)
    key, _ = keys.api_key_create(user=carol, name="k")
    spend(key, prompt=1_000_000, completion=0, worker=Worker(provider_id=bob.pk,
                                                             reference="card:1"))


def test_payouts_page_and_request(client, bob, carol, mallory, settings):
    settings.RIGSHARE_MIN_PAYOUT_MICROS = 10 * USD
    _earn(bob, carol, 100 * USD)
    earned = selectors.user_balances(bob.pk)[Account.Kind.EARNINGS]
    assert earned == 85 * USD  # less the platform's 15%
    client.force_login(bob)
    html = client.get("/billing/payouts/").content.decode()
    assert '<dd class="price" id="earnings">$85.00</dd>' in html and "$10.00" in html
    assert "Not set yet" in html
    assert "Set where to pay you first" in client.post("/billing/payouts/", {"amount": "20"}
                                                      ).content.decode()
    services.payout_destination_set(provider=bob, method="paypal", holder_name="Bob",
                                    paypal_email="bob@example.com")

    below = client.post("/billing/payouts/", {"amount": "9.99"})
    assert below.status_code == 200 and "The minimum payout is $10.00." in below.content.decode()
    too_much = client.post("/billing/payouts/", {"amount": "85.01"})
    assert "more than your unpaid earnings" in too_much.content.decode()
    assert client.post("/billing/payouts/", {"amount": "abc"}).status_code == 200
    assert not Payout.objects.exists()

    assert client.post("/billing/payouts/", {"amount": "60"})["Location"] == "/billing/payouts/"
    payout = Payout.objects.get()
    assert (payout.provider, payout.amount_micros, payout.status) == (bob, 60 * USD, "requested")
    assert payout.destination == "PayPal to Bob, bob@example.com"
    html = client.get("/billing/payouts/").content.decode()
    assert '<dd id="pending">$60.00</dd>' in html and '<dd id="available">$25.00</dd>' in html
    # what is already requested counts against what is left
    assert "more than your unpaid earnings" in client.post(
        "/billing/payouts/", {"amount": "30"}).content.decode()
    assert Payout.objects.count() == 1

    client.force_login(mallory)
    html = client.get("/billing/payouts/").content.decode()
    assert f'data-payout="{payout.pk}"' not in html and '<dd class="price" id="earnings">$0.00' in html
    # mallory has no second factor: refused before anything else is looked at
    assert "Turn on two-factor authentication before you request a payout" in client.post(
        "/billing/payouts/", {"amount": "50"}).content.decode()
    assert Payout.objects.count() == 1


@pytest.mark.parametrize("fields, field, message", [
    ({"method": "bank", "holder_name": "Bob", "iban": "DE89 3704 0044 0532 0130 01"},
     "iban", "This IBAN is not valid"),
    ({"method": "bank", "holder_name": "Bob", "iban": "DE89 3704 0044 0532 0130 00",
      "bic": "NOTABIC"}, "bic", "This BIC is not valid"),
    ({"method": "bank", "holder_name": "Bob"}, "iban", "A bank transfer needs the IBAN."),
    ({"method": "paypal", "holder_name": "Bob", "paypal_email": "not-an-address"},
     "paypal_email", "Enter a valid email address."),
    ({"method": "cheque", "holder_name": "Bob"}, "method", "Select a valid choice"),
    ({"method": "paypal", "holder_name": "  ", "paypal_email": "b@example.com"},
     "holder_name", "This field is required."),
])
def test_a_payout_destination_is_checked_and_a_bad_one_is_a_form_error(
        client, bob, fields, field, message):
    client.force_login(bob)
    response = client.post("/billing/payouts/destination/", fields)
    assert response.status_code == 200
    assert any(message in e for e in response.context["form"].errors[field])
    assert not PayoutDestination.objects.exists()


def test_a_payout_goes_where_it_was_asked_to_and_the_page_masks_the_account(
        client, bob, carol, mallory, settings):
    settings.RIGSHARE_MIN_PAYOUT_MICROS = 10 * USD
    _earn(bob, carol, 100 * USD)
    client.force_login(bob)
    saved = client.post("/billing/payouts/destination/", {
        "method": "bank", "holder_name": "Bob Builder", "iban": "de89370400440532013000",
        "bic": "COBADEFFXXX"}, follow=True)
    html = saved.content.decode()
    assert "IBAN DE89 …3000" in html and "DE89370400440532013000" not in html
    client.post("/billing/payouts/", {"amount": "20"})
    client.post("/billing/payouts/destination/", {
        "method": "paypal", "holder_name": "Bob", "paypal_email": "bob@example.com"})
    payout = Payout.objects.get()
    assert payout.destination == ("bank transfer to Bob Builder, IBAN DE89370400440532013000, "
                                  "BIC COBADEFFXXX")
    assert PayoutDestination.objects.get(provider=bob).method == "paypal"
    # mallory neither sees nor sets bob's
    client = Client()
    client.force_login(mallory)
    assert "Bob" not in client.get("/billing/payouts/destination/").content.decode()
    client.post("/billing/payouts/destination/", {
        "method": "paypal", "holder_name": "M", "paypal_email": "m@example.com"})
    assert PayoutDestination.objects.get(provider=bob).paypal_email == "bob@example.com"


def test_earnings_statement_csv(client, bob, carol, mallory):
    _earn(bob, carol, 100 * USD)
    client.force_login(bob)
    response = client.get("/billing/statement.csv")
    assert response["Content-Disposition"].startswith('attachment; filename="rigshare-earnings-')
    rows = csv_rows(response)
    assert len(rows) == 2 and rows[1][1:3] == ["earnings", "settle"]
    assert rows[1][5] == rows[1][6] == "85.000000"
    client.force_login(mallory)
    assert len(csv_rows(client.get("/billing/statement.csv"))) == 1
    client.force_login(carol)  # a consumer's own statement holds no one else's earnings
    assert len(csv_rows(client.get("/billing/statement.csv"))) == 1

