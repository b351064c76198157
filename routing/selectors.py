"""What the staff's pool page shows: every worker a router would place on now, as a router
builds it, with its weight, share of keys, load, engine metrics, health and breaker; and each
model's traffic share per worker over the last hour."""

from collections import defaultdict
from datetime import datetime, timedelta

from django.utils import timezone

from routing import balancer, pool
from routing.models import Deployment, RequestLog

BUCKET = timedelta(minutes=5)
WINDOW = timedelta(hours=1)


def pool_overview(now: datetime | None = None) -> dict:
    now = now or timezone.now()
    snap = pool.build(now=now)
    models = []
    in_pool = set()
    circuits = pool.open_circuits()
    for name, workers in sorted(snap.workers.items()):
        shared = [w for w in workers if w.renter_id is None and w.verified and w.capacity_tps]
        total = sum(balancer.weight(w) for w in shared) or 1.0
        shared_ids = {w.deployment_id for w in shared}
        rows = []
        for w in workers:
            in_pool.add(w.deployment_id)
            rows.append({
                "ref": w.ref, "node_id": w.node_id, "engine": w.engine or "unknown",
                "capacity_tps": round(w.capacity_tps), "weight": round(balancer.weight(w), 1),
                "ramp": w.ramp,
                "key_share_pct": round(100 * balancer.weight(w) / total, 1)
                if w.deployment_id in shared_ids else None,
                "in_flight": snap.load.get(w.deployment_id, 0), "engine_queue": w.engine_queue,
                "breaker_open": circuits[w.deployment_id],  # processes that hold it open
                "shared": w.deployment_id in shared_ids, "renter_id": w.renter_id})
        models.append({"name": name, "workers": rows, "chart": _traffic(name, now)})
    _hit_rates(models)
    out = [{"ref": d.worker_ref, "node_id": d.node_id, "model": d.engine_model_id,
            "why": _why_out(d)}
           for d in Deployment.objects.filter(reported=True).select_related("node")
           .order_by("pk") if d.pk not in in_pool]
    return {"version": snap.version, "at": now.isoformat(timespec="seconds"),
            "models": models, "out_of_pool": out}


def _hit_rates(models: list[dict]) -> None:
    ids = [int(r["ref"].split(":")[1]) for m in models for r in m["workers"]]
    found = {d.pk: d for d in Deployment.objects.filter(pk__in=ids)}
    for model in models:
        for row in model["workers"]:
            d = found.get(int(row["ref"].split(":")[1]))
            row["healthy"] = bool(d and d.healthy)
            row["prefix_hit_pct"] = (round(100 * d.prefix_hits / d.prefix_queries, 1)
                                     if d and d.prefix_queries else None)


def _why_out(d: Deployment) -> str:
    if not d.healthy:
        return f"unhealthy: {d.health_error or 'failed its health checks'}"
    if d.node.status != d.node.Status.ONLINE:
        return "node offline"
    if not d.node.engine_connect_url or not d.node.engine_reachable:
        return d.node.engine_error or "engine not reachable from the platform"
    return "no model maps to this engine model id"


def _traffic(model: str, now: datetime) -> dict:
    """Requests per worker per 5-minute bucket over the last hour: {buckets, series}."""
    start = now - WINDOW
    counts: dict[str, list[int]] = defaultdict(lambda: [0] * (WINDOW // BUCKET))
    for at, deployment_id in RequestLog.objects.filter(
            model=model, created_at__gte=start, deployment_id__isnull=False).values_list(
            "created_at", "deployment_id"):
        i = min(int((at - start) / BUCKET), WINDOW // BUCKET - 1)
        counts[f"deployment:{deployment_id}"][i] += 1
    totals = [sum(col) for col in zip(*counts.values(), strict=True)] if counts else []
    series = {ref: [{"pct": round(100 * c / t, 1) if t else 0.0,
                     "alpha": f"{c / t:.2f}" if t else "0"}
                    for c, t in zip(row, totals, strict=True)]
              for ref, row in sorted(counts.items())}
    return {"bucket_minutes": int(BUCKET.total_seconds() // 60), "totals": totals,
            "share_pct": series}
