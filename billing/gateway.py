"""Payment gateways behind one narrow interface: the only place a payment processor exists.

`TestCardGateway` behaves like a real processor's test mode (Stripe-style test card numbers):
it charges, declines or asks for a confirmation step (3-D Secure), and reports the outcome to
the platform as a signed webhook event. A real processor would implement the same three calls.
"""

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Protocol

from django.conf import settings

SUCCEEDS = "4242424242424242"
DECLINES = "4000000000000002"
REQUIRES_CONFIRMATION = "4000002500003155"


@dataclass(frozen=True)
class GatewayResult:
    status: str  # "succeeded" | "declined" | "requires_confirmation"
    gateway_ref: str
    card_last4: str
    decline_reason: str = ""


class PaymentGateway(Protocol):
    name: str

    def charge(self, *, amount_micros: int, card_number: str, idempotency_key: str
               ) -> GatewayResult: ...

    def confirm(self, *, gateway_ref: str) -> dict: ...

    def verify_event(self, *, body: bytes, signature: str) -> dict: ...


class GatewayError(Exception):
    pass


def _sign(body: bytes) -> str:
    return hmac.new(settings.RIGSHARE_PAYMENT_WEBHOOK_SECRET.encode(), body,
                    hashlib.sha256).hexdigest()


class TestCardGateway:
    name = "testcard"

    def charge(self, *, amount_micros: int, card_number: str, idempotency_key: str
               ) -> GatewayResult:
        digits = "".join(c for c in card_number if c.isdigit())
        # The same idempotency key always names the same processor payment.
        ref = "tpay_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:24]
        if digits == SUCCEEDS:
            return GatewayResult("succeeded", ref, digits[-4:])
        if digits == REQUIRES_CONFIRMATION:
            return GatewayResult("requires_confirmation", ref, digits[-4:])
        if digits == DECLINES:
            return GatewayResult("declined", ref, digits[-4:], "Your card was declined.")
        return GatewayResult("declined", ref, digits[-4:],
                             "This test gateway accepts only its test card numbers.")

    def confirm(self, *, gateway_ref: str) -> dict:
        """The cardholder passed the confirmation step: the processor emits its event."""
        return self.event("payment.succeeded", gateway_ref)

    def event(self, kind: str, gateway_ref: str) -> dict:
        body = json.dumps({"id": "evt_" + secrets.token_hex(8), "type": kind,
                           "gateway_ref": gateway_ref}).encode()
        return {"body": body, "signature": _sign(body)}

    def verify_event(self, *, body: bytes, signature: str) -> dict:
        if not hmac.compare_digest(_sign(body), signature or ""):
            raise GatewayError("bad signature")
        try:
            event = json.loads(body)
        except ValueError:
            raise GatewayError("not JSON") from None
        if not isinstance(event, dict) or not isinstance(event.get("gateway_ref"), str):
            raise GatewayError("no gateway_ref")
        return event


def get_gateway() -> PaymentGateway:
    return TestCardGateway()
