"""Reads that routing's pages and /v1 share.

- The staff's pool page: every worker a router would place on now, as a router builds it,
  with its weight, share of keys, load, engine metrics, health and breaker; and each model's
  traffic share per worker over the last hour.
- What the platform serves (the public models page and /v1/models): each model's price now
  and what its verified fleet holds, read from a pool snapshot.
- An API consumer's activity: their own /v1 requests, with what each cost.
"""

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, OuterRef, Q, QuerySet, Subquery, Sum
from django.utils import timezone

from billing.models import ApiKey, Charge
from billing.selectors import model_prices_now
from marketplace.costs import PlatformPrice
from marketplace.models import Card
from routing import balancer, placement, pool
from routing.models import Deployment, EngineModel, Model, RequestLog, worker_ref

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


# --- what the platform serves ---

@dataclass(frozen=True)
class ModelOffer:
    """One model as API consumers meet it: its price in force now, and what the verified
    workers serving it now hold (shared workers: verified, with a measured capacity, rented by
    nobody; placement.shares)."""

    name: str
    description: str
    created: int  # unix time
    input_micros_per_mtok: int
    output_micros_per_mtok: int
    model_context: int  # the operator's figure for the model
    served_context: int | None  # the largest context a verified worker holds now; None: none
    workers: int  # verified workers serving it now
    capacity_tps: float  # their verified output tokens/s under load, summed
    available: bool  # some worker in the pool may serve it now (a renter's own included)
    # What the platform's traffic measured on it ({"hour": figures, "day": figures},
    # routing/traffic.py), None without traffic in the last day.
    served: dict | None = None

    @property
    def context_length(self) -> int:
        """What a request can use: the verified workers' largest context, or the model's own
        figure while no verified worker serves it."""
        return self.served_context or self.model_context


def model_offers(snap: pool.Snapshot, now: datetime | None = None,
                 served: dict | None = None) -> list[ModelOffer]:
    """Every model with a price in force now, by name, with its live figures where `served`
    (served.model_figures) has them. No query: the snapshot holds the rest."""
    now = now or timezone.now()
    offers = []
    for name, entry in sorted(snap.models.items()):
        price = entry.price_at(now)
        if price is None:
            continue
        fleet = snap.workers.get(name) or placement.Fleet()
        shared = placement.shares(fleet)
        contexts = placement.contexts(fleet, entry.context_length)[shared]
        offers.append(ModelOffer(
            name=name, description=entry.description, created=entry.created,
            input_micros_per_mtok=price.input_per_mtok,
            output_micros_per_mtok=price.output_per_mtok, model_context=entry.context_length,
            served_context=int(contexts.max()) if len(contexts) else None,
            workers=int(shared.sum()), capacity_tps=float(fleet.cols["capacity"][shared].sum()),
            available=bool(len(fleet)), served=(served or {}).get(name)))
    return offers


# --- an API consumer's activity ---

@dataclass(frozen=True)
class ActivityFilters:
    since: datetime | None = None  # from this instant on
    until: datetime | None = None  # up to this instant, included
    model: str = ""
    api_key_id: int | None = None
    status: str = ""  # "ok", "error" or "" for both


@dataclass(frozen=True)
class ActivityRow:
    """One request as its consumer sees it."""

    request_id: str
    created_at: datetime
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int | None  # None: nothing was charged (a refusal, a renter's own card)
    estimated: bool  # billed from delivered tokens: the engine sent no usage
    ttft_ms: float | None
    latency_ms: float
    worker: str  # a public name (routing.selectors.worker_names), "" when none served it
    status: str  # "ok", or the HTTP status and error code
    api_key: str  # the key's name

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def activity_of(user_id: int, filters: ActivityFilters) -> QuerySet[RequestLog]:
    """The user's requests, newest first, each with its charge's `cost_micros` (None when
    there is none): the request log joined to the charges by request id, one query."""
    rows = RequestLog.objects.filter(user_id=user_id)
    if filters.since is not None:
        rows = rows.filter(created_at__gte=filters.since)
    if filters.until is not None:
        rows = rows.filter(created_at__lte=filters.until)
    if filters.model:
        rows = rows.filter(model=filters.model)
    if filters.api_key_id is not None:
        rows = rows.filter(api_key_id=filters.api_key_id)
    if filters.status == "ok":
        rows = rows.filter(status=200)
    elif filters.status == "error":
        rows = rows.exclude(status=200)
    # The user in the join too: a request id names one user's request, and the join says so.
    charge = Charge.objects.filter(request_id=OuterRef("request_id"), user_id=user_id)
    return rows.annotate(cost_micros=Subquery(charge.values("cost_micros")[:1])).order_by(
        "-created_at", "-id")


Cursor = tuple[datetime, int]  # (created_at, id) of the last row shown


def activity_page(user_id: int, filters: ActivityFilters, *, size: int,
                  before: Cursor | None = None) -> tuple[list[ActivityRow], Cursor | None]:
    """Up to `size` of the user's requests older than `before` (keyset: the same cost on the
    thousandth page as on the first), and the cursor of the next page (None: no more). Three
    queries: the requests with their costs, their workers' names, the user's keys' names."""
    rows = activity_of(user_id, filters)
    if before is not None:
        at, pk = before
        # created_at <= at bounds the index scan (user_id, created_at, id) to start there.
        rows = rows.filter(Q(created_at__lt=at) | Q(created_at=at, pk__lt=pk),
                           created_at__lte=at)
    found = list(rows[:size + 1])
    more = len(found) > size
    found = found[:size]
    workers = worker_names({r.deployment_id for r in found if r.deployment_id is not None})
    keys = dict(ApiKey.objects.filter(user_id=user_id).values_list("pk", "name")) if found \
        else {}
    page = [ActivityRow(
        request_id=r.request_id, created_at=r.created_at, model=r.model,
        prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens,
        cost_micros=r.cost_micros, estimated=r.estimated, ttft_ms=r.ttft_ms,
        latency_ms=r.latency_ms,
        worker=workers.get(r.deployment_id, worker_ref(r.deployment_id))
        if r.deployment_id is not None else "",
        status="ok" if r.status == 200 else f"{r.status} {r.error_code}".strip(),
        api_key=keys.get(r.api_key_id, "")) for r in found]
    return page, ((found[-1].created_at, found[-1].pk) if more else None)


def worker_names(deployment_ids) -> dict[int, str]:
    """What a consumer is told about the workers that served them: the name /v1's
    X-Rigshare-Worker header gives, and the machine's GPUs ("deployment:12 · 2× NVIDIA RTX
    4090"). Never the provider, whose machine names are their own. One query."""
    if not deployment_ids:
        return {}
    gpus: dict[int, Counter] = defaultdict(Counter)
    for deployment_id, gpu in Card.objects.filter(
            node__deployments__in=deployment_ids, present=True).order_by().values_list(
            "node__deployments", "name"):
        gpus[deployment_id][gpu] += 1
    names = {}
    for pk in deployment_ids:
        cards = ", ".join(f"{n}× {gpu}" if n > 1 else gpu
                          for gpu, n in sorted(gpus.get(pk, Counter()).items()))
        names[pk] = f"{worker_ref(pk)} · {cards}" if cards else worker_ref(pk)
    return names



# --- a renter's rented card as their own endpoint ---

LIVE_WINDOW_S = 60


def rental_endpoint(rental, *, base_url: str, now=None) -> dict:
    """What a renter needs to use the card they rent: the models its engine serves under
    their public names, where to send requests, and what the card did for them: requests and
    output tokens/s over the last minute, and since the rental began. The renter's requests
    for those models go to this card first and pay no per-token price (routing.placement);
    only the renter's own rows are counted. Four queries."""
    now = now or timezone.now()
    deployments = list(Deployment.objects.filter(node_id=rental.card.node_id, reported=True)
                       .order_by("engine_model_id"))
    names = {engine_id: (name, context) for engine_id, name, context in EngineModel.objects
             .filter(engine_model_id__in=[d.engine_model_id for d in deployments],
                     model__is_active=True)
             .values_list("engine_model_id", "model__name", "model__context_length")}
    served = [{"name": names[d.engine_model_id][0],
               # the engine's own context where it said, else the model's
               "context": d.max_context or names[d.engine_model_id][1],
               "engine": d.get_engine_display() or "unknown", "healthy": d.healthy,
               "running": d.engine_running, "waiting": d.engine_waiting}
              for d in deployments if d.engine_model_id in names]
    end = rental.stopped_at or now
    mine = RequestLog.objects.filter(user_id=rental.renter_id,
                                     deployment_id__in=[d.pk for d in deployments],
                                     created_at__gte=rental.started_at, created_at__lte=end)
    window_start = max(rental.started_at, end - timedelta(seconds=LIVE_WINDOW_S))
    window_s = max((end - window_start).total_seconds(), 1)
    total = mine.aggregate(requests=Count("pk"), completion=Sum("completion_tokens"),
                           prompt=Sum("prompt_tokens"))
    recent = mine.filter(created_at__gte=window_start).aggregate(
        requests=Count("pk"), completion=Sum("completion_tokens"))
    return {
        "rental": rental, "base_url": base_url, "models": served,
        "example_model": served[0]["name"] if served else "",
        "live": {"window_s": round(window_s), "requests": recent["requests"],
                 "tokens_per_s": (recent["completion"] or 0) / window_s},
        "total": {"requests": total["requests"], "completion_tokens": total["completion"] or 0,
                  "prompt_tokens": total["prompt"] or 0},
    }


def platform_prices(engine_models) -> dict[str, PlatformPrice]:
    """The price per 1M output tokens the platform charges now for the public model each of
    these engine model ids serves (as the pool maps them: the operator's EngineModel, else a
    public model of the same name); ids of no active, priced model are left out. Two queries."""
    ids = set(engine_models)
    if not ids:
        return {}
    mapped: dict[str, str] = {}
    same_name: set[str] = set()
    for name, engine_model_id in (Model.objects.filter(is_active=True)
                                  .filter(Q(name__in=ids)
                                          | Q(engine_models__engine_model_id__in=ids))
                                  .values_list("name", "engine_models__engine_model_id")):
        if engine_model_id in ids:
            mapped[engine_model_id] = name
        if name in ids:
            same_name.add(name)
    names = {name: name for name in same_name} | mapped
    prices = model_prices_now(set(names.values()))
    return {engine_id: PlatformPrice(name, prices[name].output_micros_per_mtok)
            for engine_id, name in names.items() if name in prices}


# --- what the platform checked after verification ---

def card_checks(node_id: int, *, limit: int = 10) -> dict:
    """The rent page's history of a card's engine since it was verified: the latest unannounced
    checks (routing/checks.py) and episodes of served traffic slower than verified
    (verification.ServedDrift), newest first. Two queries."""
    from routing.models import UnannouncedCheck
    from verification.models import ServedDrift

    return {"checks": list(UnannouncedCheck.objects.filter(node_id=node_id)[:limit]),
            "drifts": list(ServedDrift.objects.filter(node_id=node_id)
                           .select_related("run")[:limit])}
