"""No database foreign keys on the rows every request writes; the same guarantees without locks.

PostgreSQL checks a foreign key with a `SELECT ... FOR KEY SHARE` of the parent row at commit:
20 of them per reserve+settle, 15 writing a tuple-lock WAL record, and two parents (the model's
price, the platform's revenue account) shared by every request, so concurrent requests also
created MultiXacts. About a fifth of PostgreSQL's CPU per request (docs/benchmarks.md). The
columns keep their meaning; what the constraints guaranteed is kept this way:

- an entry's transfer exists and was created by the same transaction: the entry guard (0003);
- an entry's account exists: the transfer's commit-time balance check (0002) now also counts
  entries whose account is unknown and refuses the transfer;
- a hold's or charge's user, key, price and hold come from rows the same call reads or locks
  (billing/metering.py, 0004), so they exist when written;
- and they go on existing: accounts, transfers, holds, charges, prices and API keys cannot be
  deleted (the ledger's records are corrected by new transfers; keys are revoked). Users
  that own an account keep their foreign key from the account and cannot be deleted either.

Indexes that only served those checks, or that a composite index covers, go too: hold user,
key, price and expires_at (the (status, expires_at) index serves the expiry sweep), charge user,
provider (their (x, created_at) indexes) and transfer, entry account ((account, transfer)).
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


BALANCED = """
CREATE OR REPLACE FUNCTION billing_transfer_balanced() RETURNS trigger AS $$
DECLARE
    total bigint;
    legs integer;
    unknown integer;
BEGIN
    SELECT COALESCE(SUM(e.amount_micros), 0), COUNT(*),
           COUNT(*) FILTER (WHERE NOT EXISTS (SELECT FROM billing_account a
                                               WHERE a.id = e.account_id))
      INTO total, legs, unknown
      FROM billing_entry e WHERE e.transfer_id = NEW.id;
    IF legs < 2 OR total <> 0 THEN
        RAISE EXCEPTION 'ledger: transfer % has % legs summing to %, not a balanced transfer',
            NEW.id, legs, total USING ERRCODE = 'check_violation';
    END IF;
    IF unknown > 0 THEN
        RAISE EXCEPTION 'ledger: transfer % has % legs on accounts that do not exist',
            NEW.id, unknown USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END $$ LANGUAGE plpgsql;
"""

# What 0002 created, for going back.
BALANCED_BEFORE = """
CREATE OR REPLACE FUNCTION billing_transfer_balanced() RETURNS trigger AS $$
DECLARE
    total bigint;
    legs integer;
BEGIN
    SELECT COALESCE(SUM(amount_micros), 0), COUNT(*) INTO total, legs
      FROM billing_entry WHERE transfer_id = NEW.id;
    IF legs < 2 OR total <> 0 THEN
        RAISE EXCEPTION 'ledger: transfer % has % legs summing to %, not a balanced transfer',
            NEW.id, legs, total USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$ LANGUAGE plpgsql;
"""

KEPT = ["billing_account", "billing_transfer", "billing_hold", "billing_charge",
        "billing_modelprice", "billing_apikey"]

SQL = [BALANCED, """
    CREATE FUNCTION billing_never_deleted() RETURNS trigger AS $$
    BEGIN
        RAISE EXCEPTION 'ledger: rows of % are never deleted', TG_TABLE_NAME
            USING ERRCODE = 'restrict_violation';
    END $$ LANGUAGE plpgsql;
    """] + [f"CREATE TRIGGER {table}_never_deleted BEFORE DELETE ON {table}"
            f" FOR EACH ROW EXECUTE FUNCTION billing_never_deleted();" for table in KEPT]

REVERSE = [f"DROP TRIGGER IF EXISTS {table}_never_deleted ON {table};" for table in KEPT] + [
    "DROP FUNCTION IF EXISTS billing_never_deleted();", BALANCED_BEFORE]


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in SQL:
            schema_editor.execute(statement, params=None)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in REVERSE:
            schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0005_drop_unused_like_indexes'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterField(
            model_name='charge',
            name='api_key',
            field=models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.PROTECT, related_name='charges', to='billing.apikey'),
        ),
        migrations.AlterField(
            model_name='charge',
            name='hold',
            field=models.OneToOneField(db_constraint=False, on_delete=django.db.models.deletion.PROTECT, related_name='charge', to='billing.hold'),
        ),
        migrations.AlterField(
            model_name='charge',
            name='provider',
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='served_charges', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AlterField(
            model_name='charge',
            name='transfer',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='+', to='billing.transfer'),
        ),
        migrations.AlterField(
            model_name='charge',
            name='user',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='charges', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AlterField(
            model_name='entry',
            name='account',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='entries', to='billing.account'),
        ),
        migrations.AlterField(
            model_name='entry',
            name='transfer',
            field=models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.PROTECT, related_name='entries', to='billing.transfer'),
        ),
        migrations.AlterField(
            model_name='hold',
            name='api_key',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='holds', to='billing.apikey'),
        ),
        migrations.AlterField(
            model_name='hold',
            name='expires_at',
            field=models.DateTimeField(),
        ),
        migrations.AlterField(
            model_name='hold',
            name='price',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='+', to='billing.modelprice'),
        ),
        migrations.AlterField(
            model_name='hold',
            name='user',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='holds', to=settings.AUTH_USER_MODEL),
        ),
        migrations.RunPython(forward, backward),
    ]
