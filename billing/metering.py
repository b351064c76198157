"""Metering for the inference API: reserve before a call, settle or release after it.

Callers pass and get plain values (KeyInfo, HoldInfo, ChargeInfo), never model instances, so
the request path holds no ORM objects. Every refusal a client should hear of is a
MeteringError subclass; routing/errors.py says how /v1 answers each.

Reserve and settle run twice per inference request, so on PostgreSQL each is one call of a
database function (billing/migrations/0004_metering_functions.py): one round trip, which is
its own transaction, instead of 7-8 statements between BEGIN and COMMIT. Elsewhere (SQLite,
the zero-setup demo), or with SQL_FUNCTIONS off, the same rows are written statement by
statement through billing.ledger. Both paths take the same locks in the same order, refuse
with the same errors, and share the price arithmetic below; the metering tests run both.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.models import F
from django.utils import timezone

from billing import ledger, pricing, ratelimit
from billing.errors import (
    HoldClosed,
    InsufficientBalance,
    KeySpendLimitReached,
    MeteringError,
    ModelNotAllowed,
    RateLimited,
)
from billing.keys import KeyInfo
from billing.models import Account, Charge, Hold, KeySpend, Transfer

HOLD_TTL = timedelta(hours=2)  # longer than any request may run; then billing.usage closes it
SQL_FUNCTIONS = True  # on PostgreSQL, reserve and settle through the database functions


def _insufficient() -> MeteringError:
    return InsufficientBalance("Your balance is too low for this request: top up your credit.")


def _key_limit_reached(key: "KeyInfo") -> MeteringError:
    return KeySpendLimitReached(f"This API key has reached its {key.spend_period} spend limit.")


def _hold_closed(request_id: str, status: str) -> MeteringError:
    return HoldClosed(f"Request {request_id} was already {status}; nothing to settle.")


@dataclass(frozen=True)
class Price:
    price_id: int
    input_per_mtok: int
    output_per_mtok: int


@dataclass(frozen=True)
class HoldInfo:
    """What settle needs to bill a request without reading the hold first."""

    hold_id: int
    request_id: str
    amount_micros: int
    user_id: int
    price: Price  # in force when the request started: the request is billed at it


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    estimated: bool = False  # the engine sent no usage: these are the tokens delivered


@dataclass(frozen=True)
class Worker:
    provider_id: int | None  # the user who earns; None: the platform served it itself
    reference: str  # what earned it, as the seller names it: node:7 (a machine)


@dataclass(frozen=True)
class ChargeInfo:
    request_id: str
    cost_micros: int
    prompt_tokens: int
    completion_tokens: int
    estimated: bool
    capped: bool


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


def _in_database() -> bool:
    return SQL_FUNCTIONS and connection.vendor == "postgresql"


def reserve(*, key: KeyInfo, model: str, price: Price, max_cost: int, request_id: str,
            tokens: int, now: datetime | None = None) -> HoldInfo:
    """Hold the request's worst-case cost. Fails fast: model not allowed, rate limit, key
    spend limit, balance too low. Replaying a request id returns its hold."""
    now = now or timezone.now()
    if key.allowed_models and model not in key.allowed_models:
        raise ModelNotAllowed(f"This API key may not use '{model}'.")
    broken = ratelimit.take(key_id=key.key_id, requests_limit=key.requests_per_minute,
                            tokens_limit=key.tokens_per_minute, tokens=tokens)
    if broken:
        raise RateLimited(f"This API key's {broken}-per-minute limit is reached; retry in a "
                          "minute.")
    if max_cost <= 0:
        max_cost = 1  # a hold is never empty: settle needs something to draw from
    wallet = ledger.account_id(Account.Kind.WALLET, key.user_id)
    holds = ledger.account_id(Account.Kind.HOLDS, key.user_id)
    spend_start = period_start(key.spend_period, now) if key.spend_limit_micros is not None \
        else None
    try:
        if _in_database():
            row = _call(_RESERVE, [request_id, key.user_id, key.key_id, model, max_cost,
                                   price.price_id, spend_start, key.spend_limit_micros, now,
                                   now + HOLD_TTL, wallet, holds])
            if row[6]:  # replayed: the hold as it was first made
                return HoldInfo(row[0], request_id, row[1], row[2], Price(*row[3:6]))
            return HoldInfo(row[0], request_id, max_cost, key.user_id, price)
        return _reserve_in_python(key, model, price, max_cost, request_id, now, wallet, holds,
                                  spend_start)
    except ledger.InsufficientFunds:
        raise _insufficient() from None
    except _Refused as refused:
        if refused.sqlstate == "RS402":
            raise _insufficient() from None
        if refused.sqlstate == "RS429":
            raise _key_limit_reached(key) from None
        raise refused.error(request_id) from None


_RESERVE = ("SELECT * FROM billing_reserve(%s, %s, %s, %s, %s, %s, %s::timestamptz,"
            " %s::bigint, %s, %s, %s, %s)")


def _reserve_in_python(key, model, price, max_cost, request_id, now, wallet, holds,
                       spend_start) -> HoldInfo:
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
            hold = Hold.objects.select_related("price").get(request_id=request_id)
            return HoldInfo(hold.pk, request_id, hold.amount_micros, hold.user_id,
                            Price(hold.price_id, hold.price.input_micros_per_mtok,
                                  hold.price.output_micros_per_mtok))
        if spend_start is not None:
            _key_spend_take(key, spend_start, max_cost)
        ledger.post(kind=Transfer.Kind.RESERVE, idempotency_key=f"reserve:{request_id}",
                    legs=[(wallet, -max_cost), (holds, max_cost)],
                    reference=f"request:{request_id}", now=now, savepoint=False)
    return HoldInfo(row[0], request_id, max_cost, key.user_id, price)


def _key_spend_take(key: KeyInfo, start: datetime, amount: int) -> None:
    with connection.cursor() as cur:
        cur.execute("INSERT INTO billing_keyspend (api_key_id, period_start, used_micros)"
                    " VALUES (%s, %s, 0) ON CONFLICT (api_key_id, period_start) DO NOTHING",
                    [key.key_id, start])
        cur.execute("UPDATE billing_keyspend SET used_micros = used_micros + %s"
                    " WHERE api_key_id = %s AND period_start = %s AND used_micros + %s <= %s",
                    [amount, key.key_id, start, amount, key.spend_limit_micros])
        if cur.rowcount != 1:
            raise _key_limit_reached(key)


def _key_spend_give_back(hold: Hold, amount: int) -> None:
    if hold.spend_period_start is not None and amount:
        KeySpend.objects.filter(api_key_id=hold.api_key_id,
                                period_start=hold.spend_period_start).update(
            used_micros=F("used_micros") - amount)


@dataclass(frozen=True)
class _Bill:
    cost: int
    capped: bool  # usage cost more than the hold: billed the hold
    provider_share: int
    fee: int


def _bill(hold: HoldInfo, usage: Usage, worker: Worker | None) -> _Bill:
    """The request's real tokens at the price it started under, never more than its hold,
    split between the provider and the platform."""
    cost = pricing.token_cost_micros(
        input_per_mtok=hold.price.input_per_mtok, output_per_mtok=hold.price.output_per_mtok,
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
    capped = cost > hold.amount_micros
    cost = min(cost, hold.amount_micros)
    provider_share, fee = pricing.fee_split(
        cost, settings.RIGSHARE_PLATFORM_FEE_BPS if worker and worker.provider_id else 10_000)
    return _Bill(cost, capped, provider_share, fee)


def settle(*, hold: HoldInfo, usage: Usage, worker: Worker | None,
           now: datetime | None = None) -> ChargeInfo | None:
    """Bill the request's real tokens at the price in force when it started, pay the provider
    their share and the platform its fee, and give back the rest of the hold. Idempotent by
    request id: a second call returns the first charge. Nothing used at all: released, None.
    `hold` is what reserve returned; the hold row must still match it."""
    now = now or timezone.now()
    request_id = hold.request_id
    if usage.prompt_tokens <= 0 and usage.completion_tokens <= 0:
        if release(request_id=request_id, now=now):
            return None
        charge = Charge.objects.filter(request_id=request_id).first()  # settled before
        return _charge_info(charge) if charge else None
    bill = _bill(hold, usage, worker)
    earnings = ledger.account_id(Account.Kind.EARNINGS, worker.provider_id) \
        if bill.provider_share else None
    holds = ledger.account_id(Account.Kind.HOLDS, hold.user_id)
    wallet = ledger.account_id(Account.Kind.WALLET, hold.user_id)
    platform = ledger.account_id(Account.Kind.PLATFORM_REVENUE)
    if not _in_database():
        return _settle_in_python(hold, usage, worker, bill, now, holds, wallet, platform,
                                 earnings)
    try:
        row = _call(_SETTLE, [
            request_id, hold.user_id, hold.amount_micros, hold.price.price_id, holds, wallet,
            platform, earnings, bill.cost, bill.fee, bill.provider_share,
            worker.provider_id if worker else None, worker.reference if worker else "",
            usage.prompt_tokens, usage.completion_tokens, usage.estimated, bill.capped, now])
    except _Refused as refused:
        raise refused.error(request_id) from None
    return ChargeInfo(request_id, *row)


_SETTLE = ("SELECT * FROM billing_settle(%s, %s, %s, %s, %s, %s, %s, %s::bigint, %s, %s, %s,"
           " %s::bigint, %s, %s, %s, %s, %s, %s)")


def _settle_in_python(hold: HoldInfo, usage: Usage, worker: Worker | None, bill: _Bill,
                      now: datetime, holds: int, wallet: int, platform: int,
                      earnings: int | None) -> ChargeInfo:
    request_id = hold.request_id
    with transaction.atomic():
        row = Hold.objects.select_for_update().get(request_id=request_id)
        if row.status == Hold.Status.SETTLED:
            return _charge_info(Charge.objects.get(request_id=request_id))
        if row.status != Hold.Status.PENDING:
            raise _hold_closed(request_id, row.status)
        if (row.amount_micros, row.price_id, row.user_id) != (
                hold.amount_micros, hold.price.price_id, hold.user_id):
            raise ValueError(f"settle of request {request_id} does not match its hold")
        legs = [(holds, -hold.amount_micros), (wallet, hold.amount_micros - bill.cost),
                (platform, bill.fee)]
        if bill.provider_share:
            legs.append((earnings, bill.provider_share))
        _key_spend_give_back(row, hold.amount_micros - bill.cost)
        posted = ledger.post(kind=Transfer.Kind.SETTLE, idempotency_key=f"settle:{request_id}",
                             legs=legs, reference=f"request:{request_id}", now=now,
                             savepoint=False)
        row.status, row.closed_at = Hold.Status.SETTLED, now
        row.save(update_fields=["status", "closed_at"])
        charge = Charge.objects.create(
            request_id=request_id, hold=row, user_id=row.user_id, api_key_id=row.api_key_id,
            model=row.model, provider_id=worker.provider_id if worker else None,
            worker=worker.reference if worker else "", prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens, cost_micros=bill.cost,
            provider_micros=bill.provider_share, fee_micros=bill.fee, estimated=usage.estimated,
            capped=bill.capped, transfer_id=posted.transfer_id, created_at=now)
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


def _charge_info(charge: Charge) -> ChargeInfo:
    return ChargeInfo(charge.request_id, charge.cost_micros, charge.prompt_tokens,
                      charge.completion_tokens, charge.estimated, charge.capped)


# --- the database functions' calling convention ---

class _Refused(Exception):
    """A database function refused with one of our SQLSTATEs (see migration 0004)."""

    def __init__(self, sqlstate: str, detail: str | None, message: str):
        super().__init__(message)
        self.sqlstate, self.detail = sqlstate, detail

    def error(self, request_id: str = "") -> Exception:
        """The error the Python path raises for the same refusal."""
        if self.sqlstate == "RS402":
            return ledger.InsufficientFunds(int(self.detail))
        if self.sqlstate == "RS409":
            return _hold_closed(request_id, self.detail)
        if self.sqlstate == "RS404":
            return Hold.DoesNotExist(f"no hold for request {request_id}")
        return ValueError(str(self))


def _call(sql: str, params: list) -> tuple:
    """One function call on the request path. Straight through psycopg: the statement is
    prepared once per connection and none of Django's cursor layers run (they cost more CPU
    than the call itself). Outside a transaction the call is one; inside a caller's, a
    savepoint keeps a refusal from breaking it, as transaction.atomic() does in Python."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.in_atomic_block:
        with transaction.atomic(using=db.alias):
            return _execute(db, sql, params)
    return _execute(db, sql, params)


def _execute(db, sql: str, params: list) -> tuple:
    if db.connection is None:
        db.ensure_connection()
    cur = db.__dict__.get("_metering_cursor")
    if cur is None or cur.connection is not db.connection:
        # A plain psycopg cursor binds on the server; Django hands out client-side binding
        # cursors, which never prepare. Django also turns psycopg's preparing off
        # (prepare_threshold None), which would make prepare=True a no-op: a threshold no
        # query reaches prepares exactly the statements that ask, these two. Prepared, a call
        # skips parsing and planning: a quarter less PostgreSQL CPU per pair, measured.
        # (Behind a transaction-pooling PgBouncer, that needs max_prepared_statements, 1.21+.)
        if db.connection.prepare_threshold is None:
            db.connection.prepare_threshold = 2**31
        cur = db._metering_cursor = psycopg.Cursor(db.connection)
    try:
        cur.execute(sql, params, prepare=True)
    except psycopg.Error as exc:
        if exc.sqlstate and exc.sqlstate.startswith("RS"):
            raise _Refused(exc.sqlstate, exc.diag.message_detail,
                           exc.diag.message_primary or str(exc)) from None
        with db.wrap_database_errors:
            raise
    return cur.fetchone()
