"""Reads shared by billing pages, the API, tests and the reconciliation task."""

from datetime import UTC, datetime

from django.db import connection
from django.db.models import Count, F, OuterRef, Subquery, Sum, Window
from django.db.models.functions import Coalesce, TruncDate

from billing import ledger
from billing.models import Account, ApiKey, Charge, Entry, KeySpend, Payment, Payout


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
