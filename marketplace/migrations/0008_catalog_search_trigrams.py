"""A trigram index for the catalog's search: a machine whose name, or one of whose served
models, contains the search text is found through it (Node.search_text), not by reading
every machine.

PostgreSQL only (pg_trgm, a trusted extension: the database owner may create it). SQLite (the
demo) reads every machine, which at its size costs nothing."""

from django.db import migrations

INDEX = "node_search_text_trgm"


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {INDEX} ON marketplace_node "
                          "USING gin (search_text gin_trgm_ops)")


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


class Migration(migrations.Migration):

    dependencies = [
        ("marketplace", "0007_catalog_keyset_host_facts"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
