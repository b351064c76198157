"""Payment gateways behind one narrow interface: the only place a payment processor exists.

- `StripeGateway` (Stripe's official SDK): the payer pays on Stripe's hosted Checkout page,
  3-D Secure included, and Stripe tells the platform by webhook events, verified with the
  SDK's signature check. Production uses it and nothing else.
- `TestCardGateway` behaves like a processor's test mode (Stripe-style test card numbers): it
  charges, declines or asks for a confirmation step, and reports the outcome as a signed event.
  It exists only where RIGSHARE_PRODUCTION is off (the demo, the tests).

Both answer `start` (begin a payment) and `parse_event` (a verified event from the processor,
in the platform's words); services.py does the rest, the same way for both.
"""

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

SUCCEEDS = "4242424242424242"
DECLINES = "4000000000000002"
REQUIRES_CONFIRMATION = "4000002500003155"

MICROS_PER_CENT = 10_000

# What an event means for the platform.
PAID = "paid"  # the money is ours
FAILED = "failed"  # the payment will not complete
REFUNDED = "refunded"  # money went back to the payer (amount: refunded in all so far)
DISPUTED = "disputed"  # the payer's bank took the money back, pending the dispute
DISPUTE_WON = "dispute_won"  # the dispute was decided for us: the money is back
IGNORED = "ignored"


@dataclass(frozen=True)
class Checkout:
    status: str  # "succeeded" | "declined" | "requires_action"
    gateway_ref: str  # names the payment in the platform and at the processor
    card_last4: str = ""
    decline_reason: str = ""
    redirect_url: str = ""  # where the payer finishes paying (a processor's page)


@dataclass(frozen=True)
class Event:
    id: str  # the processor's event id: each is handled once
    type: str  # PAID, FAILED, REFUNDED, DISPUTED, DISPUTE_WON or IGNORED
    gateway_ref: str = ""  # the payment as `start` named it
    processor_ref: str = ""  # the processor's own payment id, which refunds and disputes name
    case_ref: str = ""  # the dispute, for DISPUTED and DISPUTE_WON
    # What the event says was paid, refunded or disputed. None: it does not say (the test
    # gateway's own confirmation); a processor's payment always says, and 0 is an amount.
    amount_micros: int | None = None


class PaymentGateway(Protocol):
    name: str
    collects_card: bool  # the platform's own form takes the card number (test gateway only)

    def start(self, *, amount_micros: int, idempotency_key: str, card_number: str,
              email: str, return_url: str) -> Checkout: ...

    def parse_event(self, *, body: bytes, headers: Mapping[str, str]) -> Event: ...


class GatewayError(Exception):
    """A refused event (bad signature, not an event) or a processor that failed."""


# --- Stripe -----------------------------------------------------------------------------------

class StripeGateway:
    name = "stripe"
    collects_card = False
    SIGNATURE_HEADER = "Stripe-Signature"

    def __init__(self, *, secret_key: str, webhook_secret: str, http_client=None):
        import stripe

        self._stripe = stripe
        self.webhook_secret = webhook_secret
        self.client = stripe.StripeClient(secret_key, max_network_retries=2,
                                          http_client=http_client)

    def start(self, *, amount_micros: int, idempotency_key: str, card_number: str = "",
              email: str = "", return_url: str = "") -> Checkout:
        if amount_micros % MICROS_PER_CENT:
            raise GatewayError("Stripe charges whole cents.")
        params = {
            "mode": "payment",
            "line_items": [{"quantity": 1, "price_data": {
                "currency": "usd", "unit_amount": amount_micros // MICROS_PER_CENT,
                "product_data": {"name": "Rigshare credit"}}}],
            "success_url": return_url, "cancel_url": return_url,
            "metadata": {"idempotency_key": idempotency_key},
            "payment_intent_data": {"metadata": {"idempotency_key": idempotency_key}},
        }
        if email:
            params["customer_email"] = email
        try:
            # Stripe's idempotency key: a form sent twice opens one Checkout Session.
            session = self.client.v1.checkout.sessions.create(
                params=params, options={"idempotency_key": idempotency_key})
        except self._stripe.StripeError as exc:
            raise GatewayError(f"Stripe refused the payment: {exc.user_message or exc}") \
                from None
        return Checkout("requires_action", session.id, redirect_url=session.url)

    def parse_event(self, *, body: bytes, headers: Mapping[str, str]) -> Event:
        try:
            event = self._stripe.Webhook.construct_event(
                body, headers.get(self.SIGNATURE_HEADER, ""), self.webhook_secret)
        except self._stripe.SignatureVerificationError:
            raise GatewayError("bad signature") from None
        except ValueError:
            raise GatewayError("not an event") from None
        event = event.to_dict()  # plain dicts all the way down
        kind, obj = event["type"], event["data"]["object"]
        if obj.get("currency") not in (None, "usd"):
            return Event(event["id"], IGNORED)
        if kind in ("checkout.session.completed", "checkout.session.async_payment_succeeded"):
            if obj.get("payment_status") != "paid":
                return Event(event["id"], IGNORED)  # an async method: its outcome comes later
            if not isinstance(obj.get("amount_total"), int):
                raise GatewayError("a paid session that does not say its amount")
            return Event(event["id"], PAID, gateway_ref=obj["id"],
                         processor_ref=obj.get("payment_intent") or "",
                         amount_micros=obj["amount_total"] * MICROS_PER_CENT)
        if kind in ("checkout.session.async_payment_failed", "checkout.session.expired"):
            return Event(event["id"], FAILED, gateway_ref=obj["id"])
        if kind == "charge.refunded":
            return Event(event["id"], REFUNDED, processor_ref=obj.get("payment_intent") or "",
                         amount_micros=int(obj.get("amount_refunded") or 0) * MICROS_PER_CENT)
        if kind == "charge.dispute.created":
            return Event(event["id"], DISPUTED, processor_ref=obj.get("payment_intent") or "",
                         case_ref=obj["id"],
                         amount_micros=int(obj.get("amount") or 0) * MICROS_PER_CENT)
        if kind == "charge.dispute.closed" and obj.get("status") == "won":
            return Event(event["id"], DISPUTE_WON, processor_ref=obj.get("payment_intent") or "",
                         case_ref=obj["id"],
                         amount_micros=int(obj.get("amount") or 0) * MICROS_PER_CENT)
        return Event(event["id"], IGNORED)


# --- the test-card gateway (never in production) -------------------------------------------------

def _sign(body: bytes) -> str:
    return hmac.new(settings.RIGSHARE_PAYMENT_WEBHOOK_SECRET.encode(), body,
                    hashlib.sha256).hexdigest()


class TestCardGateway:
    name = "testcard"
    collects_card = True
    SIGNATURE_HEADER = "X-Rigshare-Signature"
    _TYPES = {"payment.succeeded": PAID, "payment.failed": FAILED,
              "payment.refunded": REFUNDED, "payment.disputed": DISPUTED,
              "dispute.won": DISPUTE_WON}

    def start(self, *, amount_micros: int, idempotency_key: str, card_number: str,
              email: str = "", return_url: str = "") -> Checkout:
        digits = "".join(c for c in card_number if c.isdigit())
        # The same idempotency key always names the same processor payment.
        ref = "tpay_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:24]
        if digits == SUCCEEDS:
            return Checkout("succeeded", ref, digits[-4:])
        if digits == REQUIRES_CONFIRMATION:
            return Checkout("requires_action", ref, digits[-4:])
        if digits == DECLINES:
            return Checkout("declined", ref, digits[-4:], "Your card was declined.")
        return Checkout("declined", ref, digits[-4:],
                        "This test gateway accepts only its test card numbers.")

    def confirm(self, *, gateway_ref: str) -> dict:
        """The cardholder passed the confirmation step: the processor emits its event."""
        return self.event("payment.succeeded", gateway_ref)

    def event(self, kind: str, gateway_ref: str, *, amount_micros: int | None = None,
              case_ref: str = "") -> dict:
        """A signed event as this gateway delivers it: {"body": ..., "headers": {...}}."""
        body = json.dumps({"id": "evt_" + secrets.token_hex(8), "type": kind,
                           "gateway_ref": gateway_ref, "amount_micros": amount_micros,
                           "case_ref": case_ref}).encode()
        return {"body": body, "headers": {self.SIGNATURE_HEADER: _sign(body)}}

    def parse_event(self, *, body: bytes, headers: Mapping[str, str]) -> Event:
        if not hmac.compare_digest(_sign(body), headers.get(self.SIGNATURE_HEADER) or ""):
            raise GatewayError("bad signature")
        try:
            event = json.loads(body)
        except ValueError:
            raise GatewayError("not JSON") from None
        if not isinstance(event, dict) or not isinstance(event.get("gateway_ref"), str) \
                or not isinstance(event.get("id"), str):
            raise GatewayError("no gateway_ref")
        # The test gateway names its payments one way: its ref is the processor's id too.
        ref = event["gateway_ref"]
        return Event(event["id"], self._TYPES.get(event.get("type"), IGNORED), gateway_ref=ref,
                     processor_ref=ref, case_ref=str(event.get("case_ref") or ""),
                     amount_micros=(int(event["amount_micros"])
                                    if isinstance(event.get("amount_micros"), int) else None))


# The SDK's HTTP client: None is its own (requests). Tests put a stand-in for Stripe's servers
# here, which is all of Stripe that cannot exist in them.
STRIPE_HTTP_CLIENT = None


def get_gateway() -> PaymentGateway:
    """Stripe wherever its keys are set, and always in production (settings refuse to start
    without them there); the test-card gateway only outside production."""
    if settings.STRIPE_SECRET_KEY:
        return StripeGateway(secret_key=settings.STRIPE_SECRET_KEY,
                             webhook_secret=settings.STRIPE_WEBHOOK_SECRET,
                             http_client=STRIPE_HTTP_CLIENT)
    if settings.RIGSHARE_PRODUCTION:
        raise ImproperlyConfigured("Production takes payments through Stripe only.")
    return TestCardGateway()
