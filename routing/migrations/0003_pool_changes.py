"""The pool's change feed: triggers note every change a router's snapshot depends on, so that a
server process re-reads only what changed (routing/changes.py)."""

from django.db import migrations

# (table, how the changed row names its node, the columns the snapshot reads; None: all)
WATCHED = [
    ("marketplace_node", "node", ["status", "status_changed_at", "engine_reachable",
                                  "credential_revoked_at", "engine_connect_url",
                                  "needs_review", "uuid_conflict", "owner_id"]),
    ("marketplace_card", "node_id", ["node_id", "present", "verification_status"]),
    ("marketplace_rental", "card_id", ["card_id", "renter_id", "stopped_at"]),
    ("verification_verifiedcapacity", "card_id", ["card_id", "model", "tokens_per_s",
                                                  "routing_tps", "routed_since",
                                                  "concurrency"]),
    ("routing_deployment", "node_id", ["node_id", "reported", "healthy", "engine_model_id",
                                       "engine", "quantization", "max_context",
                                       "first_seen_at"]),
    ("routing_deployment", "queue", ["engine_running", "engine_waiting"]),
    ("routing_model", "model", None),
    ("routing_enginemodel", "model", None),
    ("billing_modelprice", "model", None),
]

FUNCTION = """
CREATE TABLE routing_poolchange (
    id bigserial PRIMARY KEY,
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    at timestamptz NOT NULL DEFAULT now(),
    scope varchar(8) NOT NULL,  -- node, queue, model
    node_id bigint,
    deployment_id bigint
);
CREATE INDEX routing_poolchange_xid ON routing_poolchange (xid);
CREATE INDEX routing_poolchange_at ON routing_poolchange (at);

CREATE FUNCTION routing_pool_note(how text, r jsonb) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    node bigint;
BEGIN
    IF how = 'queue' THEN
        INSERT INTO routing_poolchange (scope, node_id, deployment_id)
        VALUES ('queue', (r->>'node_id')::bigint, (r->>'id')::bigint);
        RETURN;
    ELSIF how = 'node' THEN
        node := (r->>'id')::bigint;
    ELSIF how = 'node_id' THEN
        node := (r->>'node_id')::bigint;
    ELSIF how = 'card_id' THEN
        SELECT c.node_id INTO node FROM marketplace_card c WHERE c.id = (r->>'card_id')::bigint;
    END IF;
    IF node IS NOT NULL THEN
        INSERT INTO routing_poolchange (scope, node_id) VALUES ('node', node);
    END IF;
END $$;

CREATE FUNCTION routing_pool_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_ARGV[0] = 'model' THEN
        INSERT INTO routing_poolchange (scope) VALUES ('model');
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' AND TG_ARGV[0] <> 'queue' THEN
        PERFORM routing_pool_note(TG_ARGV[0], to_jsonb(OLD));
    END IF;
    IF TG_OP <> 'DELETE' AND (TG_OP = 'INSERT' OR TG_ARGV[0] = 'queue'
                              OR to_jsonb(OLD)->>'node_id' IS DISTINCT FROM
                                 to_jsonb(NEW)->>'node_id'
                              OR to_jsonb(OLD)->>'card_id' IS DISTINCT FROM
                                 to_jsonb(NEW)->>'card_id') THEN
        PERFORM routing_pool_note(TG_ARGV[0], to_jsonb(NEW));
    END IF;
    RETURN NULL;
END $$;
"""


def _triggers() -> str:
    sql = []
    for i, (table, how, columns) in enumerate(WATCHED):
        name = f"routing_pool_{i}"
        if columns is None:
            sql.append(f"CREATE TRIGGER {name} AFTER INSERT OR UPDATE OR DELETE ON {table} "
                       f"FOR EACH ROW EXECUTE FUNCTION routing_pool_changed('{how}');")
            continue
        old = ", ".join(f"OLD.{c}" for c in columns)
        new = ", ".join(f"NEW.{c}" for c in columns)
        if how != "queue":
            sql.append(f"CREATE TRIGGER {name}_in AFTER INSERT OR DELETE ON {table} "
                       f"FOR EACH ROW EXECUTE FUNCTION routing_pool_changed('{how}');")
        sql.append(f"CREATE TRIGGER {name}_up AFTER UPDATE ON {table} FOR EACH ROW "
                   f"WHEN ((ROW({old}, 0)) IS DISTINCT FROM (ROW({new}, 0))) "
                   f"EXECUTE FUNCTION routing_pool_changed('{how}');")
    return "\n".join(sql)


def _drop() -> str:
    sql = []
    for i, (table, how, columns) in enumerate(WATCHED):
        for suffix in ("", "_in", "_up"):
            sql.append(f"DROP TRIGGER IF EXISTS routing_pool_{i}{suffix} ON {table};")
    sql.append("DROP FUNCTION routing_pool_changed(); DROP FUNCTION routing_pool_note(text, jsonb);"
               " DROP TABLE routing_poolchange;")
    return "\n".join(sql)


def forward(apps, schema_editor):
    # PostgreSQL only: elsewhere (the demo's SQLite) the pool is read whole at each refresh
    # (routing.changes.available).
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTION + _triggers())


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_drop())


class Migration(migrations.Migration):

    dependencies = [
        ("routing", "0002_deployment_engine_metrics"),
        ("marketplace", "0006_node_engine_connect_url"),
        ("verification", "0005_capacity_routed_since"),
        ("billing", "0007_stripe_payments_reversals"),
    ]

    operations = [migrations.RunPython(forward, backward)]
