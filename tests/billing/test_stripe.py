"""Buying credit through Stripe, without the network: Stripe's servers are a stand-in behind
the SDK's own HTTP-client interface, and webhook events are signed the way the SDK's tests sign
them, then checked by the SDK's own `Webhook.construct_event`."""

import json
import time
from urllib.parse import parse_qs

import pytest
import stripe

from billing import gateway, selectors
from billing.models import Account, GatewayEvent, Payment, Transfer
from tests.billing.test_pages import USD, form_key, wallet

pytestmark = pytest.mark.django_db

SECRET = "whsec_test_signing_secret"


class StripeServers(stripe.HTTPClient):
    """Answers the SDK as api.stripe.com would, and remembers what it was asked."""

    name = "stand-in"

    def __init__(self):
        super().__init__()
        self.calls = []
        self.sessions = {}

    def request(self, method, url, headers, post_data=None, *, _usage=None):
        form = parse_qs(post_data or "")
        self.calls.append((method, url, dict(headers or {}), form))
        if url.endswith("/v1/checkout/sessions") and method == "post":
            key = (headers or {}).get("Idempotency-Key")
            session = self.sessions.setdefault(key, {
                "id": f"cs_test_{len(self.sessions) + 1}", "object": "checkout.session",
                "url": f"https://checkout.stripe.com/c/pay/cs_test_{len(self.sessions) + 1}",
                "amount_total": int(form["line_items[0][price_data][unit_amount]"][0]),
                "currency": "usd", "payment_status": "unpaid"})
            return json.dumps(session), 200, {}
        return json.dumps({"error": {"message": "not here", "type": "invalid_request_error"}}), \
            404, {}

    def close(self):
        pass


@pytest.fixture
def servers(settings, monkeypatch):
    settings.STRIPE_SECRET_KEY = "sk_test_rigshare"
    settings.STRIPE_WEBHOOK_SECRET = SECRET
    fake = StripeServers()
    monkeypatch.setattr(gateway, "STRIPE_HTTP_CLIENT", fake)
    return fake


def signed(event_type: str, obj: dict, *, event_id: str = "evt_1", secret: str = SECRET,
           timestamp: int | None = None) -> tuple[bytes, str]:
    """An event as Stripe delivers it, with the `Stripe-Signature` header its SDK's tests
    build: HMAC-SHA256 of "<timestamp>.<payload>" with the endpoint's secret."""
    timestamp = timestamp or int(time.time())
    body = json.dumps({"id": event_id, "object": "event", "type": event_type,
                       "api_version": "2026-01-01", "created": timestamp,
                       "data": {"object": obj}})
    signature = stripe.WebhookSignature._compute_signature(f"{timestamp}.{body}", secret)
    return body.encode(), f"t={timestamp},v1={signature}"


def deliver(client, body: bytes, signature: str):
    return client.post("/billing/webhooks/payments/", body, content_type="application/json",
                       HTTP_STRIPE_SIGNATURE=signature)


def checkout(client, user, amount="25.00") -> Payment:
    client.force_login(user)
    key = form_key(client.get("/billing/"))
    response = client.post("/billing/", {"amount": amount, "idempotency_key": key})
    payment = Payment.objects.get(user=user, gateway="stripe")
    assert response.status_code == 302 and response.url == payment.checkout_url
    return payment


def completed(payment: Payment, *, event_id="evt_paid", cents=None) -> tuple[bytes, str]:
    return signed("checkout.session.completed", {
        "id": payment.gateway_ref, "object": "checkout.session", "payment_status": "paid",
        "amount_total": cents if cents is not None else payment.amount_micros // 10_000,
        "currency": "usd", "payment_intent": "pi_test_1"}, event_id=event_id)


def ledger_is_balanced():
    assert selectors.ledger_problems() == []


def test_the_top_up_opens_stripe_checkout_once_per_form(client, alice, servers):
    payment = checkout(client, alice)
    assert payment.status == Payment.Status.REQUIRES_CONFIRMATION and wallet(alice) == 0
    assert payment.checkout_url.startswith("https://checkout.stripe.com/")
    method, url, headers, form = servers.calls[0]
    assert url == "https://api.stripe.com/v1/checkout/sessions"
    assert form["line_items[0][price_data][unit_amount]"] == ["2500"]
    assert form["line_items[0][price_data][currency]"] == ["usd"]
    assert headers["Idempotency-Key"] == payment.idempotency_key
    assert headers["Authorization"] == "Bearer sk_test_rigshare"
    # The card number never passes through Rigshare: the form has no such field.
    html = client.get("/billing/").content.decode()
    assert 'name="card_number"' not in html and 'id="processor-note"' in html
    assert "4242" not in html


def test_a_paid_session_credits_once_however_often_it_is_delivered(client, alice, servers):
    payment = checkout(client, alice)
    body, signature = completed(payment)
    for _ in range(3):
        response = deliver(client, body, signature)
        assert response.status_code == 200 and response.json()["status"] == "succeeded"
    assert wallet(alice) == 25 * USD
    assert Transfer.objects.filter(kind="purchase").count() == 1
    assert GatewayEvent.objects.get().event_id == "evt_paid"
    payment.refresh_from_db()
    assert payment.processor_ref == "pi_test_1" and payment.receipt_number
    ledger_is_balanced()


@pytest.mark.parametrize("forge", [
    lambda body, sig: (body, sig.replace("v1=", "v1=0")),  # a signature that is not Stripe's
    lambda body, sig: (body.replace(b'"paid"', b'"paid" '), sig),  # a body changed after
    lambda body, sig: signed("checkout.session.completed", json.loads(body)["data"]["object"],
                             secret="dev-only-payment-webhook-secret"),  # the old default
    lambda body, sig: signed("checkout.session.completed", json.loads(body)["data"]["object"],
                             timestamp=int(time.time()) - 3600),  # replayed an hour later
    lambda body, sig: (body, ""),
])
def test_a_forged_or_stale_event_credits_nothing(client, alice, servers, forge):
    payment = checkout(client, alice)
    body, signature = forge(*completed(payment))
    assert deliver(client, body, signature).status_code == 400
    assert wallet(alice) == 0 and not GatewayEvent.objects.exists()


def test_the_test_gateways_events_are_refused_when_stripe_takes_the_money(client, alice, servers):
    payment = checkout(client, alice)
    fake = gateway.TestCardGateway().event("payment.succeeded", payment.gateway_ref)
    response = client.post("/billing/webhooks/payments/", fake["body"],
                           content_type="application/json",
                           HTTP_X_RIGSHARE_SIGNATURE=fake["headers"]["X-Rigshare-Signature"])
    assert response.status_code == 400 and wallet(alice) == 0
    assert client.get(f"/billing/test-gateway/{payment.gateway_ref}/").status_code == 404


def test_a_session_paid_for_another_amount_credits_nothing(client, alice, servers):
    payment = checkout(client, alice)
    assert deliver(client, *completed(payment, cents=1)).status_code == 409
    assert wallet(alice) == 0


def test_a_session_paid_for_nothing_credits_nothing(client, alice, servers):
    """A session brought to 0 (a 100% coupon on it) still says what was paid: 0 is an amount."""
    payment = checkout(client, alice)
    assert deliver(client, *completed(payment, cents=0)).status_code == 409
    body, signature = signed("checkout.session.completed", {
        "id": payment.gateway_ref, "object": "checkout.session", "payment_status": "paid",
        "currency": "usd", "payment_intent": "pi_test_1"}, event_id="evt_no_amount")
    assert deliver(client, body, signature).status_code == 400
    assert wallet(alice) == 0
    payment.refresh_from_db()
    assert payment.status != Payment.Status.SUCCEEDED


def test_refunds_take_the_credit_back_through_the_ledger(client, alice, servers):
    payment = checkout(client, alice)
    deliver(client, *completed(payment))
    charge = {"object": "charge", "payment_intent": "pi_test_1", "currency": "usd"}
    deliver(client, *signed("charge.refunded", charge | {"amount_refunded": 1000},
                            event_id="evt_r1"))
    assert wallet(alice) == 15 * USD
    again = signed("charge.refunded", charge | {"amount_refunded": 1000}, event_id="evt_r1")
    deliver(client, *again)  # the same event again
    assert wallet(alice) == 15 * USD
    deliver(client, *signed("charge.refunded", charge | {"amount_refunded": 2500},
                            event_id="evt_r2"))
    assert wallet(alice) == 0
    payment.refresh_from_db()
    assert payment.refunded_micros == 25 * USD
    assert Transfer.objects.filter(kind="reversal").count() == 2
    ledger_is_balanced()


def test_a_refund_of_credit_already_spent_is_the_platforms_loss_not_an_overdraft(
        client, alice, servers):
    from billing import ledger

    payment = checkout(client, alice)
    deliver(client, *completed(payment))
    ledger.post(kind="rental", idempotency_key="spent", legs=[
        (ledger.account_id(Account.Kind.WALLET, alice.pk), -20 * USD),
        (ledger.account_id(Account.Kind.PLATFORM_REVENUE), 20 * USD)])
    deliver(client, *signed("charge.refunded", {"object": "charge", "payment_intent": "pi_test_1",
                                                 "currency": "usd", "amount_refunded": 2500}))
    assert wallet(alice) == 0
    assert ledger.balance(Account.Kind.CHARGEBACKS) == -20 * USD
    ledger_is_balanced()


def test_a_dispute_takes_the_credit_back_and_a_won_dispute_gives_it_back(client, alice, servers):
    payment = checkout(client, alice)
    deliver(client, *completed(payment))
    dispute = {"id": "dp_1", "object": "dispute", "payment_intent": "pi_test_1",
               "currency": "usd", "amount": 2500, "status": "needs_response"}
    for _ in range(2):
        deliver(client, *signed("charge.dispute.created", dispute, event_id="evt_d1"))
    assert wallet(alice) == 0
    payment.refresh_from_db()
    assert payment.disputed_micros == 25 * USD
    deliver(client, *signed("charge.dispute.closed", dispute | {"status": "won"},
                            event_id="evt_d2"))
    assert wallet(alice) == 25 * USD
    payment.refresh_from_db()
    assert payment.disputed_micros == 0
    ledger_is_balanced()


def test_events_that_name_the_same_dispute_again_count_it_once(client, alice, servers):
    """Stripe sends more than one event per dispute (created, funds withdrawn, updated), each
    with its own id: the case is taken back, and counted, once; and given back once."""
    payment = checkout(client, alice)
    deliver(client, *completed(payment))
    dispute = {"id": "dp_3", "object": "dispute", "payment_intent": "pi_test_1",
               "currency": "usd", "amount": 1000, "status": "needs_response"}
    for event_id in ("evt_d5", "evt_d6", "evt_d7"):
        deliver(client, *signed("charge.dispute.created", dispute, event_id=event_id))
    payment.refresh_from_db()
    assert payment.disputed_micros == 10 * USD and wallet(alice) == 15 * USD
    for event_id in ("evt_d8", "evt_d9"):
        deliver(client, *signed("charge.dispute.closed", dispute | {"status": "won"},
                                event_id=event_id))
    payment.refresh_from_db()
    assert payment.disputed_micros == 0 and wallet(alice) == 25 * USD
    ledger_is_balanced()


def test_a_lost_dispute_leaves_the_credit_taken(client, alice, servers):
    payment = checkout(client, alice)
    deliver(client, *completed(payment))
    dispute = {"id": "dp_2", "object": "dispute", "payment_intent": "pi_test_1",
               "currency": "usd", "amount": 2500}
    deliver(client, *signed("charge.dispute.created", dispute | {"status": "needs_response"},
                            event_id="evt_d3"))
    response = deliver(client, *signed("charge.dispute.closed", dispute | {"status": "lost"},
                                       event_id="evt_d4"))
    assert response.json() == {"status": "ignored"} and wallet(alice) == 0


def test_an_expired_session_is_declined(client, alice, servers):
    payment = checkout(client, alice)
    deliver(client, *signed("checkout.session.expired", {
        "id": payment.gateway_ref, "object": "checkout.session", "currency": "usd"}))
    payment.refresh_from_db()
    assert payment.status == Payment.Status.DECLINED and wallet(alice) == 0
