"""The ledger's one write path: post a transfer whose legs sum to zero.

Raw SQL on purpose: this runs twice per inference request, and each statement here is the
whole check (the conditional UPDATE *is* the overdraft check, the ON CONFLICT *is* the
idempotency check). Rows are locked in one order everywhere: hold, key spend, then accounts by
id, so concurrent transfers never deadlock.
"""

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.utils import timezone

from billing.models import Account


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


def account_id(kind: str, owner_id: int | None = None) -> int:
    """The id of a user's account of a kind (created on first use) or of a system account.
    Accounts are never deleted, so ids are remembered for the life of the process."""
    key = (owner_id, kind)
    if key in _ACCOUNT_IDS:
        return _ACCOUNT_IDS[key]
    row, _ = Account.objects.get_or_create(
        kind=kind, owner_id=owner_id, defaults={"allow_negative": kind in Account.SOURCE_KINDS})
    # Remember it only once it is committed: a rolled-back transaction takes the row with it.
    transaction.on_commit(lambda: _ACCOUNT_IDS.__setitem__(key, row.pk))
    return row.pk


def forget_account_ids() -> None:
    """Tests that flush the database call this; ids would otherwise point at nothing."""
    _ACCOUNT_IDS.clear()


def post(*, kind: str, idempotency_key: str, legs: list[tuple[int, int]], reference: str = "",
         memo: str = "", now: datetime | None = None) -> Posted:
    """Move money between accounts in one transaction. `legs` are (account id, amount), with
    positive amounts credited and negative debited; they must sum to zero. A replayed key
    returns the first transfer and moves nothing. Raises InsufficientFunds, rolling back."""
    totals: dict[int, int] = defaultdict(int)
    for account, amount in legs:
        totals[account] += amount
    if sum(totals.values()) != 0:
        raise LedgerError(f"legs of {idempotency_key} sum to {sum(totals.values())}, not 0")
    legs = sorted((a, m) for a, m in totals.items() if m != 0)
    if not legs:
        raise LedgerError(f"{idempotency_key} moves no money")
    with transaction.atomic(), connection.cursor() as cur:
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
        for account, amount in legs:
            cur.execute(
                "UPDATE billing_account SET balance_micros = balance_micros + %s"
                " WHERE id = %s AND (allow_negative OR balance_micros + %s >= 0)",
                [amount, account, amount])
            if cur.rowcount != 1:
                raise InsufficientFunds(account)
        values = ", ".join(["(%s, %s, %s)"] * len(legs))
        cur.execute(
            f"INSERT INTO billing_entry (transfer_id, account_id, amount_micros) VALUES {values}",
            [x for account, amount in legs for x in (transfer_id, account, amount)])
    return Posted(transfer_id, created=True)


def balance(kind: str, owner_id: int | None = None) -> int:
    """An account's balance; 0 for an account never used (reading creates nothing)."""
    return Account.objects.filter(kind=kind, owner_id=owner_id).values_list(
        "balance_micros", flat=True).first() or 0
