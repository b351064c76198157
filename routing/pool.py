"""The pool snapshot: every deployment that may take traffic, with what routing needs to know,
built from PostgreSQL (and the in-flight counts every server process shares in Redis) at least
every REFRESH_S, and only read on the request path.

Each server process keeps its own snapshot. Its `version` is a digest of its content (load
excluded), so two processes that read the same rows hold the same version: two routers compute
the same placement from the same facts with no coordination.
"""

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db.models.functions import Coalesce
from django.utils import timezone

from billing.metering import Price
from billing.models import ModelPrice
from config.redis import REDIS_ERRORS, redis_client
from marketplace.models import Card, Node, Rental
from routing import balancer
from routing.models import Deployment, EngineModel, Model, worker_ref
from routing.placement import Worker
from verification.models import VerifiedCapacity

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # a change reaches every router within 2 s
MAX_AGE_S = 5.0  # older than this (the refresher died), a request rebuilds it first
LOAD_TTL_S = 10  # a process that stops publishing its load is forgotten after this


@dataclass(frozen=True)
class ModelEntry:
    name: str
    context_length: int
    created: int  # unix time, for /v1/models
    prices: tuple[tuple[datetime, Price], ...]  # newest effective time first

    def price_at(self, at: datetime) -> Price | None:
        for effective_at, price in self.prices:
            if effective_at <= at:
                return price
        return None


@dataclass(frozen=True)
class Snapshot:
    version: str
    generation: int
    built_at: float  # time.monotonic()
    models: dict[str, ModelEntry]
    workers: dict[str, tuple[Worker, ...]]  # by public model name
    load: dict[int, int] = field(default_factory=dict)  # in-flight requests per deployment
    own_load: dict[int, int] = field(default_factory=dict)  # this process's part of `load`

    def load_now(self, deployment_ids) -> dict[int, int]:
        """In-flight requests per deployment now: every other process's as last exchanged,
        this one's as it stands."""
        return {d: self.load.get(d, 0) - self.own_load.get(d, 0) + INFLIGHT.get(d, 0)
                for d in deployment_ids}

    @property
    def size(self) -> int:
        return sum(len(w) for w in self.workers.values())


# --- in-flight requests of this process, shared through Redis ---

INFLIGHT: Counter = Counter()  # deployment id -> requests this process is proxying now
PROCESS_ID = uuid.uuid4().hex[:12]


def load_exchange(own: dict[int, int]) -> dict[int, int]:
    """Publish this process's in-flight counts, read every live process's, sum them."""
    if not settings.REDIS_URL:
        return dict(own)
    try:
        return _exchange(own)
    except REDIS_ERRORS:  # Redis away: this process's own counts are all it knows
        return dict(own)


def _exchange(own: dict[int, int]) -> dict[int, int]:
    r = redis_client()
    mine = f"rigshare:routing:load:{PROCESS_ID}"
    with r.pipeline() as pipe:
        pipe.delete(mine)
        if own:
            pipe.hset(mine, mapping={str(k): v for k, v in own.items()})
        pipe.hset(mine, "_", 0)  # an idle process stays listed
        pipe.expire(mine, LOAD_TTL_S)
        pipe.sadd("rigshare:routing:procs", PROCESS_ID)
        pipe.smembers("rigshare:routing:procs")
        members = pipe.execute()[-1]
    procs = sorted(m.decode() for m in members)
    with r.pipeline() as pipe:
        for proc in procs:
            pipe.hgetall(f"rigshare:routing:load:{proc}")
        maps = pipe.execute()
    total: Counter = Counter()
    gone = []
    for proc, data in zip(procs, maps, strict=True):
        if not data:
            gone.append(proc)
        for k, v in data.items():
            if k != b"_":
                total[int(k)] += int(v)
    if gone:
        r.srem("rigshare:routing:procs", *gone)
    return dict(total)


# --- building ---

def build(generation: int = 0, now: datetime | None = None) -> Snapshot:
    """Read the pool from the database. Runs in a worker thread, never on the event loop."""
    now = now or timezone.now()
    models = {m.name: m for m in Model.objects.filter(is_active=True)}
    mapping = dict(EngineModel.objects.filter(model__is_active=True)
                   .values_list("engine_model_id", "model__name"))
    prices: dict[str, list] = {name: [] for name in models}
    for row in ModelPrice.objects.filter(model__in=list(models)).order_by("-effective_at"):
        prices[row.model].append((row.effective_at, Price(
            row.pk, row.input_micros_per_mtok, row.output_micros_per_mtok)))
    entries = {name: ModelEntry(name, m.context_length, int(m.created_at.timestamp()),
                                tuple(prices[name])) for name, m in models.items()}

    deployments = list(Deployment.objects.filter(
        reported=True, healthy=True, node__status=Node.Status.ONLINE,
        node__engine_reachable=True, node__credential_revoked_at__isnull=True,
    ).select_related("node").order_by("pk"))
    node_ids = {d.node_id for d in deployments}
    cards: dict[int, list] = {}
    for card_id, node_id, status in Card.objects.filter(
            node_id__in=node_ids, present=True).values_list("pk", "node_id",
                                                            "verification_status"):
        cards.setdefault(node_id, []).append((card_id, status))
    capacity: Counter = Counter()
    routed_since: dict[tuple, datetime] = {}
    for node_id, model, tps, since in VerifiedCapacity.objects.filter(
            card__node_id__in=node_ids, card__present=True).values_list(
            "card__node_id", "model", Coalesce("routing_tps", "tokens_per_s"),
            "routed_since"):
        capacity[(node_id, model)] += tps
        routed_since[(node_id, model)] = max(since, routed_since.get((node_id, model), since))
    renters: dict[int, set] = {}
    for node_id, renter_id in Rental.objects.filter(
            card__node_id__in=node_ids, stopped_at__isnull=True).values_list(
            "card__node_id", "renter_id"):
        renters.setdefault(node_id, set()).add(renter_id)

    workers: dict[str, list[Worker]] = {}
    for d in deployments:
        name = mapping.get(d.engine_model_id) or (
            d.engine_model_id if d.engine_model_id in models else None)
        if name is None or not d.node.engine_connect_url:
            continue
        node_cards = cards.get(d.node_id, [])
        # Shared traffic only for a node whose every card's serving is verified and that is
        # not held out (an operator's review, a GPU UUID another node holds).
        verified = bool(node_cards) and not d.node.held_out and all(
            status in Card.ROUTABLE for _, status in node_cards)
        rent = renters.get(d.node_id)
        # Two renters of one engine's cards: it is exclusive to neither, so it serves nobody.
        renter_id = None if not rent else (next(iter(rent)) if len(rent) == 1 else -1)
        workers.setdefault(name, []).append(Worker(
            deployment_id=d.pk, ref=worker_ref(d.pk), node_id=d.node_id,
            provider_id=d.node.owner_id, url=d.node.engine_connect_url, engine=d.engine,
            engine_model=d.engine_model_id, quantization=d.quantization,
            max_context=d.max_context,
            capacity_tps=float(capacity.get((d.node_id, d.engine_model_id), 0.0)),
            verified=verified, renter_id=renter_id,
            # New to traffic since the latest of: verified, deployed, back online.
            ramp=balancer.ramp((now - max(
                routed_since.get((d.node_id, d.engine_model_id), d.first_seen_at),
                d.first_seen_at, d.node.status_changed_at)).total_seconds()),
            engine_queue=(d.engine_running or 0) + (d.engine_waiting or 0)))
    frozen = {name: tuple(ws) for name, ws in workers.items()}
    digest = hashlib.sha256(json.dumps(
        [[(e.name, e.context_length, [(t.isoformat(), p.price_id) for t, p in e.prices])
          for e in entries.values()],
         sorted((n, [repr(w) for w in ws]) for n, ws in frozen.items())],
        default=str).encode()).hexdigest()[:12]
    return Snapshot(version=digest, generation=generation, built_at=time.monotonic(),
                    models=entries, workers=frozen, load=load_exchange(own := dict(INFLIGHT)),
                    own_load=own)


class PoolUnavailable(Exception):
    """No snapshot could be built (the database is away) and none was built before."""


class Pool:
    """This process's snapshot and the task that keeps it fresh on the running event loop."""

    def __init__(self, builder=build, refresh_s: float = REFRESH_S):
        self.builder = builder
        self.refresh_s = refresh_s
        self.snapshot: Snapshot | None = None
        self.generation = 0
        self._task: asyncio.Task | None = None
        self._loop = None
        self._epoch = 0
        self.listeners: list = []  # called with each new snapshot (metrics)

    async def current(self) -> Snapshot:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._task is None or self._task.done():
            self._loop = loop
            self._task = loop.create_task(self._run())
        snap = self.snapshot
        if snap is None or time.monotonic() - snap.built_at > MAX_AGE_S:
            try:
                snap = await self.refresh()
            except Exception as exc:
                if snap is None:
                    raise PoolUnavailable from exc
                # The database away: the last snapshot is better than no answer.
                log.exception("pool refresh failed; serving snapshot %s", snap.version)
        return snap

    def invalidate(self) -> None:
        """The next request rebuilds the snapshot first (tests; an operator's change)."""
        self._epoch += 1
        self.snapshot = None

    async def refresh(self) -> Snapshot:
        from routing import calls  # the thread pool shared with billing calls

        for _ in range(3):  # invalidated while it was read: read again
            epoch = self._epoch
            self.generation += 1
            snap = await calls.run(self.builder, self.generation)
            if epoch == self._epoch:
                break
        self.snapshot = snap
        for listener in self.listeners:
            listener(snap)
        return snap

    async def _run(self):
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # keep serving the last snapshot; MAX_AGE_S bounds how long
                log.exception("pool refresh failed (pid %s)", os.getpid())


POOL = Pool()
