"""Writes of what served traffic shows (routing/traffic.py holds the arithmetic):

- traffic_record: each batch of request-log rows adds to its deployments' buckets, in the same
  transaction as the rows themselves;
- served_figures_refresh (every minute): each deployment's figures over the last hour and day,
  published onto its node's cards (the catalog, rent page and provider pages read them there)
  and, per public model, into the cache (/models/ and /v1/models read them there); buckets
  older than the day are deleted; and a deployment whose recent traffic decodes far below its
  verified speed (routing/drift.py) is handed to verification (drifts_act).
"""

from collections import defaultdict
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from config.redis import REDIS_ERRORS
from marketplace import services as marketplace
from marketplace import uptime
from marketplace.models import Node, NodeStatusChange
from routing import drift, traffic
from routing.models import Deployment, EngineModel, Model, TrafficBucket
from verification import selectors as verification_selectors
from verification import services as verification
from verification.findings import THRESHOLDS

MODELS_KEY = "rigshare:served:models"
MODELS_TTL_S = 600  # the refresh runs every minute; stale beyond this, the figures go
WINDOW = {name: length for name, (length, _) in traffic.WINDOWS.items()}


def band_starts() -> tuple[int, ...]:
    return traffic.bands(settings.RIGSHARE_LOAD_TEST_LEVELS)


def traffic_record(rows: list[dict]) -> int:
    """Add request-log rows (RequestLog fields) to their deployments' buckets: one statement,
    each bucket's sums added where it exists. Call inside the transaction that
    writes the rows. Returns the buckets touched."""
    served = [traffic.Served(
        deployment_id=row["deployment_id"], at=row["created_at"], status=row["status"],
        concurrency=row.get("concurrency") or 1, stream=row["stream"],
        completion_tokens=row["completion_tokens"], ttft_ms=row["ttft_ms"],
        latency_ms=row["latency_ms"]) for row in rows if row.get("deployment_id")]
    if not served:
        return 0
    sums = traffic.deltas(served, band_starts())
    qn = connection.ops.quote_name
    table = qn(TrafficBucket._meta.db_table)
    keys = ("deployment_id", "span_s", "start", "band")
    columns = keys + traffic.COLUMNS
    # Keys in one order, so two writers' batches lock their buckets in the same order.
    params = [(*key, *values) for key, values in sorted(sums.items())]
    add = ", ".join(f"{qn(c)} = {table}.{qn(c)} + excluded.{qn(c)}" for c in traffic.COLUMNS)
    conflict = f"ON CONFLICT ({', '.join(map(qn, keys))}) DO UPDATE SET {add}"
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One array per column: the statement's text is the same for every batch (a
            # VALUES list of a few thousand placeholders cost more to send than to run).
            types = ["bigint", "integer", "timestamptz", "integer"] + [
                "double precision" if c == "decode_ms" else "bigint" for c in traffic.COLUMNS]
            cursor.execute(
                f"INSERT INTO {table} ({', '.join(map(qn, columns))}) SELECT * FROM unnest("
                + ", ".join(f"%s::{t}[]" for t in types) + f") {conflict}",
                [list(column) for column in zip(*params, strict=True)])
        else:
            cursor.executemany(
                f"INSERT INTO {table} ({', '.join(map(qn, columns))}) "
                f"VALUES ({', '.join(['%s'] * len(columns))}) {conflict}", params)
    return len(params)


def _window_sums(span_s: int, since: datetime) -> dict[int, dict[int, traffic.Sums]]:
    """{deployment: {band: sums}} of the buckets of `span_s` that start after `since`."""
    out: dict[int, dict[int, traffic.Sums]] = defaultdict(dict)
    rows = (TrafficBucket.objects.filter(span_s=span_s, start__gt=since)
            .values("deployment_id", "band")
            .annotate(**{c: Sum(c) for c in traffic.COLUMNS}).order_by())
    for row in rows:
        sums = traffic.Sums()
        sums.add([row[c] for c in traffic.COLUMNS])
        out[row["deployment_id"]][row["band"]] = sums
    return out


def _uptimes(deployments: dict[int, Deployment], now: datetime) -> dict[tuple[int, str], float]:
    """{(deployment, window): the share of the window its node was online}, from the node's
    status changes; a window is counted from when the deployment was first seen."""
    node_ids = {d.node_id for d in deployments.values()}
    day_ago = now - WINDOW["day"]
    status = dict(Node.objects.filter(pk__in=node_ids).values_list("pk", "status"))
    changes: dict[int, list] = defaultdict(list)
    for node_id, at, new in (NodeStatusChange.objects.filter(node_id__in=node_ids, at__gt=day_ago)
                             .order_by("at").values_list("node_id", "at", "status")):
        changes[node_id].append((at, new))
    out = {}
    for pk, d in deployments.items():
        for name, length in WINDOW.items():
            start = max(now - length, d.first_seen_at)
            seen = [c for c in changes.get(d.node_id, []) if c[0] > start]
            # Two states: before its first change in the window, a node was in the other one.
            before = status.get(d.node_id, Node.Status.OFFLINE) if not seen else (
                Node.Status.ONLINE if seen[0][1] == Node.Status.OFFLINE else Node.Status.OFFLINE)
            offline = uptime.offline_seconds(seen, status_at_start=before, start=start, end=now)
            out[(pk, name)] = traffic.uptime_pct(offline, (now - start).total_seconds())
    return out


def _public_names(deployments: dict[int, Deployment]) -> dict[int, str]:
    """The public model each deployment serves, as the pool maps it (routing/pool.py)."""
    ids = {d.engine_model_id for d in deployments.values()}
    mapping = dict(EngineModel.objects.filter(engine_model_id__in=ids)
                   .values_list("engine_model_id", "model__name"))
    names = set(Model.objects.filter(name__in=ids).values_list("name", flat=True))
    return {pk: mapping.get(d.engine_model_id) or (d.engine_model_id
                                                  if d.engine_model_id in names else "")
            for pk, d in deployments.items()}


def served_figures_refresh(*, now: datetime | None = None) -> dict:
    """Every deployment's live figures from its buckets, published; old buckets deleted.
    Returns {"deployments": n, "nodes": n}: what it wrote."""
    now = now or timezone.now()
    starts = band_starts()
    sums = {name: _window_sums(span, now - length)
            for name, (length, span) in traffic.WINDOWS.items()}
    ids = set().union(*(s.keys() for s in sums.values()))
    deployments = Deployment.objects.in_bulk(ids)
    uptimes = _uptimes(deployments, now)
    public = _public_names(deployments)

    per_node: dict[int, list[dict]] = defaultdict(list)
    per_model: dict[str, dict[str, dict[int, traffic.Sums]]] = defaultdict(
        lambda: defaultdict(dict))
    for pk, d in deployments.items():
        entry = {"deployment": pk, "model": public.get(pk) or d.engine_model_id,
                 "engine_model": d.engine_model_id}
        for name in traffic.WINDOWS:
            by_band = sums[name].get(pk, {})
            entry[name] = traffic.window_figures(by_band, starts, uptimes[(pk, name)])
            if public.get(pk):
                model = per_model[public[pk]][name]
                for band, band_sums in by_band.items():
                    model.setdefault(band, traffic.Sums()).merge(band_sums)
        per_node[d.node_id].append(entry)

    by_node = {}
    for node_id, entries in per_node.items():
        entries.sort(key=lambda e: (-e["hour"]["requests"], -e["day"]["requests"],
                                    e["deployment"]))
        top = entries[0]["hour"]
        by_node[node_id] = {"tokens_per_s": top["tokens_per_s"], "ttft_ms": top["ttft_p50_ms"],
                            "served": {"updated_at": now.isoformat(), "models": entries}}
    nodes = marketplace.cards_served_publish(by_node=by_node)
    cache.set(MODELS_KEY, {
        "updated_at": now.isoformat(),
        "models": {name: {w: traffic.window_figures(windows.get(w, {}), starts, None)
                          for w in traffic.WINDOWS}
                   for name, windows in per_model.items()}}, MODELS_TTL_S)
    for length, span in traffic.WINDOWS.values():
        TrafficBucket.objects.filter(span_s=span, start__lte=now - length - timedelta(
            seconds=span)).delete()
    opened = drifts_act(deployments, now)
    return {"deployments": len(deployments), "nodes": nodes, "drifts": opened}


def drifts_act(deployments: dict[int, Deployment], now: datetime) -> int:
    """Each deployment whose recent traffic decodes far below its verified speed
    (routing/drift.py) is handed to verification: routing weight, a run, the provider's alert.
    Returns the episodes opened."""
    starts = band_starts()
    since = traffic.bucket_start(now - drift.WINDOW, traffic.FIVE_MINUTES)
    recent = _window_sums(traffic.FIVE_MINUTES, since - timedelta(microseconds=1))
    recent = {pk: bands for pk, bands in recent.items() if pk in deployments}
    if not recent:
        return 0
    speeds = verification_selectors.verified_speeds({deployments[pk].node_id for pk in recent})
    verified = {pk: speeds.get((deployments[pk].node_id, deployments[pk].engine_model_id), {})
                for pk in recent}
    running = {pk: deployments[pk].engine_running for pk in recent
               if deployments[pk].engine_running is not None}
    owners = dict(Node.objects.filter(pk__in={deployments[pk].node_id for pk in recent})
                  .values_list("pk", "owner_id"))
    opened = 0
    for found in drift.find(recent, verified, starts, threshold=THRESHOLDS["serving"][0],
                            engine_running=running,
                            owners={pk: owners.get(deployments[pk].node_id) for pk in recent}):
        d = deployments[found.deployment_id]
        opened += verification.served_drift_open(
            node_id=d.node_id, deployment_id=d.pk, model=d.engine_model_id, band=found.band,
            band_label=traffic.band_label(found.band, starts), level=found.level,
            served_tps=found.served_tps, verified_tps=found.verified_tps, streams=found.streams,
            window_start=since, now=now) is not None
    return opened


async def model_figures() -> dict[str, dict]:
    """{public model: {"hour": figures, "day": figures}} as the last refresh left them; {} while
    the cache cannot be read (the figures are shown, never needed)."""
    try:
        return (await cache.aget(MODELS_KEY) or {}).get("models", {})
    except REDIS_ERRORS:
        return {}
