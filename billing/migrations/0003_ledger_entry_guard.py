"""One balance check per transfer instead of one per entry, with a guard that keeps it whole.

Migration 0002 checked a transfer's sum at commit once for the transfer and once more for each
of its entries: a settle of four legs ran five identical SUM queries, about a fifth of
PostgreSQL's work per request. The per-entry check existed so that an entry added to a
transfer later could not unbalance it. Now:

- the transfer's deferred check (0002, unchanged) still refuses at commit a transfer whose
  legs do not sum to zero or that has fewer than two;
- an entry may only join a transfer created by the same transaction (a savepoint inside it
  included), checked once per INSERT statement. So every entry is counted by its transfer's
  commit-time check, and a committed transfer can never gain an entry, not even a pair that
  sums to zero, which the per-entry check let through.

"Created by this transaction": the transfer row's xmin, widened to a full transaction id,
reads 'in progress' (pg_xact_status) only for this transaction and its subtransactions;
another transaction's uncommitted transfer is not visible here at all, and a committed one
reads 'committed'. (A frozen row keeps its raw 32-bit xmin, so a transfer older than 2^32
transactions could in theory alias the current id; the reconciliation, ledger_problems(),
would still report any transfer that does not sum to zero.)

SQLite (the demo) relies on billing.ledger.post, which checks the same.
"""

from django.db import migrations

SQL = [
    "DROP TRIGGER billing_entry_balanced ON billing_entry;",
    "DROP FUNCTION billing_entry_balanced();",
    # x (32 bits) widened to the full id nearest to `near` (same epoch, or the one either side).
    """
    CREATE FUNCTION billing_full_xid(x xid, near xid8) RETURNS xid8 AS $$
        SELECT (near::text::bigint
                - ((near::text::bigint % 4294967296 - x::text::bigint + 6442450944) % 4294967296
                   - 2147483648))::text::xid8
    $$ LANGUAGE sql IMMUTABLE;
    """,
    """
    CREATE FUNCTION billing_entry_joins_new_transfer() RETURNS trigger AS $$
    DECLARE
        mine xid8 := pg_current_xact_id();
    BEGIN
        -- The transfer is looked up by a subquery per entry, which is always a primary-key
        -- lookup: a join could be planned as a scan of every transfer while the table is
        -- small, and the plan is kept as it grows. No transfer: NULL, refused too.
        IF EXISTS (
            SELECT FROM new_entries e
             WHERE pg_xact_status(billing_full_xid(
                       (SELECT t.xmin FROM billing_transfer t WHERE t.id = e.transfer_id), mine))
                   IS DISTINCT FROM 'in progress')
        THEN
            RAISE EXCEPTION 'ledger: entries may only be added to a transfer created in the'
                ' same transaction' USING ERRCODE = 'restrict_violation';
        END IF;
        RETURN NULL;
    END $$ LANGUAGE plpgsql;
    """,
    """
    CREATE TRIGGER billing_entry_joins_new_transfer
      AFTER INSERT ON billing_entry REFERENCING NEW TABLE AS new_entries
      FOR EACH STATEMENT EXECUTE FUNCTION billing_entry_joins_new_transfer();
    """,
]

REVERSE = [
    "DROP TRIGGER IF EXISTS billing_entry_joins_new_transfer ON billing_entry;",
    "DROP FUNCTION IF EXISTS billing_entry_joins_new_transfer();",
    "DROP FUNCTION IF EXISTS billing_full_xid(xid, xid8);",
    """
    CREATE FUNCTION billing_entry_balanced() RETURNS trigger AS $$
    DECLARE
        total bigint;
        legs integer;
    BEGIN
        SELECT COALESCE(SUM(amount_micros), 0), COUNT(*) INTO total, legs
          FROM billing_entry WHERE transfer_id = NEW.transfer_id;
        IF legs < 2 OR total <> 0 THEN
            RAISE EXCEPTION 'ledger: transfer % has % legs summing to %, not a balanced transfer',
                NEW.transfer_id, legs, total USING ERRCODE = 'check_violation';
        END IF;
        RETURN NULL;
    END $$ LANGUAGE plpgsql;
    """,
    """
    CREATE CONSTRAINT TRIGGER billing_entry_balanced
      AFTER INSERT ON billing_entry DEFERRABLE INITIALLY DEFERRED
      FOR EACH ROW EXECUTE FUNCTION billing_entry_balanced();
    """,
]


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in SQL:
            schema_editor.execute(statement, params=None)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in REVERSE:
            schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):
    dependencies = [("billing", "0002_ledger_triggers")]
    operations = [migrations.RunPython(forward, backward)]
