"""Cooling-off before a provider's money leaves the platform.

A stolen password or session on an account without two-factor could otherwise turn two-factor
on, set the thief's IBAN and request a payout within minutes; and credit bought with a card can
be disputed for months (card networks allow about 120 days), while a provider colluding with a
stolen card's holder would have been paid the day after. Two kinds of hold:

- **Payouts wait.** A payout requested within RIGSHARE_PAYOUT_HOLD_AFTER_DESTINATION_H of the
  payout destination being set or changed, or within RIGSHARE_PAYOUT_HOLD_AFTER_TWO_FACTOR_H of
  two-factor turning on, waits until that time has passed since the change; an account's first
  payout waits RIGSHARE_PAYOUT_HOLD_FIRST_H from its request. An operator cannot pay it before
  (billing.services.payout_decide), and the owner, told by email of each of those changes, has
  that long to notice one that was not theirs.
- **Earnings from young card credit cannot be requested.** Of what a renter paid this provider
  since the renter's oldest card payment younger than RIGSHARE_CARD_DISPUTE_WINDOW_DAYS, the
  part that young card credit paid is held until those payments are older than the window.
  Which credit paid for what: a wallet spends its oldest credit first, so what it still holds
  is its newest credit; the young card credit it no longer holds was spent, and each
  provider's share of the renter's spending since then is held in that proportion (rounded
  up). Grants and card payments older than the window are never held.

Computed when asked (the payouts page, a payout request), in a fixed number of queries
whatever the number of renters: a payout is rare, and a figure kept up to date on every
request would cost the /v1 hot path.
"""

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing import ledger
from billing.models import Account, Charge, Entry, Payment, Payout, PayoutDestination, Transfer


@dataclass(frozen=True)
class PayoutWait:
    until: datetime | None  # None: a payout requested now is not held
    because: str = ""


@dataclass(frozen=True)
class CardCreditHold:
    amount_micros: int = 0  # earnings that cannot be requested yet
    next_release: datetime | None = None  # when the oldest card payment behind them clears
    last_release: datetime | None = None  # when the newest does, if renters spend no more
    renters: int = 0  # renters whose card credit is behind them


def payout_wait(provider, *, now: datetime | None = None) -> PayoutWait:
    """How long a payout the provider requests now must wait, and why (the latest reason)."""
    from allauth.mfa.models import Authenticator

    now = now or timezone.now()
    waits = []
    destination_at = (PayoutDestination.objects.filter(provider=provider)
                      .values_list("updated_at", flat=True).first())
    if destination_at is not None:
        waits.append((destination_at + _hours(settings.RIGSHARE_PAYOUT_HOLD_AFTER_DESTINATION_H),
                      f"the payout destination changed on {destination_at:%Y-%m-%d %H:%M} UTC"))
    two_factor_at = (Authenticator.objects.filter(user=provider, type=Authenticator.Type.TOTP)
                     .values_list("created_at", flat=True).first())
    if two_factor_at is not None:
        waits.append((two_factor_at + _hours(settings.RIGSHARE_PAYOUT_HOLD_AFTER_TWO_FACTOR_H),
                      f"two-factor authentication was turned on on {two_factor_at:%Y-%m-%d %H:%M} "
                      "UTC"))
    if not Payout.objects.filter(provider=provider, status=Payout.Status.PAID).exists():
        waits.append((now + _hours(settings.RIGSHARE_PAYOUT_HOLD_FIRST_H),
                      "it is the account's first payout"))
    until, because = max(waits, default=(None, ""), key=lambda wait: wait[0])
    if until is None or until <= now:
        return PayoutWait(None)
    return PayoutWait(until, because)


def card_credit_held(provider_id: int, *, now: datetime | None = None) -> CardCreditHold:
    """The provider's earnings paid from card credit younger than the dispute window."""
    now = now or timezone.now()
    window = timedelta(days=settings.RIGSHARE_CARD_DISPUTE_WINDOW_DAYS)
    if not window:
        return CardCreditHold()
    cutoff = now - window
    earned = _earned_by_renter_day(provider_id, cutoff)  # {renter: {day: micros}}
    young = defaultdict(list)  # renter: [(succeeded_at, net micros)]
    for renter, at, amount, refunded, disputed in Payment.objects.filter(
            user_id__in=list(earned), status=Payment.Status.SUCCEEDED,
            succeeded_at__gte=cutoff).values_list(
            "user_id", "succeeded_at", "amount_micros", "refunded_micros", "disputed_micros"):
        if amount - refunded - disputed > 0:
            young[renter].append((at, amount - refunded - disputed))
    if not young:
        return CardCreditHold()
    renters = list(young)
    wallets = dict(Account.objects.filter(owner_id__in=renters, kind=Account.Kind.WALLET)
                   .values_list("pk", "owner_id"))
    unspent = dict(Account.objects.filter(owner_id__in=renters, kind__in=Account.KEEPS_BALANCE)
                   .values("owner_id").annotate(total=Sum("balance_micros"))
                   .values_list("owner_id", "total"))
    grants = defaultdict(list)
    for account, at, amount in Entry.objects.filter(
            account_id__in=list(wallets), amount_micros__gt=0,
            transfer__kind=Transfer.Kind.GRANT, transfer__created_at__gte=cutoff).values_list(
            "account_id", "transfer__created_at", "amount_micros"):
        grants[wallets[account]].append((at, amount))
    spent = _spent_by_renter_day(renters, wallets, cutoff)  # {renter: {day: micros}}

    held, clears, behind = 0, [], 0
    for renter, payments in young.items():
        young_spent = _young_card_spent(payments, grants[renter], unspent.get(renter) or 0)
        if young_spent <= 0:
            continue
        since = timezone.localdate(min(at for at, _ in payments))  # TruncDate's days
        spending = sum(micros for day, micros in spent[renter].items() if day >= since)
        earning = sum(micros for day, micros in earned[renter].items() if day >= since)
        if spending <= 0 or earning <= 0:
            continue
        share = min(young_spent, spending)
        held += -(-earning * share // spending)  # rounded up
        clears += [at + window for at, _ in payments]
        behind += 1
    if not held:
        return CardCreditHold()
    held = min(held, max(ledger.balance(Account.Kind.EARNINGS, provider_id), 0))
    return CardCreditHold(held, min(clears), max(clears), renters=behind)


def _young_card_spent(payments, grants, unspent: int) -> int:
    """How much of the young card payments the wallet no longer holds: what it holds (wallet
    and holds in flight) is its newest credit, so it is taken from the newest credit first."""
    credits = sorted([(at, amount, True) for at, amount in payments]
                     + [(at, amount, False) for at, amount in grants], reverse=True)
    left, spent = max(unspent, 0), 0
    for _, amount, card in credits:
        kept = min(left, amount)
        left -= kept
        if card:
            spent += amount - kept
    return spent


def _earned_by_renter_day(provider_id: int, cutoff: datetime) -> dict:
    earned: dict = defaultdict(lambda: defaultdict(int))
    for renter, day, micros in (Charge.objects.filter(provider_id=provider_id,
                                                      created_at__gte=cutoff)
                                .annotate(day=TruncDate("created_at"))
                                .values("user_id", "day").annotate(total=Sum("provider_micros"))
                                .values_list("user_id", "day", "total")):
        earned[renter][day] += micros
    # Time on the provider's hardware: the rental transfers into its earnings, and the wallet
    # each was paid from.
    earnings = (Account.objects.filter(owner_id=provider_id, kind=Account.Kind.EARNINGS)
                .values_list("pk", flat=True).first())
    if earnings is not None:
        rentals = dict(Entry.objects.filter(
            account_id=earnings, amount_micros__gt=0, transfer__kind=Transfer.Kind.RENTAL,
            transfer__created_at__gte=cutoff).values_list("transfer_id", "amount_micros"))
        for transfer, renter, day in (Entry.objects.filter(
                transfer_id__in=list(rentals), amount_micros__lt=0,
                account__kind=Account.Kind.WALLET)
                .annotate(day=TruncDate("transfer__created_at"))
                .values_list("transfer_id", "account__owner_id", "day")):
            earned[renter][day] += rentals[transfer]
    return earned


def _spent_by_renter_day(renters: list[int], wallets: dict, cutoff: datetime) -> dict:
    spent: dict = defaultdict(lambda: defaultdict(int))
    for renter, day, micros in (Charge.objects.filter(user_id__in=renters, created_at__gte=cutoff)
                                .annotate(day=TruncDate("created_at"))
                                .values("user_id", "day").annotate(total=Sum("cost_micros"))
                                .values_list("user_id", "day", "total")):
        spent[renter][day] += micros
    for account, day, micros in (Entry.objects.filter(
            account_id__in=list(wallets), amount_micros__lt=0,
            transfer__kind=Transfer.Kind.RENTAL, transfer__created_at__gte=cutoff)
            .annotate(day=TruncDate("transfer__created_at"))
            .values("account_id", "day").annotate(total=Sum("amount_micros"))
            .values_list("account_id", "day", "total")):
        spent[wallets[account]][day] -= micros
    return spent


def _hours(hours: int) -> timedelta:
    return timedelta(hours=hours)
