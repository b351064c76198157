"""Reads shared by billing pages, the API, tests and the reconciliation task."""

from dataclasses import dataclass
from datetime import UTC, datetime

from django.db import connection
from django.db.models import Count, F, OuterRef, Subquery, Sum, Window
from django.db.models.functions import Coalesce, TruncDate
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from billing import ledger, pricing
from billing.models import (
    Account,
    ApiKey,
    Charge,
    Entry,
    KeySpend,
    ModelPrice,
    Payment,
    Payout,
    PayoutDestination,
)


def ledger_problems() -> list[str]:
    """Everything that would mean money was lost or invented: transfers whose legs do not sum
    to zero, accounts whose balance is not the sum of their entries, overdrafts."""
    problems = []
    with connection.cursor() as cur:
        cur.execute("SELECT COALESCE(SUM(amount_micros), 0) FROM billing_entry")
        total = cur.fetchone()[0]
        if total != 0:
            problems.append(f"all entries sum to {total}, not 0")
        cur.execute("SELECT transfer_id, SUM(amount_micros) FROM billing_entry"
                    " GROUP BY transfer_id HAVING SUM(amount_micros) <> 0")
        problems += [f"transfer {t} sums to {s}" for t, s in cur.fetchall()]
        cur.execute("""
            SELECT a.id, a.kind, a.balance_micros, COALESCE(SUM(e.amount_micros), 0)
              FROM billing_account a LEFT JOIN billing_entry e ON e.account_id = a.id
             GROUP BY a.id, a.kind, a.balance_micros""")
        for account, kind, kept, total in cur.fetchall():
            if kind in Account.KEEPS_BALANCE and kept != total:
                problems.append(f"account {account} holds {kept} but its entries sum to {total}")
            if kind not in Account.SOURCE_KINDS and total < 0:
                problems.append(f"account {account} ({kind}) is overdrawn: {total}")
    return problems


def wallet_balance(user_id: int) -> int:
    return ledger.balance(Account.Kind.WALLET, user_id)


# --- pages and the REST API (each reads only what its user owns) ---

def user_balances(user_id: int) -> dict[str, int]:
    """Balance per kind of the user's accounts (wallet, holds: credit reserved for requests in
    flight, earnings), 0 for one not opened yet. Two queries; a read never opens an account."""
    found = dict(Account.objects.filter(owner_id=user_id, kind__in=Account.KEEPS_BALANCE)
                 .values_list("kind", "balance_micros"))
    balances = {kind: found.get(kind, 0) for kind in Account.KEEPS_BALANCE}
    balances[Account.Kind.EARNINGS] = ledger.balance(Account.Kind.EARNINGS, user_id)
    return balances


def user_entries(user_id: int, kinds=Account.USER_KINDS):
    """The user's ledger entries, newest first, each with its transfer and `balance_after_micros`
    (the account's balance after it: a window sum, computed by the same one query). Ordered by
    transfer id, not time: callers may date a transfer (`now=`), the sequence is what happened."""
    running = Window(Sum("amount_micros"), partition_by=[F("account_id")],
                     order_by=[F("transfer_id").asc()])
    return (Entry.objects.filter(account__owner_id=user_id, account__kind__in=kinds)
            .select_related("transfer", "account")
            .annotate(balance_after_micros=running)
            .order_by("-transfer_id", "-id"))


def pending_payouts_micros(user_id: int) -> int:
    return Payout.objects.filter(provider_id=user_id, status=Payout.Status.REQUESTED).aggregate(
        total=Coalesce(Sum("amount_micros"), 0))["total"]


def payouts_of(user_id: int):
    return Payout.objects.filter(provider_id=user_id).order_by("-requested_at", "-id")


def payments_of(user_id: int):
    return Payment.objects.filter(user_id=user_id).order_by("-created_at", "-id")


def api_keys_of(user_id: int):
    """The user's keys, each with its latest spend period and what it used then
    (`spend_period_start`, `spend_used_micros`): one query."""
    latest = KeySpend.objects.filter(api_key=OuterRef("pk")).order_by("-period_start")
    return (ApiKey.objects.filter(user_id=user_id)
            .annotate(spend_period_start=Subquery(latest.values("period_start")[:1]),
                      spend_used_micros=Subquery(latest.values("used_micros")[:1]))
            .order_by("-created_at", "-id"))


def usage_by_day_and_model(user_id: int, *, since: datetime, api_key_id: int | None = None):
    """Requests, tokens and cost of the user's charges per UTC day and model since `since`,
    newest day first: one GROUP BY in the database."""
    rows = Charge.objects.filter(user_id=user_id, created_at__gte=since)
    if api_key_id is not None:
        rows = rows.filter(api_key_id=api_key_id)
    return (rows.annotate(day=TruncDate("created_at", tzinfo=UTC))
            .values("day", "model")
            .annotate(requests=Count("id"), prompt_tokens=Sum("prompt_tokens"),
                      completion_tokens=Sum("completion_tokens"), cost_micros=Sum("cost_micros"))
            .order_by("-day", "model"))


# A request moves credit three or four times (reserve, then settle and give back the rest, or
# release); the statement shows it as one line, its net cost.
REQUEST_TRANSFER_KINDS = ("reserve", "settle", "release")


@dataclass(frozen=True)
class StatementLine:
    transfer_id: int  # the last transfer of the line: the statement's order
    created_at: datetime
    ledger: str  # "credit" (wallet and held credit together) or "earnings"
    kind: str  # a transfer kind, or "request"
    reference: str
    memo: str
    amount_micros: int
    balance_after_micros: int  # of the line's ledger, after the line
    model: str = ""  # a request's model
    requests_pending: bool = False  # a request whose hold is still open
    cursor: str = ""  # where the next page starts: `before=` for user_statement


# Portable SQL (PostgreSQL, and the demo's SQLite): the running balance is taken per transfer
# (a window over the per-transfer sums) and joined to each line at its last transfer.
_REQUEST_KINDS_SQL = ", ".join(f"'{kind}'" for kind in REQUEST_TRANSFER_KINDS)
_STATEMENT_SQL = f"""
WITH e AS (
    SELECT en.id, en.transfer_id, en.amount_micros, t.kind, t.reference, t.memo, t.created_at,
           CASE WHEN a.kind = 'earnings' THEN 'earnings' ELSE 'credit' END AS ledger
      FROM billing_entry en
      JOIN billing_account a ON a.id = en.account_id
      JOIN billing_transfer t ON t.id = en.transfer_id
     WHERE a.owner_id = %(user)s AND a.kind IN ('wallet', 'holds', 'earnings')
), running AS (
    SELECT ledger, transfer_id,
           SUM(SUM(amount_micros)) OVER (PARTITION BY ledger ORDER BY transfer_id) AS balance
      FROM e GROUP BY ledger, transfer_id
), g AS (
    SELECT CASE WHEN kind IN ({_REQUEST_KINDS_SQL}) THEN ledger || ':' || reference
                ELSE 'entry:' || CAST(id AS TEXT) END AS line,
           MAX(CASE WHEN kind IN ({_REQUEST_KINDS_SQL}) THEN 1 ELSE 0 END) AS is_request,
           MIN(CASE WHEN kind = 'reserve' THEN 1 ELSE 0 END) AS only_reserved,
           MAX(transfer_id) AS transfer_id, MAX(created_at) AS created_at,
           MIN(ledger) AS ledger, MIN(kind) AS kind, MIN(reference) AS reference,
           MIN(memo) AS memo, SUM(amount_micros) AS amount_micros
      FROM e GROUP BY 1
)
SELECT g.transfer_id, g.created_at, g.ledger,
       CASE WHEN g.is_request = 1 THEN 'request' ELSE g.kind END, g.reference, g.memo,
       g.amount_micros, r.balance, COALESCE(h.model, ''), g.only_reserved = 1,
       CAST(g.transfer_id AS TEXT) || '_' || g.line
  FROM g
  JOIN running r ON r.ledger = g.ledger AND r.transfer_id = g.transfer_id
  LEFT JOIN billing_hold h
    ON g.is_request = 1 AND h.request_id = substr(g.reference, length('request:') + 1)
 {{where}}
 ORDER BY g.transfer_id DESC, g.line DESC
 LIMIT %(limit)s
"""
_AFTER_CURSOR = ("WHERE g.transfer_id < %(before_id)s"
                 " OR (g.transfer_id = %(before_id)s AND g.line < %(before_line)s)")


def user_statement(user_id: int, *, limit: int, before: str = "") -> list[StatementLine]:
    """The user's ledger as people read a statement, newest first: one line a transfer and
    ledger, except that a request's reserve, settle and give-back are one line with its net
    cost. Keyset-paged: `before` is the last line's `cursor` of the page before (a cursor that
    does not parse starts at the newest line). One query."""
    before_id, _, before_line = before.partition("_")
    paged = before_id.isdigit() and len(before_id) < 19 and bool(before_line)
    params = {"user": user_id, "limit": limit, "before_id": int(before_id) if paged else 0,
              "before_line": before_line}
    with connection.cursor() as cur:
        cur.execute(_STATEMENT_SQL.format(where=_AFTER_CURSOR if paged else ""), params)
        rows = cur.fetchall()
    lines = []
    for row in rows:
        created_at = row[1]
        if isinstance(created_at, str):  # SQLite hands raw SQL its datetimes as text
            created_at = parse_datetime(created_at)
            if timezone.is_naive(created_at):
                created_at = timezone.make_aware(created_at, UTC)
        lines.append(StatementLine(row[0], created_at, *row[2:9], bool(row[9]), row[10]))
    return lines


# --- the account holder's own data (download, closure) ---

def personal_data(user_id: int) -> dict:
    """What billing holds about a person, for their data download: plain JSON values,
    amounts in micro-dollars as the ledger keeps them. Secrets are never in it (keys are
    stored as a prefix and an HMAC); a payout destination is masked as the pages show it."""
    def when(value):
        return value.isoformat() if value else None

    entries = (Entry.objects.filter(account__owner_id=user_id)
               .select_related("transfer", "account").order_by("transfer_id", "id"))
    return {
        "balances_micros": user_balances(user_id),
        "ledger_entries": [
            {"transfer": e.transfer_id, "kind": e.transfer.kind, "account": e.account.kind,
             "amount_micros": e.amount_micros, "reference": e.transfer.reference,
             "memo": e.transfer.memo, "at": when(e.transfer.created_at)} for e in entries],
        "payments": [
            {"id": p.pk, "amount_micros": p.amount_micros, "status": p.status,
             "created_at": when(p.created_at)} for p in payments_of(user_id)],
        "payouts": [
            {"id": p.pk, "amount_micros": p.amount_micros, "status": p.status,
             "requested_at": when(p.requested_at), "decided_at": when(p.decided_at)}
            for p in payouts_of(user_id)],
        "payout_destination": next(
            (d.masked() for d in PayoutDestination.objects.filter(provider_id=user_id)), None),
        "api_keys": [
            {"name": k.name, "prefix": f"rs_{k.prefix}_", "created_at": when(k.created_at),
             "last_used_at": when(k.last_used_at), "revoked_at": when(k.revoked_at),
             "spend_limit_micros": k.spend_limit_micros, "spend_period": k.spend_period,
             "allowed_models": k.allowed_models}
            for k in ApiKey.objects.filter(user_id=user_id).order_by("created_at", "id")],
        "usage_by_day": [
            dict(row, day=row["day"].isoformat()) for row in usage_by_day_and_model(
                user_id, since=datetime(2000, 1, 1, tzinfo=UTC))],
    }


def closure_problems(user_id: int) -> list[str]:
    """Why billing cannot let the account close yet: money in motion or owed to its holder.
    Credit left in the wallet is not a problem here: its holder may give it up."""
    problems = []
    balances = user_balances(user_id)
    if balances[Account.Kind.HOLDS] > 0:
        problems.append("Requests of yours are still in flight; try again in a minute.")
    if pending_payouts_micros(user_id):
        problems.append("A payout you requested awaits review.")
    if balances[Account.Kind.EARNINGS] > 0:
        problems.append(f"You have {pricing.format_usd(balances[Account.Kind.EARNINGS])} of "
                        "unpaid earnings: request a payout first.")
    return problems


def model_prices_now(models, *, now: datetime | None = None) -> dict[str, ModelPrice]:
    """The price in force now of each of these public model names that has one: the latest
    row whose effective_at has come (a request pays the price in force when it starts). One
    query."""
    now = now or timezone.now()
    found: dict[str, ModelPrice] = {}
    for row in (ModelPrice.objects.filter(model__in=list(models), effective_at__lte=now)
                .order_by("model", "-effective_at")):
        found.setdefault(row.model, row)
    return found
