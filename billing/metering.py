"""Metering for the inference API: reserve before a call, settle or release after it.

Callers pass and get plain values (KeyInfo, Hold/Charge summaries), never model instances, so
the request path holds no ORM objects. Every failure a client should see is a MeteringError
carrying an OpenAI-style error object and its HTTP status.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from billing import ledger, pricing, ratelimit
from billing.keys import KeyInfo
from billing.models import Account, Charge, Hold, KeySpend, ModelPrice, Transfer

HOLD_TTL = timedelta(hours=2)  # longer than any request may run; then the hold is released


class MeteringError(Exception):
    def __init__(self, status: int, code: str, message: str, type_: str):
        super().__init__(message)
        self.status, self.code, self.message, self.type = status, code, message, type_

    def as_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": None,
                          "code": self.code}}


def _insufficient() -> MeteringError:
    return MeteringError(402, "insufficient_quota", "Your balance is too low for this request: "
                         "top up your credit.", "insufficient_quota")


@dataclass(frozen=True)
class Price:
    price_id: int
    input_per_mtok: int
    output_per_mtok: int


@dataclass(frozen=True)
class HoldInfo:
    hold_id: int
    request_id: str
    amount_micros: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    estimated: bool = False  # the engine sent no usage: these are the tokens delivered


@dataclass(frozen=True)
class Worker:
    provider_id: int | None  # the user who earns; None: the platform served it itself
    reference: str  # e.g. card:7


@dataclass(frozen=True)
class ChargeInfo:
    request_id: str
    cost_micros: int
    prompt_tokens: int
    completion_tokens: int
    estimated: bool
    capped: bool


def price_at(model: str, at: datetime | None = None) -> Price:
    row = (ModelPrice.objects.filter(model=model, effective_at__lte=at or timezone.now())
           .order_by("-effective_at").first())
    if row is None:
        raise MeteringError(404, "model_not_found", f"The model '{model}' has no price.",
                            "invalid_request_error")
    return Price(row.pk, row.input_micros_per_mtok, row.output_micros_per_mtok)


def max_cost_micros(price: Price, *, prompt_tokens: int, max_tokens: int) -> int:
    return pricing.token_cost_micros(input_per_mtok=price.input_per_mtok,
                                     output_per_mtok=price.output_per_mtok,
                                     prompt_tokens=prompt_tokens, completion_tokens=max_tokens)


def period_start(period: str, now: datetime) -> datetime:
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "daily":
        return day
    if period == "weekly":
        return day - timedelta(days=day.weekday())
    return day.replace(day=1)


def reserve(*, key: KeyInfo, model: str, price: Price, max_cost: int, request_id: str,
            tokens: int, now: datetime | None = None) -> HoldInfo:
    """Hold the request's worst-case cost. Fails fast: model not allowed (403), rate limit or
    key spend limit (429), balance too low (402)."""
    now = now or timezone.now()
    if key.allowed_models and model not in key.allowed_models:
        raise MeteringError(403, "model_not_allowed", f"This API key may not use '{model}'.",
                            "permission_error")
    broken = ratelimit.take(key_id=key.key_id, requests_limit=key.requests_per_minute,
                            tokens_limit=key.tokens_per_minute, tokens=tokens)
    if broken:
        raise MeteringError(429, "rate_limit_exceeded",
                            f"This API key's {broken}-per-minute limit is reached; retry in a "
                            "minute.", "rate_limit_error")
    if max_cost <= 0:
        max_cost = 1  # a hold is never empty: settle needs something to draw from
    wallet = ledger.account_id(Account.Kind.WALLET, key.user_id)
    holds = ledger.account_id(Account.Kind.HOLDS, key.user_id)
    spend_start = period_start(key.spend_period, now) if key.spend_limit_micros is not None \
        else None
    try:
        with transaction.atomic():
            # The hold row first (the lock order is hold, key spend, accounts): its unique
            # request id turns a replay into a no-op before any limit or balance is touched.
            with connection.cursor() as cur:
                cur.execute(
                    "INSERT INTO billing_hold (request_id, user_id, api_key_id, model,"
                    " amount_micros, price_id, spend_period_start, status, created_at,"
                    " expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                    " ON CONFLICT (request_id) DO NOTHING RETURNING id",
                    [request_id, key.user_id, key.key_id, model, max_cost, price.price_id,
                     spend_start, Hold.Status.PENDING, now, now + HOLD_TTL])
                row = cur.fetchone()
            if row is None:
                return _hold_info(request_id)
            if spend_start is not None:
                _key_spend_take(key, spend_start, max_cost)
            ledger.post(kind=Transfer.Kind.RESERVE, idempotency_key=f"reserve:{request_id}",
                        legs=[(wallet, -max_cost), (holds, max_cost)],
                        reference=f"request:{request_id}", now=now, savepoint=False)
    except ledger.InsufficientFunds:
        raise _insufficient() from None
    return HoldInfo(row[0], request_id, max_cost)


def _hold_info(request_id: str) -> HoldInfo:
    hold_id, amount = Hold.objects.values_list("pk", "amount_micros").get(request_id=request_id)
    return HoldInfo(hold_id, request_id, amount)


def _key_spend_take(key: KeyInfo, start: datetime, amount: int) -> None:
    with connection.cursor() as cur:
        cur.execute("INSERT INTO billing_keyspend (api_key_id, period_start, used_micros)"
                    " VALUES (%s, %s, 0) ON CONFLICT (api_key_id, period_start) DO NOTHING",
                    [key.key_id, start])
        cur.execute("UPDATE billing_keyspend SET used_micros = used_micros + %s"
                    " WHERE api_key_id = %s AND period_start = %s AND used_micros + %s <= %s",
                    [amount, key.key_id, start, amount, key.spend_limit_micros])
        if cur.rowcount != 1:
            raise MeteringError(429, "key_limit_reached",
                                f"This API key has reached its {key.spend_period} spend limit.",
                                "insufficient_quota")


def _key_spend_give_back(hold: Hold, amount: int) -> None:
    if hold.spend_period_start is not None and amount:
        KeySpend.objects.filter(api_key_id=hold.api_key_id,
                                period_start=hold.spend_period_start).update(
            used_micros=F("used_micros") - amount)


def settle(*, request_id: str, usage: Usage, worker: Worker | None,
           now: datetime | None = None) -> ChargeInfo | None:
    """Bill the request's real tokens at the price in force when it started, pay the provider
    their share and the platform its fee, and give back the rest of the hold. Idempotent by
    request id: a second call returns the first charge. Nothing used at all: released, None."""
    now = now or timezone.now()
    if usage.prompt_tokens <= 0 and usage.completion_tokens <= 0:
        if release(request_id=request_id, now=now):
            return None
        charge = Charge.objects.filter(request_id=request_id).first()  # settled before
        return _charge_info(charge) if charge else None
    with transaction.atomic():
        # of=self: locking the joined price row too would block every reserve of that model.
        hold = Hold.objects.select_for_update(of=("self",)).select_related("price").get(
            request_id=request_id)
        if hold.status == Hold.Status.SETTLED:
            return _charge_info(Charge.objects.get(request_id=request_id))
        if hold.status != Hold.Status.PENDING:
            raise MeteringError(409, "hold_closed", f"Request {request_id} was already "
                                f"{hold.status}; nothing to settle.", "invalid_request_error")
        cost = pricing.token_cost_micros(
            input_per_mtok=hold.price.input_micros_per_mtok,
            output_per_mtok=hold.price.output_micros_per_mtok,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
        capped = cost > hold.amount_micros
        cost = min(cost, hold.amount_micros)
        provider_share, fee = pricing.fee_split(
            cost, settings.RIGSHARE_PLATFORM_FEE_BPS if worker and worker.provider_id else 10_000)
        holds = ledger.account_id(Account.Kind.HOLDS, hold.user_id)
        legs = [(holds, -hold.amount_micros),
                (ledger.account_id(Account.Kind.WALLET, hold.user_id), hold.amount_micros - cost),
                (ledger.account_id(Account.Kind.PLATFORM_REVENUE), fee)]
        if provider_share:
            legs.append((ledger.account_id(Account.Kind.EARNINGS, worker.provider_id),
                         provider_share))
        _key_spend_give_back(hold, hold.amount_micros - cost)
        posted = ledger.post(kind=Transfer.Kind.SETTLE, idempotency_key=f"settle:{request_id}",
                             legs=legs, reference=f"request:{request_id}", now=now,
                             savepoint=False)
        hold.status, hold.closed_at = Hold.Status.SETTLED, now
        hold.save(update_fields=["status", "closed_at"])
        charge = Charge.objects.create(
            request_id=request_id, hold=hold, user_id=hold.user_id, api_key_id=hold.api_key_id,
            model=hold.model, provider_id=worker.provider_id if worker else None,
            worker=worker.reference if worker else "", prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens, cost_micros=cost,
            provider_micros=provider_share, fee_micros=fee, estimated=usage.estimated,
            capped=capped, transfer_id=posted.transfer_id, created_at=now)
    return _charge_info(charge)


def release(*, request_id: str, expired: bool = False, now: datetime | None = None) -> bool:
    """Give a pending hold back to the wallet; False if it was already closed."""
    now = now or timezone.now()
    with transaction.atomic():
        hold = Hold.objects.select_for_update().get(request_id=request_id)
        if hold.status != Hold.Status.PENDING:
            return False
        _key_spend_give_back(hold, hold.amount_micros)
        ledger.post(kind=Transfer.Kind.RELEASE, idempotency_key=f"release:{request_id}",
                    legs=[(ledger.account_id(Account.Kind.HOLDS, hold.user_id),
                           -hold.amount_micros),
                          (ledger.account_id(Account.Kind.WALLET, hold.user_id),
                           hold.amount_micros)],
                    reference=f"request:{request_id}", now=now, savepoint=False)
        hold.status = Hold.Status.EXPIRED if expired else Hold.Status.RELEASED
        hold.closed_at = now
        hold.save(update_fields=["status", "closed_at"])
    return True


def holds_expire(*, now: datetime | None = None) -> int:
    """Release holds whose request never settled (a crashed server, a lost connection)."""
    now = now or timezone.now()
    due = list(Hold.objects.filter(status=Hold.Status.PENDING, expires_at__lte=now)
               .values_list("request_id", flat=True)[:1000])
    return sum(release(request_id=r, expired=True, now=now) for r in due)


def _charge_info(charge: Charge) -> ChargeInfo:
    return ChargeInfo(charge.request_id, charge.cost_micros, charge.prompt_tokens,
                      charge.completion_tokens, charge.estimated, charge.capped)
