"""The pool's change feed. Triggers (migration routing 0003) add a row to routing_poolchange
for every change a router's snapshot depends on: a node's status or address, a card's
verification, a rental, a verified capacity, a deployment (its engine queue apart), a model,
an engine model id, a price. A server process reads the rows added since its last read and
re-reads only the nodes they name (routing/pool.py); a refresh with nothing changed costs one
indexed query.

"Since" is a transaction horizon, not a row id: ids are taken when a row is inserted and
become visible at commit, in another order. Each read also takes `pg_snapshot_xmin`, the
oldest transaction still running; every row of an older transaction was visible to that read
already, so the next read asks for rows of transactions from that horizon on and skips the
transactions it has applied (all of a transaction's rows become visible at once).
"""

from dataclasses import dataclass

from django.db import connection

KEEP_S = 600  # rows older than this are deleted; a process that read longer ago reads it all


@dataclass(frozen=True)
class Position:
    xmin: int  # every transaction older than this had ended at the last read
    seen: frozenset[int]  # transactions from xmin on whose rows were applied


@dataclass(frozen=True)
class Changes:
    position: Position
    nodes: frozenset[int]  # nodes whose workers are to be read again
    queues: frozenset[int]  # deployments whose engine queue changed, and nothing else
    models: bool  # a model, engine model id or price changed


def available() -> bool:
    """The feed is written by PostgreSQL triggers (migration routing 0003). Elsewhere (the
    demo's SQLite, a handful of machines) there is none, and every refresh reads the pool
    whole."""
    return connection.vendor == "postgresql"


def start() -> Position | None:
    """The position to read from for a snapshot read after this call; None without a feed.
    The transactions from the horizon on whose rows are visible now count as applied: every
    one of them committed before the read that follows, which sees what they did. (A long
    transaction anywhere in the cluster holds the horizon back; without this, the first read
    after a full one would read their nodes again.)"""
    if not available():
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH now AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin), "
            "applied AS (SELECT DISTINCT xid FROM routing_poolchange "
            "            WHERE xid >= (SELECT xmin FROM now)) "
            "SELECT now.xmin::text, applied.xid::text FROM now LEFT JOIN applied ON true")
        rows = cursor.fetchall()
    return Position(int(rows[0][0]), frozenset(int(xid) for _, xid in rows if xid is not None))


def read(since: Position) -> Changes:
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH now AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin) "
            "SELECT now.xmin::text, c.xid::text, c.scope, c.node_id, c.deployment_id "
            "FROM now LEFT JOIN routing_poolchange c ON c.xid >= %s::text::xid8",
            [str(since.xmin)])
        rows = cursor.fetchall()
    xmin = int(rows[0][0])
    nodes, queues, models, applied = set(), set(), False, set()
    for _, xid, scope, node_id, deployment_id in rows:
        if xid is None or int(xid) in since.seen:
            continue
        applied.add(int(xid))
        if scope == "model":
            models = True
        elif scope == "queue":
            queues.add(deployment_id)
        else:
            nodes.add(node_id)
    seen = frozenset(x for x in since.seen | applied if x >= xmin)
    return Changes(Position(xmin, seen), frozenset(nodes), frozenset(queues), models)


def trim(keep_s: int = KEEP_S) -> int:
    """Delete the rows older than `keep_s` seconds; how many went."""
    if not available():
        return 0
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM routing_poolchange WHERE at < now() - make_interval("
                       "secs => %s)", [keep_s])
        return cursor.rowcount
