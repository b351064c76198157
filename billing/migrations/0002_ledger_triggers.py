"""PostgreSQL enforces the ledger's rules itself, whatever code writes to it:

- the entries of a transfer sum to zero, checked at commit (a deferred constraint trigger, so
  the legs of one transfer may be inserted one by one);
- every transfer has entries, also at commit;
- entries are never changed or deleted: corrections are new transfers.

SQLite (the demo) relies on billing.ledger.post, the only writer, which checks the same.
"""

from django.db import migrations

FORWARD = """
CREATE FUNCTION billing_transfer_balanced() RETURNS trigger AS $$
DECLARE
    total bigint;
    legs integer;
BEGIN
    SELECT COALESCE(SUM(amount_micros), 0), COUNT(*) INTO total, legs
      FROM billing_entry WHERE transfer_id = NEW.{column};
    IF legs < 2 OR total <> 0 THEN
        RAISE EXCEPTION 'ledger: transfer % has % legs summing to %, not a balanced transfer',
            NEW.{column}, legs, total USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$ LANGUAGE plpgsql;
"""

SQL = [
    FORWARD.replace("billing_transfer_balanced", "billing_entry_balanced").format(
        column="transfer_id"),
    FORWARD.format(column="id"),
    """
    CREATE CONSTRAINT TRIGGER billing_entry_balanced
      AFTER INSERT ON billing_entry DEFERRABLE INITIALLY DEFERRED
      FOR EACH ROW EXECUTE FUNCTION billing_entry_balanced();
    """,
    """
    CREATE CONSTRAINT TRIGGER billing_transfer_balanced
      AFTER INSERT ON billing_transfer DEFERRABLE INITIALLY DEFERRED
      FOR EACH ROW EXECUTE FUNCTION billing_transfer_balanced();
    """,
    """
    CREATE FUNCTION billing_entry_append_only() RETURNS trigger AS $$
    BEGIN
        RAISE EXCEPTION 'ledger: entries are append-only (% refused)', TG_OP
            USING ERRCODE = 'restrict_violation';
    END $$ LANGUAGE plpgsql;
    """,
    """
    CREATE TRIGGER billing_entry_append_only
      BEFORE UPDATE OR DELETE ON billing_entry
      FOR EACH ROW EXECUTE FUNCTION billing_entry_append_only();
    """,
]

REVERSE = [
    "DROP TRIGGER IF EXISTS billing_entry_append_only ON billing_entry;",
    "DROP FUNCTION IF EXISTS billing_entry_append_only();",
    "DROP TRIGGER IF EXISTS billing_transfer_balanced ON billing_transfer;",
    "DROP TRIGGER IF EXISTS billing_entry_balanced ON billing_entry;",
    "DROP FUNCTION IF EXISTS billing_transfer_balanced();",
    "DROP FUNCTION IF EXISTS billing_entry_balanced();",
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
    dependencies = [("billing", "0001_initial")]
    operations = [migrations.RunPython(forward, backward)]
