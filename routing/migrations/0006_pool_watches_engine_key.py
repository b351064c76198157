"""The pool's change feed also notes a node's engine key: the proxy sends the key the snapshot
holds, so a rotation reaches every router like an address change (routing/changes.py)."""

from django.db import migrations

# marketplace_node's update trigger of 0003 (WATCHED[0]), with the key's fingerprint added.
BEFORE = ["status", "status_changed_at", "engine_reachable", "credential_revoked_at",
          "engine_connect_url", "needs_review", "uuid_conflict", "owner_id"]
AFTER = [*BEFORE, "engine_key_fingerprint"]


def _trigger(columns) -> str:
    old = ", ".join(f"OLD.{c}" for c in columns)
    new = ", ".join(f"NEW.{c}" for c in columns)
    return ("DROP TRIGGER IF EXISTS routing_pool_0_up ON marketplace_node; "
            "CREATE TRIGGER routing_pool_0_up AFTER UPDATE ON marketplace_node FOR EACH ROW "
            f"WHEN ((ROW({old}, 0)) IS DISTINCT FROM (ROW({new}, 0))) "
            "EXECUTE FUNCTION routing_pool_changed('node');")


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_trigger(AFTER))


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_trigger(BEFORE))


class Migration(migrations.Migration):

    dependencies = [
        ("routing", "0005_requestlog_user_time"),
        ("marketplace", "0013_node_engine_key"),
    ]

    operations = [migrations.RunPython(forward, backward)]
