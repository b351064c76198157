"""Money-moving services other than metering: purchases, grants, rental charges, payouts."""

import secrets
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing import ledger, pricing
from billing.gateway import get_gateway
from billing.models import Account, Payment, Payout, Transfer


class BillingError(Exception):
    """A refusal with a sentence the user can read."""


# --- buying credit ---

MIN_TOPUP_MICROS = 1_000_000
MAX_TOPUP_MICROS = 10_000_000_000


def payment_create(*, user, amount_micros: int, card_number: str, idempotency_key: str
                   ) -> Payment:
    """Charge a card for credit. Replaying the idempotency key returns the first payment."""
    if not MIN_TOPUP_MICROS <= amount_micros <= MAX_TOPUP_MICROS:
        raise BillingError("Top up between $1 and $10,000.")
    existing = Payment.objects.filter(idempotency_key=idempotency_key).first()
    if existing is not None:
        if existing.user_id != user.pk:
            raise BillingError("This payment key belongs to someone else.")
        return existing
    gateway = get_gateway()
    result = gateway.charge(amount_micros=amount_micros, card_number=card_number,
                            idempotency_key=idempotency_key)
    payment, _ = Payment.objects.get_or_create(
        idempotency_key=idempotency_key,
        defaults={"user": user, "amount_micros": amount_micros, "gateway": gateway.name,
                  "gateway_ref": result.gateway_ref, "card_last4": result.card_last4,
                  "status": (Payment.Status.DECLINED if result.status == "declined"
                             else Payment.Status.REQUIRES_CONFIRMATION),
                  "decline_reason": result.decline_reason})
    if payment.user_id != user.pk:  # lost a race for the key to another user's request
        raise BillingError("This payment key belongs to someone else.")
    if result.status == "succeeded":
        payment = payment_succeeded(gateway_ref=result.gateway_ref)
    return payment


@transaction.atomic
def payment_succeeded(*, gateway_ref: str, now: datetime | None = None) -> Payment:
    """The processor says the money is ours: credit the wallet, exactly once per payment."""
    now = now or timezone.now()
    payment = Payment.objects.select_for_update().get(gateway_ref=gateway_ref)
    if payment.status == Payment.Status.SUCCEEDED:
        return payment
    if payment.status == Payment.Status.DECLINED:
        raise BillingError("A declined payment cannot succeed.")
    posted = ledger.post(
        kind=Transfer.Kind.PURCHASE, idempotency_key=f"payment:{payment.pk}",
        legs=[(ledger.account_id(Account.Kind.PAYMENT_CLEARING), -payment.amount_micros),
              (ledger.account_id(Account.Kind.WALLET, payment.user_id), payment.amount_micros)],
        reference=f"payment:{payment.pk}", memo=f"card ending {payment.card_last4}", now=now)
    payment.status, payment.succeeded_at = Payment.Status.SUCCEEDED, now
    payment.transfer_id = posted.transfer_id
    payment.receipt_number = f"RS-{now:%Y%m%d}-{payment.pk:06d}-{secrets.token_hex(2).upper()}"
    payment.save(update_fields=["status", "succeeded_at", "transfer", "receipt_number"])
    return payment


def webhook_handle(*, body: bytes, signature: str) -> Payment | None:
    """A gateway event, as delivered to /billing/webhooks/payments/. Replays change nothing."""
    event = get_gateway().verify_event(body=body, signature=signature)
    if event.get("type") != "payment.succeeded":
        return None
    return payment_succeeded(gateway_ref=event["gateway_ref"])


def credits_grant(*, user, amount_micros: int, idempotency_key: str, memo: str = "") -> int:
    """An operator gives credit (admin, `manage.py grant_credits`)."""
    if amount_micros <= 0:
        raise BillingError("A grant must be positive.")
    return ledger.post(
        kind=Transfer.Kind.GRANT, idempotency_key=idempotency_key,
        legs=[(ledger.account_id(Account.Kind.GRANTS), -amount_micros),
              (ledger.account_id(Account.Kind.WALLET, user.pk), amount_micros)],
        reference=f"user:{user.pk}", memo=memo[:200]).transfer_id


# --- paying for time on a provider's card ---

@dataclass(frozen=True)
class TimeCharge:
    charged_micros: int  # may be less than asked when the wallet ran dry
    exhausted: bool


def time_charge(*, payer_id: int, provider_id: int, amount_micros: int, idempotency_key: str,
                reference: str, now: datetime | None = None) -> TimeCharge:
    """Charge the payer for time on a provider's hardware, the provider earning the price less
    the platform fee. Takes what the wallet holds when it cannot cover it all."""
    if amount_micros <= 0:
        return TimeCharge(0, False)
    wallet = ledger.account_id(Account.Kind.WALLET, payer_id)
    with transaction.atomic():
        available = Account.objects.select_for_update().values_list(
            "balance_micros", flat=True).get(pk=wallet)
        charged = min(amount_micros, available)
        if charged > 0:
            share, fee = pricing.fee_split(charged, settings.RIGSHARE_PLATFORM_FEE_BPS)
            ledger.post(kind=Transfer.Kind.RENTAL, idempotency_key=idempotency_key,
                        legs=[(wallet, -charged),
                              (ledger.account_id(Account.Kind.EARNINGS, provider_id), share),
                              (ledger.account_id(Account.Kind.PLATFORM_REVENUE), fee)],
                        reference=reference, now=now)
    return TimeCharge(charged, charged < amount_micros)


# --- payouts ---

def payout_request(*, provider, amount_micros: int) -> Payout:
    if amount_micros < settings.RIGSHARE_MIN_PAYOUT_MICROS:
        raise BillingError(f"The minimum payout is "
                           f"{pricing.format_usd(settings.RIGSHARE_MIN_PAYOUT_MICROS)}.")
    with transaction.atomic():
        # The earnings row lock queues payout requests and payouts of this provider.
        Account.objects.select_for_update().get(
            pk=ledger.account_id(Account.Kind.EARNINGS, provider.pk))
        pending = sum(Payout.objects.filter(provider=provider, status=Payout.Status.REQUESTED)
                      .values_list("amount_micros", flat=True))
        if amount_micros + pending > ledger.balance(Account.Kind.EARNINGS, provider.pk):
            raise BillingError("You cannot request more than your unpaid earnings.")
        return Payout.objects.create(provider=provider, amount_micros=amount_micros)


def payout_decide(*, payout_id: int, operator, approve: bool,
                  now: datetime | None = None) -> Payout:
    now = now or timezone.now()
    with transaction.atomic():
        payout = Payout.objects.select_for_update().get(pk=payout_id)
        if payout.status != Payout.Status.REQUESTED:
            return payout
        if approve:
            try:
                posted = ledger.post(
                    kind=Transfer.Kind.PAYOUT, idempotency_key=f"payout:{payout.pk}",
                    legs=[(ledger.account_id(Account.Kind.EARNINGS, payout.provider_id),
                           -payout.amount_micros),
                          (ledger.account_id(Account.Kind.PAYOUTS), payout.amount_micros)],
                    reference=f"payout:{payout.pk}", now=now)
            except ledger.InsufficientFunds:
                raise BillingError("The provider's earnings no longer cover this payout.") \
                    from None
            payout.transfer_id = posted.transfer_id
        payout.status = Payout.Status.PAID if approve else Payout.Status.REJECTED
        payout.decided_at, payout.decided_by = now, operator
        payout.save()
    return payout
