"""Money-moving services other than metering: purchases, grants, rental charges, payouts."""

import secrets
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from stdnum import bic as stdnum_bic
from stdnum import exceptions as stdnum_exceptions
from stdnum import iban as stdnum_iban

from accounts import security
from billing import gateway as gw
from billing import keys, ledger, payout_holds, pricing
from billing.gateway import GatewayError, get_gateway
from billing.models import (
    Account,
    ApiKey,
    GatewayEvent,
    Payment,
    Payout,
    PayoutDestination,
    Transfer,
)


class BillingError(Exception):
    """A refusal with a sentence the user can read."""


# --- buying credit ---

MIN_TOPUP_MICROS = 1_000_000
MAX_TOPUP_MICROS = 10_000_000_000


def payment_create(*, user, amount_micros: int, idempotency_key: str, card_number: str = "",
                   return_url: str = "") -> Payment:
    """Start a credit purchase. Replaying the idempotency key returns the first payment. A
    payment that needs the payer on the processor's page (Stripe Checkout, a confirmation
    step) is left awaiting it, with `checkout_url`; the processor's event finishes it."""
    if not MIN_TOPUP_MICROS <= amount_micros <= MAX_TOPUP_MICROS:
        raise BillingError("Top up between $1 and $10,000.")
    existing = Payment.objects.filter(idempotency_key=idempotency_key).first()
    if existing is not None:
        if existing.user_id != user.pk:
            raise BillingError("This payment key belongs to someone else.")
        return existing
    gateway = get_gateway()
    try:
        result = gateway.start(amount_micros=amount_micros, idempotency_key=idempotency_key,
                               card_number=card_number, email=user.email, return_url=return_url)
    except GatewayError as exc:
        raise BillingError(str(exc)) from None
    payment, _ = Payment.objects.get_or_create(
        idempotency_key=idempotency_key,
        defaults={"user": user, "amount_micros": amount_micros, "gateway": gateway.name,
                  "gateway_ref": result.gateway_ref, "card_last4": result.card_last4,
                  "checkout_url": result.redirect_url,
                  "status": (Payment.Status.DECLINED if result.status == "declined"
                             else Payment.Status.REQUIRES_CONFIRMATION),
                  "decline_reason": result.decline_reason})
    if payment.user_id != user.pk:  # lost a race for the key to another user's request
        raise BillingError("This payment key belongs to someone else.")
    if result.status == "succeeded":
        payment = payment_succeeded(gateway_ref=result.gateway_ref,
                                    processor_ref=result.gateway_ref)
    return payment


@transaction.atomic
def payment_succeeded(*, gateway_ref: str, processor_ref: str = "",
                      amount_micros: int | None = None, now: datetime | None = None) -> Payment:
    """The processor says the money is ours: credit the wallet, exactly once per payment. An
    amount that is not the payment's (a session tampered with, a discount to nothing) credits
    nothing; None, where the processor does not say (the test gateway's confirmation)."""
    now = now or timezone.now()
    payment = Payment.objects.select_for_update().get(gateway_ref=gateway_ref)
    if payment.status == Payment.Status.SUCCEEDED:
        return payment
    if payment.status == Payment.Status.DECLINED:
        raise BillingError("A declined payment cannot succeed.")
    if amount_micros is not None and amount_micros != payment.amount_micros:
        raise BillingError(f"The processor reports {amount_micros} micro-dollars paid for a "
                           f"payment of {payment.amount_micros}.")
    posted = ledger.post(
        kind=Transfer.Kind.PURCHASE, idempotency_key=f"payment:{payment.pk}",
        legs=[(ledger.account_id(Account.Kind.PAYMENT_CLEARING), -payment.amount_micros),
              (ledger.account_id(Account.Kind.WALLET, payment.user_id), payment.amount_micros)],
        reference=f"payment:{payment.pk}",
        memo=f"card ending {payment.card_last4}" if payment.card_last4 else payment.gateway,
        now=now)
    payment.status, payment.succeeded_at = Payment.Status.SUCCEEDED, now
    payment.transfer_id = posted.transfer_id
    payment.processor_ref = processor_ref or payment.processor_ref
    payment.receipt_number = f"RS-{now:%Y%m%d}-{payment.pk:06d}-{secrets.token_hex(2).upper()}"
    payment.save(update_fields=["status", "succeeded_at", "transfer", "receipt_number",
                                "processor_ref"])
    return payment


def webhook_handle(*, body: bytes, headers) -> Payment | None:
    """A processor's event, as delivered to /billing/webhooks/payments/: verified by the
    gateway, handled once per event id (a replay changes nothing), in one transaction with
    the money it moves."""
    gateway = get_gateway()
    event = gateway.parse_event(body=body, headers=headers)
    with transaction.atomic():
        if event.type == gw.IGNORED:
            return None
        payment = _payment_of(event)
        _, first = GatewayEvent.objects.get_or_create(
            gateway=gateway.name, event_id=event.id,
            defaults={"type": event.type, "payment": payment})
        if not first:
            return payment
        if event.type == gw.PAID:
            return payment_succeeded(gateway_ref=payment.gateway_ref,
                                     processor_ref=event.processor_ref,
                                     amount_micros=event.amount_micros)
        if event.type == gw.FAILED:
            Payment.objects.filter(pk=payment.pk, status=Payment.Status.REQUIRES_CONFIRMATION
                                   ).update(status=Payment.Status.DECLINED,
                                            decline_reason="The payment did not complete.")
        elif event.type == gw.REFUNDED:
            _refund(payment, refunded_in_all=event.amount_micros or 0)
        elif event.type == gw.DISPUTED:
            _dispute(payment, case=event.case_ref, amount_micros=event.amount_micros or 0)
        elif event.type == gw.DISPUTE_WON:
            _dispute_won(payment, case=event.case_ref)
    payment.refresh_from_db()
    return payment


def _payment_of(event: gw.Event) -> Payment:
    rows = Payment.objects.select_for_update()
    payment = (rows.filter(gateway_ref=event.gateway_ref).first() if event.gateway_ref else
               rows.filter(processor_ref=event.processor_ref).first()
               if event.processor_ref else None)
    if payment is None:
        raise Payment.DoesNotExist(f"no payment for event {event.id}")
    return payment


def _reverse(payment: Payment, amount_micros: int, *, key: str, why: str) -> bool:
    """Take `amount_micros` of a purchase back: from the payer's wallet as far as it holds it,
    the rest is the platform's loss (chargebacks). The payer's other money is never touched:
    holds in flight and earnings stay. False when nothing moved (nothing to take, or `key`
    was taken back before)."""
    if amount_micros <= 0:
        return False
    wallet = ledger.account_id(Account.Kind.WALLET, payment.user_id)
    held = (Account.objects.select_for_update().filter(pk=wallet)
            .values_list("balance_micros", flat=True).first() or 0)
    taken = min(held, amount_micros)
    return ledger.post(
        kind=Transfer.Kind.REVERSAL, idempotency_key=key,
        legs=[(ledger.account_id(Account.Kind.PAYMENT_CLEARING), amount_micros),
              (wallet, -taken),
              (ledger.account_id(Account.Kind.CHARGEBACKS), taken - amount_micros)],
        reference=f"payment:{payment.pk}", memo=why).created


def _refund(payment: Payment, *, refunded_in_all: int) -> None:
    if payment.status != Payment.Status.SUCCEEDED:
        return
    refunded_in_all = min(refunded_in_all, payment.amount_micros)
    more = refunded_in_all - payment.refunded_micros
    if more <= 0:
        return
    _reverse(payment, more, key=f"refund:{payment.pk}:{refunded_in_all}",
             why=f"refund of payment {payment.receipt_number}")
    Payment.objects.filter(pk=payment.pk).update(refunded_micros=refunded_in_all)


def _dispute(payment: Payment, *, case: str, amount_micros: int) -> None:
    if payment.status != Payment.Status.SUCCEEDED:
        return
    amount = min(amount_micros, payment.amount_micros - payment.refunded_micros)
    # A case is taken back once, however many events name it (a second event id for the same
    # dispute, a funds-withdrawn after the created): the figure follows the ledger.
    if _reverse(payment, amount, key=f"dispute:{case}",
                why=f"dispute of payment {payment.receipt_number}"):
        Payment.objects.filter(pk=payment.pk).update(
            disputed_micros=F("disputed_micros") + amount)


def _dispute_won(payment: Payment, *, case: str) -> None:
    """The dispute went our way: the reversal is undone leg by leg, exactly."""
    taken = Transfer.objects.filter(idempotency_key=f"dispute:{case}").first()
    if taken is None:
        return
    legs = list(taken.entries.values_list("account_id", "amount_micros"))
    given_back = ledger.post(kind=Transfer.Kind.REVERSAL, idempotency_key=f"dispute-won:{case}",
                             legs=[(account, -amount) for account, amount in legs],
                             reference=f"payment:{payment.pk}",
                             memo=f"dispute of payment {payment.receipt_number} won")
    if given_back.created:
        clearing = next(amount for account, amount in legs if amount > 0)
        Payment.objects.filter(pk=payment.pk).update(
            disputed_micros=F("disputed_micros") - clearing)


def credits_grant(*, user, amount_micros: int, idempotency_key: str, memo: str = "") -> int:
    """An operator gives credit (admin, `manage.py grant_credits`)."""
    if amount_micros <= 0:
        raise BillingError("A grant must be positive.")
    return ledger.post(
        kind=Transfer.Kind.GRANT, idempotency_key=idempotency_key,
        legs=[(ledger.account_id(Account.Kind.GRANTS), -amount_micros),
              (ledger.account_id(Account.Kind.WALLET, user.pk), amount_micros)],
        reference=f"user:{user.pk}", memo=memo[:200]).transfer_id


def wallet_forfeit(*, user, idempotency_key: str, memo: str = "") -> int:
    """The holder gives up the credit left in their wallet (closing their account): it becomes
    the platform's, in a transfer of its own, so the ledger still balances and says why.
    Returns the amount moved."""
    with transaction.atomic():
        wallet = Account.objects.select_for_update().filter(
            kind=Account.Kind.WALLET, owner=user).first()
        amount = wallet.balance_micros if wallet else 0
        if amount <= 0:
            return 0
        ledger.post(kind=Transfer.Kind.FORFEIT, idempotency_key=idempotency_key,
                    legs=[(wallet.pk, -amount),
                          (ledger.account_id(Account.Kind.PLATFORM_REVENUE), amount)],
                    reference=f"user:{user.pk}", memo=memo[:200])
    return amount


def account_close_billing(*, user) -> int:
    """What billing does when its holder closes an account: every API key stops, the payout
    destination (bank details) is deleted, and the credit left is given up. The ledger, the
    payments and the payouts stay as they are: they are the platform's books. Returns the
    credit given up."""
    for key_id in ApiKey.objects.filter(user=user, revoked_at__isnull=True).values_list(
            "pk", flat=True):
        keys.api_key_revoke(user=user, key_id=key_id)
    PayoutDestination.objects.filter(provider=user).delete()
    return wallet_forfeit(user=user, idempotency_key=f"close:{user.pk}",
                          memo="credit given up when the account closed")


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

class InvalidDestination(BillingError):
    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field  # the form field it is about, or None


def payout_destination_set(*, provider, method: str, holder_name: str, iban: str = "",
                           bic: str = "", paypal_email: str = "",
                           now: datetime | None = None) -> PayoutDestination:
    """Set where the provider's payouts go, checked: an IBAN and a BIC by their check digits
    and format, a PayPal address as an address. Payouts already requested keep theirs. Needs
    a verified email and two-factor: a leaked password must not redirect the earnings."""
    security.require_strong_account(provider, "change where payouts go")
    holder_name = holder_name.strip()
    if not holder_name:
        raise InvalidDestination("Say whose account it is.", "holder_name")
    fields = {"method": method, "holder_name": holder_name, "iban": "", "bic": "",
              "paypal_email": "", "updated_at": now or timezone.now()}
    if method == PayoutDestination.Method.BANK:
        try:
            fields["iban"] = stdnum_iban.validate(iban)
            fields["bic"] = stdnum_bic.validate(bic) if bic.strip() else ""
        except stdnum_exceptions.ValidationError as exc:
            field = "bic" if fields["iban"] else "iban"
            raise InvalidDestination(f"This {field.upper()} is not valid: {exc.message}.",
                                     field) from None
    elif method == PayoutDestination.Method.PAYPAL:
        try:
            validate_email(paypal_email.strip())
        except ValidationError:
            raise InvalidDestination("This PayPal address is not an email address.",
                                     "paypal_email") from None
        fields["paypal_email"] = paypal_email.strip()
    else:
        raise InvalidDestination("Choose a bank transfer or PayPal.", "method")
    with transaction.atomic():
        destination, _ = PayoutDestination.objects.update_or_create(provider=provider,
                                                                    defaults=fields)
        security.security_email_on_commit(
            provider, "payout_destination", {
                "destination": destination.masked(),
                "hold_hours": settings.RIGSHARE_PAYOUT_HOLD_AFTER_DESTINATION_H})
    return destination


def payout_request(*, provider, amount_micros: int, now: datetime | None = None) -> Payout:
    """A payout of the provider's earnings, for an operator to pay: no more than the earnings
    not yet requested and not paid from card credit that can still be disputed; held before
    it can be paid after a change that a thief would make first (billing/payout_holds.py)."""
    now = now or timezone.now()
    security.require_strong_account(provider, "request a payout")
    destination = PayoutDestination.objects.filter(provider=provider).first()
    if destination is None:
        raise BillingError("Set where to pay you first.")
    if amount_micros < settings.RIGSHARE_MIN_PAYOUT_MICROS:
        raise BillingError(f"The minimum payout is "
                           f"{pricing.format_usd(settings.RIGSHARE_MIN_PAYOUT_MICROS)}.")
    with transaction.atomic():
        # The earnings row lock queues payout requests and payouts of this provider.
        Account.objects.select_for_update().get(
            pk=ledger.account_id(Account.Kind.EARNINGS, provider.pk))
        pending = sum(Payout.objects.filter(provider=provider, status=Payout.Status.REQUESTED)
                      .values_list("amount_micros", flat=True))
        earnings = ledger.balance(Account.Kind.EARNINGS, provider.pk)
        if amount_micros + pending > earnings:
            raise BillingError("You cannot request more than your unpaid earnings.")
        card = payout_holds.card_credit_held(provider.pk, now=now)
        if amount_micros + pending > earnings - card.amount_micros:
            raise BillingError(
                f"{pricing.format_usd(card.amount_micros)} of your earnings were paid from card "
                f"credit less than {settings.RIGSHARE_CARD_DISPUTE_WINDOW_DAYS} days old, which "
                f"its cardholder can still dispute: you can request up to "
                f"{pricing.format_usd(max(earnings - card.amount_micros - pending, 0))} now; "
                f"more from {card.next_release:%Y-%m-%d}.")
        wait = payout_holds.payout_wait(provider, now=now)
        payout = Payout.objects.create(provider=provider, amount_micros=amount_micros,
                                       destination=destination.full(), requested_at=now,
                                       held_until=wait.until, held_because=wait.because)
        security.security_email_on_commit(
            provider, "payout_requested", {
                "amount": pricing.format_usd(amount_micros), "destination": destination.masked(),
                "held_until": f"{wait.until:%Y-%m-%d %H:%M}" if wait.until else "",
                "held_because": wait.because})
        return payout


def payout_decide(*, payout_id: int, operator, approve: bool,
                  now: datetime | None = None) -> Payout:
    now = now or timezone.now()
    with transaction.atomic():
        payout = Payout.objects.select_for_update().get(pk=payout_id)
        if payout.status != Payout.Status.REQUESTED:
            return payout
        if approve and payout.held_until is not None and now < payout.held_until:
            raise BillingError(f"Held until {payout.held_until:%Y-%m-%d %H:%M} UTC: "
                               f"{payout.held_because}.")
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
