"""Reads shared by billing pages, the API, tests and the reconciliation task."""

from django.db import connection

from billing import ledger
from billing.models import Account


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
            SELECT a.id, a.balance_micros, COALESCE(SUM(e.amount_micros), 0)
              FROM billing_account a LEFT JOIN billing_entry e ON e.account_id = a.id
             GROUP BY a.id, a.balance_micros
            HAVING a.balance_micros <> COALESCE(SUM(e.amount_micros), 0)""")
        problems += [f"account {a} holds {b} but its entries sum to {s}"
                     for a, b, s in cur.fetchall()]
    problems += [f"account {a} is overdrawn" for a in Account.objects.filter(
        allow_negative=False, balance_micros__lt=0).values_list("pk", flat=True)]
    return problems


def wallet_balance(user_id: int) -> int:
    return ledger.balance(Account.Kind.WALLET, user_id)
