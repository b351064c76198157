"""Drop four indexes that nothing reads and every request writes.

On PostgreSQL Django adds a second, `varchar_pattern_ops` index (`..._like`) next to the index
of each unique or indexed CharField, for `LIKE 'x%'` (startswith) lookups. Nothing in Rigshare
filters these columns by prefix: the code looks them up by equality (served by the plain
index), and the admin's search is `icontains` (`UPPER(col) LIKE UPPER('%x%')`), which no
b-tree can serve. Yet each reserve+settle wrote them 7 times (the hold twice, as settling it
updates an indexed column, two transfers, the charge): about a tenth of PostgreSQL's CPU per
request, measured with bench/billing.py. The plain indexes, unique constraints included, stay.
"""

from django.db import migrations

LIKE_INDEXES = {
    "billing_hold_request_id_ee850e6f_like": ("billing_hold", "request_id"),
    "billing_charge_request_id_b62a56f8_like": ("billing_charge", "request_id"),
    "billing_transfer_idempotency_key_455cbcdc_like": ("billing_transfer", "idempotency_key"),
    "billing_transfer_reference_efd6e204_like": ("billing_transfer", "reference"),
}


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name in LIKE_INDEXES:
            schema_editor.execute(f"DROP INDEX IF EXISTS {name}", params=None)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name, (table, column) in LIKE_INDEXES.items():
            schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {table}"
                                  f" ({column} varchar_pattern_ops)", params=None)


class Migration(migrations.Migration):
    dependencies = [("billing", "0004_metering_functions")]
    operations = [migrations.RunPython(forward, backward)]
