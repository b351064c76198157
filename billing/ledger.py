"""The ledger's one write path: post a transfer whose legs sum to zero.

Raw SQL on purpose: this runs twice per inference request, and each statement here is the
whole check (the conditional UPDATE *is* the overdraft check, the ON CONFLICT *is* the
idempotency check). Rows are locked in one order everywhere: hold, key spend, then accounts by
id, so concurrent transfers never deadlock.

Only a user's wallet and holds keep a running balance (they are what requests debit). Every
other account's balance is the sum of its entries: crediting the platform or a provider then
touches no shared row, which would otherwise serialise every request of the fleet.
"""

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.db.models import Sum
from django.utils import timezone

from billing.models import Account, Entry


class LedgerError(Exception):
    pass


class InsufficientFunds(LedgerError):
    def __init__(self, account_id: int):
        super().__init__(f"account {account_id} cannot cover this debit")
        self.account_id = account_id


@dataclass(frozen=True)
class Posted:
    transfer_id: int
    created: bool  # False: the idempotency key was seen before and nothing moved


_ACCOUNT_IDS: dict[tuple[int | None, str], int] = {}
_KIND_OF: dict[int, str] = {}


def account_id(kind: str, owner_id: int | None = None) -> int:
    """The id of a user's account of a kind (created on first use) or of a system account.
    Accounts are never deleted, so ids are remembered for the life of the process."""
    key = (owner_id, kind)
    if key in _ACCOUNT_IDS:
        return _ACCOUNT_IDS[key]
    row, _ = Account.objects.get_or_create(
        kind=kind, owner_id=owner_id, defaults={"allow_negative": kind in Account.SOURCE_KINDS})

    def remember():
        _ACCOUNT_IDS[key] = row.pk
        _KIND_OF[row.pk] = kind

    # Remember it only once it is committed: a rolled-back transaction takes the row with it.
    transaction.on_commit(remember)
    return row.pk


def forget_account_ids() -> None:
    """Tests that flush the database call this; ids would otherwise point at nothing."""
    _ACCOUNT_IDS.clear()
    _KIND_OF.clear()


def _kinds(cur, ids) -> dict[int, str]:
    missing = [i for i in ids if i not in _KIND_OF]
    if missing:
        placeholders = ", ".join(["%s"] * len(missing))
        cur.execute(f"SELECT id, kind FROM billing_account WHERE id IN ({placeholders})",
                    missing)
        found = dict(cur.fetchall())
        if len(found) != len(missing):
            raise LedgerError(f"no such account among {missing}")
        _KIND_OF.update(found)  # an id never changes kind, and ids are never reused
    return _KIND_OF


def post(*, kind: str, idempotency_key: str, legs: list[tuple[int, int]], reference: str = "",
         memo: str = "", now: datetime | None = None, savepoint: bool = True) -> Posted:
    """Move money between accounts in one transaction. `legs` are (account id, amount), with
    positive amounts credited and negative debited; they must sum to zero. A replayed key
    returns the first transfer and moves nothing. Raises InsufficientFunds, rolling back.
    `savepoint=False` saves two statements inside a caller's transaction that ends anyway when
    this refuses (the request path); the caller's transaction is then unusable after a refusal."""
    totals: dict[int, int] = defaultdict(int)
    for account, amount in legs:
        totals[account] += amount
    if sum(totals.values()) != 0:
        raise LedgerError(f"legs of {idempotency_key} sum to {sum(totals.values())}, not 0")
    legs = sorted((a, m) for a, m in totals.items() if m != 0)
    if not legs:
        raise LedgerError(f"{idempotency_key} moves no money")
    with transaction.atomic(savepoint=savepoint), connection.cursor() as cur:
        cur.execute(
            "INSERT INTO billing_transfer (kind, idempotency_key, reference, memo, created_at)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING RETURNING id",
            [kind, idempotency_key, reference, memo, now or timezone.now()])
        row = cur.fetchone()
        if row is None:
            cur.execute("SELECT id FROM billing_transfer WHERE idempotency_key = %s",
                        [idempotency_key])
            return Posted(cur.fetchone()[0], created=False)
        transfer_id = row[0]
        kinds = _kinds(cur, [account for account, _ in legs])
        for account, amount in legs:
            kind = kinds[account]
            if kind in Account.KEEPS_BALANCE:
                cur.execute(
                    "UPDATE billing_account SET balance_micros = balance_micros + %s"
                    " WHERE id = %s AND balance_micros + %s >= 0", [amount, account, amount])
                if cur.rowcount != 1:
                    raise InsufficientFunds(account)
            elif amount < 0 and kind not in Account.SOURCE_KINDS:
                # A debit from an account whose balance is the sum of its entries (earnings,
                # paid out rarely): lock its row so such debits queue, then check the sum.
                # Credits never lock it, so a busy provider or the platform is no hot row.
                cur.execute("SELECT id FROM billing_account WHERE id = %s FOR UPDATE", [account])
                cur.execute("SELECT COALESCE(SUM(amount_micros), 0) FROM billing_entry"
                            " WHERE account_id = %s", [account])
                if cur.fetchone()[0] + amount < 0:
                    raise InsufficientFunds(account)
        values = ", ".join(["(%s, %s, %s)"] * len(legs))
        cur.execute(
            f"INSERT INTO billing_entry (transfer_id, account_id, amount_micros) VALUES {values}",
            [x for account, amount in legs for x in (transfer_id, account, amount)])
    return Posted(transfer_id, created=True)


def balance(kind: str, owner_id: int | None = None) -> int:
    """An account's balance; 0 for an account never used (reading creates nothing)."""
    accounts = Account.objects.filter(kind=kind, owner_id=owner_id)
    if kind in Account.KEEPS_BALANCE:
        return accounts.values_list("balance_micros", flat=True).first() or 0
    return Entry.objects.filter(account__in=accounts).aggregate(
        total=Sum("amount_micros"))["total"] or 0
