"""Writes of the routing app: deployments from what agents report, and the platform's own
health check of every engine."""

import asyncio
from datetime import datetime

import httpx
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from config.prepared import Prepared
from marketplace import engine_keys, engine_tls
from marketplace import services as marketplace
from marketplace.models import Node
from routing import upstream
from routing.models import Deployment

HEALTH_TIMEOUT_S = 3.0
UNHEALTHY_AFTER = 2  # failed checks in a row before a deployment leaves the pool


def _served(node: Node) -> list[dict]:
    """What the node's engine serves: the agent's description of each model where it sent one
    (`served`), and the bare id, with nothing known about it, where it did not (an agent older
    than `served`)."""
    described = {item["id"]: item for item in node.engine_served}
    return [described.get(i) or {"id": i, "engine": "", "max_context": None,
                                 "quantization": ""} for i in node.engine_models]


_DEPLOYMENTS_OF_NODE = Prepared(lambda node_id: Deployment.objects.filter(node_id=node_id)
                                .order_by(), int)  # every heartbeat: compiled once


@transaction.atomic(savepoint=False)  # inside the heartbeat's transaction: no savepoint
def deployments_sync(*, node_id: int, now: datetime | None = None,
                     locked: Node | None = None) -> list[int]:
    """Match the node's deployments to its latest heartbeat; returns the ids it serves. The
    node's row is locked: two heartbeats of one node at once (an agent's retry overlapping its
    first try) must not both create its new deployment. `locked`: the node's row as read under
    that lock in the caller's transaction (the heartbeat's); locked and read here otherwise."""
    now = now or timezone.now()
    node = locked if locked is not None else \
        Node.objects.select_for_update(no_key=True).get(pk=node_id)
    # An engine the agent is draining (or starting, or restarting) takes no new request: its
    # deployments leave the pool (the change feed follows `reported`) until it is ready again.
    serving = node.engine_reachable and node.engine_takes_work
    served = {item["id"]: item for item in _served(node)} if serving else {}
    existing = {d.engine_model_id: d for d in _DEPLOYMENTS_OF_NODE(node_id)}
    ids = []
    for engine_model_id, item in served.items():
        facts = {"engine": item.get("engine") or "", "max_context": item.get("max_context"),
                 "quantization": item.get("quantization") or ""}
        row = existing.get(engine_model_id)
        if row is None:
            row = Deployment.objects.create(node_id=node_id, engine_model_id=engine_model_id,
                                            first_seen_at=now, last_seen_at=now, **facts)
        elif (not row.reported or now - row.last_seen_at >= marketplace.SEEN_EVERY
              or any(getattr(row, k) != v for k, v in facts.items())):
            for name, value in facts.items():
                setattr(row, name, value)
            row.reported, row.last_seen_at = True, now
            # Only what the heartbeat owns: health checks and metrics write the rest unlocked.
            row.save(update_fields=[*facts, "reported", "last_seen_at"])
        ids.append(row.pk)
    gone = [d.pk for key, d in existing.items() if key not in served and d.reported]
    if gone:
        Deployment.objects.filter(pk__in=gone).update(reported=False)
    return ids


async def _check(client: httpx.AsyncClient, url: str, key: str = "", certificate: str = ""
                 ) -> tuple[str, dict, bool | None]:
    """('' when the engine answers its health route, else why not; what its /metrics says;
    whether it refuses /v1 without its key, None when not known). With the node's engine key,
    as the proxy sends it, over TLS pinned to its certificate where it serves TLS."""
    base = url.rstrip("/")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    pinned = {"timeout": HEALTH_TIMEOUT_S, "extensions": engine_tls.extensions(certificate)}
    try:
        response = await client.get(f"{base}/health", headers=headers, **pinned)
        if response.status_code == 404:  # llama-cpp-python's server has no /health
            response = await client.get(f"{base}/v1/models", headers=headers, **pinned)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"[:256], {}, None
    if response.status_code != 200:
        return f"GET {response.request.url.path} answered {response.status_code}", {}, None
    try:
        # A stranger's request: an engine that answers it serves anyone who finds its port.
        bare = await client.get(f"{base}/v1/models", **pinned)
        enforced = bare.status_code in (401, 403)
        metrics = await client.get(f"{base}/metrics", headers=headers, **pinned)
    except httpx.HTTPError:
        return "", {}, None
    return "", engine_metrics(metrics.text) if metrics.status_code == 200 else {}, enforced


# Where each engine says what the pool page and the balancer read (vLLM v1's names; llama-server
# with --metrics has its queue but no prefix cache counters).
_ENGINE_METRICS = {
    "vllm:num_requests_running": "engine_running",
    "vllm:num_requests_waiting": "engine_waiting",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "llamacpp:requests_processing": "engine_running",
    "llamacpp:requests_deferred": "engine_waiting",
}


def engine_metrics(text: str) -> dict:
    """The Deployment fields an engine's Prometheus text gives (summed over its samples);
    {} for text that does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:  # a counter's samples end in _total
                field = _ENGINE_METRICS.get(sample.name.removesuffix("_total"))
                if field is not None:
                    found[field] = found.get(field, 0.0) + sample.value
    except ValueError:
        return {}
    return {field: int(value) for field, value in found.items() if value >= 0}


async def _check_all(urls: dict[int, tuple[str, str, str]]
                     ) -> dict[int, tuple[str, dict, bool | None]]:
    async with httpx.AsyncClient(transport=upstream.Transport()) as client:
        results = await asyncio.gather(*(_check(client, url, key, certificate)
                                         for url, key, certificate in urls.values()))
    return dict(zip(urls, results, strict=True))


def deployments_check_health(*, now: datetime | None = None) -> dict[int, str]:
    """Ask every online node's engine whether it is up, from the platform's side (the agent's
    word is not enough: a provider's network may let the agent out and nobody in). A node's
    deployments leave the pool after UNHEALTHY_AFTER failures in a row, and come back at the
    first success."""
    now = now or timezone.now()
    # Only where the platform may call: the engine's checked address (engine_address.py).
    urls = {pk: (url, engine_keys.unseal(sealed), certificate)
            for pk, url, sealed, certificate in
            Node.objects.filter(status=Node.Status.ONLINE, deployments__reported=True)
            .exclude(engine_connect_url="")
            .values_list("pk", "engine_connect_url", "engine_key_sealed",
                         "engine_tls_certificate").distinct()}
    checked = asyncio.run(_check_all(urls)) if urls else {}
    results = {node_id: error for node_id, (error, _, _) in checked.items()}
    marketplace.node_engine_key_enforced(enforced={
        node_id: enforced for node_id, (_, _, enforced) in checked.items()
        if enforced is not None})
    for node_id, (error, metrics, _) in checked.items():
        rows = Deployment.objects.filter(node_id=node_id, reported=True)
        if not error:
            rows.update(healthy=True, health_failures=0, health_checked_at=now,
                        health_error="", **{name: metrics.get(name) for name in
                                            set(_ENGINE_METRICS.values())})
        else:
            rows.update(health_failures=F("health_failures") + 1, health_checked_at=now,
                        health_error=error)
            rows.filter(health_failures__gte=UNHEALTHY_AFTER).update(healthy=False)
    return results
