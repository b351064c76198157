"""The pool snapshot: every deployment that may take traffic, with what routing needs to know,
kept from PostgreSQL (and the in-flight counts every server process shares in Redis) at least
every REFRESH_S, and only read on the request path.

A refresh reads the whole pool once; after that it reads the change feed (routing/changes.py)
and only the nodes it names, so that standing still costs one indexed query whatever the
fleet's size, and a change costs in proportion to it (`make bench-pool`). Each model's workers
are a `placement.Fleet`: rows plus the arrays the request path reads.

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
from dataclasses import dataclass, field, replace
from datetime import datetime

import numpy as np
from django.conf import settings
from django.db.models.functions import Coalesce
from django.utils import timezone

from billing.metering import Price
from billing.models import ModelPrice
from config.redis import REDIS_ERRORS, redis_client
from marketplace import engine_keys
from marketplace.models import Card, Node, Rental
from routing import balancer, changes
from routing.models import Deployment, EngineModel, Model, worker_ref
from routing.placement import NOBODY, Fleet, Worker
from routing.retry import BREAKER
from verification.models import VerifiedCapacity

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # a change reaches every router within 2 s
# Every process's in-flight counts, exchanged this often: what one process sends a worker, the
# others see within about this long (the balancer's load bound counts on it).
LOAD_EXCHANGE_S = 0.1
MAX_AGE_S = 5.0  # older than this (the refresher died), a request rebuilds it first
LOAD_TTL_S = 10  # a process that stops publishing its load is forgotten after this


@dataclass(frozen=True)
class ModelEntry:
    name: str
    context_length: int
    created: int  # unix time, for /v1/models
    prices: tuple[tuple[datetime, Price], ...]  # newest effective time first
    description: str = ""

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
    workers: dict[str, Fleet]  # by public model name; each fleet's load column: `load`
    load: dict[int, int] = field(default_factory=dict)  # in-flight requests per deployment
    own_load: dict[int, int] = field(default_factory=dict)  # this process's part of `load`
    routers: int = 1  # live server processes that exchanged `load`, this one included
    # What the next refresh starts from (routing/changes.py):
    feed: changes.Position | None = None  # where in the change feed this snapshot is current
    mapping: dict[str, str] = field(default_factory=dict)  # engine model id -> public name
    digests: dict[int, int] = field(default_factory=dict)  # per worker, for `version`
    sums: dict[str, int] = field(default_factory=dict)  # per model, of its workers' digests
    full_at: float = 0.0  # time.monotonic() of the last full read

    def sent_since(self) -> dict[int, int]:
        """Requests this process has sent (or finished: negative) per deployment since its
        load was exchanged: what a fleet's load column does not hold yet."""
        return {d: n for d in INFLIGHT.keys() | self.own_load.keys()
                if (n := INFLIGHT.get(d, 0) - self.own_load.get(d, 0))}

    def with_load(self, load: dict[int, int], own: dict[int, int],
                  routers: int) -> "Snapshot":
        """The same snapshot with newly exchanged load."""
        return replace(self, load=load, own_load=own, routers=routers,
                       workers={name: fleet.with_load(load, routers)
                                for name, fleet in self.workers.items()})

    @property
    def size(self) -> int:
        return sum(len(w) for w in self.workers.values())


# --- in-flight requests of this process, shared through Redis ---

INFLIGHT: Counter = Counter()  # deployment id -> requests this process is proxying now
PROCESS_ID = uuid.uuid4().hex[:12]


def in_flight(deployment_id: int) -> int:
    """Requests in flight to a deployment from every server process, as this one knows now: the
    last exchanged load and what this process sent or finished since."""
    snap = POOL.snapshot
    own = INFLIGHT.get(deployment_id, 0)
    if snap is None:
        return own
    return max(own, snap.load.get(deployment_id, 0) + own - snap.own_load.get(deployment_id, 0))


def load_exchange(own: dict[int, int]) -> dict[int, int]:
    """Publish this process's in-flight counts, read every live process's, sum them."""
    return exchange(own)[0]


def exchange(own: dict[int, int]) -> tuple[dict[int, int], int]:
    """`load_exchange`, and how many router processes are live (this one included)."""
    if not settings.REDIS_URL:
        return dict(own), 1
    try:
        return _exchange(own)
    except REDIS_ERRORS:  # Redis away: this process's own counts are all it knows
        return dict(own), 1


def _exchange_now() -> tuple[dict[int, int], dict[int, int], int]:
    """(every process's load, this process's part of it, how many processes)."""
    own = dict(INFLIGHT)
    load, routers = exchange(own)
    return load, own, routers


def _exchange(own: dict[int, int]) -> tuple[dict[int, int], int]:
    r = redis_client()
    mine = f"rigshare:routing:load:{PROCESS_ID}"
    with r.pipeline() as pipe:
        pipe.delete(mine)
        if own:
            pipe.hset(mine, mapping={str(k): v for k, v in own.items()})
        # An idle process stays listed; the circuits it holds open show on the pool page.
        pipe.hset(mine, mapping={"_": 0, "_open": ",".join(map(str, sorted(BREAKER.open_ids())))})
        pipe.expire(mine, LOAD_TTL_S)
        pipe.sadd("rigshare:routing:procs", PROCESS_ID)
        pipe.smembers("rigshare:routing:procs")
        members = pipe.execute()[-1]
    procs = sorted(m.decode() for m in members)
    with r.pipeline() as pipe:
        for proc in procs:
            pipe.hgetall(f"rigshare:routing:load:{proc}")
        maps = pipe.execute()
    gone = [proc for proc, data in zip(procs, maps, strict=True) if not data]
    if gone:
        r.srem("rigshare:routing:procs", *gone)
    return _summed(maps), max(1, len(procs) - len(gone))


def _summed(maps: list[dict]) -> dict[int, int]:
    """The processes' load hashes added up per deployment (fields "_...": not load)."""
    total: Counter = Counter()
    for data in maps:
        for k, v in data.items():
            if not k.startswith(b"_"):
                total[int(k)] += int(v)
    return dict(total)


def load_seen() -> dict[int, int]:
    """Requests in flight per deployment as the server processes last exchanged them, read
    without joining them (a Celery worker is no router: it must not count as one)."""
    if not settings.REDIS_URL:
        return {}
    try:
        r = redis_client()
        procs = sorted(m.decode() for m in r.smembers("rigshare:routing:procs"))
        with r.pipeline() as pipe:
            for proc in procs:
                pipe.hgetall(f"rigshare:routing:load:{proc}")
            maps = pipe.execute()
    except REDIS_ERRORS:
        return {}
    return _summed(maps)


def open_circuits() -> Counter:
    """Deployment id -> how many server processes hold its circuit open (as each last
    exchanged its load); this process's own state where Redis cannot say."""
    mine = Counter(BREAKER.open_ids())
    if not settings.REDIS_URL:
        return mine
    try:
        r = redis_client()
        procs = sorted(m.decode() for m in r.smembers("rigshare:routing:procs"))
        with r.pipeline() as pipe:
            for proc in procs:
                pipe.hget(f"rigshare:routing:load:{proc}", "_open")
            fields = pipe.execute()
    except REDIS_ERRORS:
        return mine
    found: Counter = Counter()
    for field_ in fields:
        found.update(int(d) for d in (field_ or b"").decode().split(",") if d)
    return found


# --- building ---

FULL_EVERY_S = 900.0  # a full read now and then, whatever the feed says: a backstop


def _digest(worker: Worker) -> int:
    # The engine key and certificate are out of the repr (logs) but in the digest: a new key
    # or certificate is a new worker.
    return int.from_bytes(hashlib.blake2b(
        f"{worker!r}\0{worker.engine_key}\0{worker.tls_pin}".encode(),
        digest_size=8).digest(), "little")


def _entries() -> tuple[dict[str, ModelEntry], dict[str, str]]:
    """The active models with their prices, and which engine model id serves which."""
    models = {m.name: m for m in Model.objects.filter(is_active=True)}
    mapping = dict(EngineModel.objects.filter(model__is_active=True)
                   .values_list("engine_model_id", "model__name"))
    prices: dict[str, list] = {name: [] for name in models}
    for row in ModelPrice.objects.filter(model__in=list(models)).order_by("-effective_at"):
        prices[row.model].append((row.effective_at, Price(
            row.pk, row.input_micros_per_mtok, row.output_micros_per_mtok)))
    entries = {name: ModelEntry(name, m.context_length, int(m.created_at.timestamp()),
                                tuple(prices[name]), m.description)
               for name, m in models.items()}
    return entries, mapping


def _workers(entries: dict[str, ModelEntry], mapping: dict[str, str], now: datetime,
             node_ids=None) -> dict[str, list[Worker]]:
    """Every worker by public model name: of every node, or of `node_ids` only."""
    nodes = {} if node_ids is None else {"node_id__in": node_ids}
    deployments = list(Deployment.objects.filter(
        reported=True, healthy=True, node__status=Node.Status.ONLINE,
        node__engine_reachable=True, node__credential_revoked_at__isnull=True, **nodes,
    ).select_related("node").order_by("pk"))
    node_ids = {d.node_id for d in deployments}
    cards: dict[int, list] = {}
    for card_id, node_id, status in Card.objects.filter(
            node_id__in=node_ids, present=True).values_list("pk", "node_id",
                                                            "verification_status"):
        cards.setdefault(node_id, []).append((card_id, status))
    capacity: Counter = Counter()
    slots: Counter = Counter()
    routed_since: dict[tuple, datetime] = {}
    for node_id, model, tps, since, concurrency in VerifiedCapacity.objects.filter(
            card__node_id__in=node_ids, card__present=True).values_list(
            "card__node_id", "model", Coalesce("routing_tps", "tokens_per_s"),
            "routed_since", "concurrency"):
        capacity[(node_id, model)] += tps
        slots[(node_id, model)] = max(slots[(node_id, model)], concurrency)
        routed_since[(node_id, model)] = max(since, routed_since.get((node_id, model), since))
    renters: dict[int, set] = {}
    for node_id, renter_id in Rental.objects.filter(
            card__node_id__in=node_ids, stopped_at__isnull=True).values_list(
            "card__node_id", "renter_id"):
        renters.setdefault(node_id, set()).add(renter_id)

    workers: dict[str, list[Worker]] = {}
    for d in deployments:
        name = mapping.get(d.engine_model_id) or (
            d.engine_model_id if d.engine_model_id in entries else None)
        if name is None or not d.node.engine_connect_url:
            continue
        node_cards = cards.get(d.node_id, [])
        # Shared traffic only for a node whose every card's serving is verified and that is
        # not held out (an operator's review, a GPU UUID another node holds).
        verified = bool(node_cards) and not d.node.held_out and all(
            status in Card.ROUTABLE for _, status in node_cards)
        # Renters' prompts cross the internet: where TLS is required (production), shared
        # traffic goes only to an engine the platform reaches encrypted (engine_tls.py).
        verified = verified and (d.node.engine_encrypted
                                 or not settings.RIGSHARE_ENGINE_TLS_REQUIRED)
        rent = renters.get(d.node_id)
        # Two renters of one engine's cards: it is exclusive to neither, so it serves nobody.
        renter_id = None if not rent else (next(iter(rent)) if len(rent) == 1 else NOBODY)
        # New to traffic since the latest of: verified, deployed, back online.
        since = max(routed_since.get((d.node_id, d.engine_model_id), d.first_seen_at),
                    d.first_seen_at, d.node.status_changed_at)
        workers.setdefault(name, []).append(Worker(
            deployment_id=d.pk, ref=worker_ref(d.pk), node_id=d.node_id,
            provider_id=d.node.owner_id, url=d.node.engine_connect_url, engine=d.engine,
            engine_model=d.engine_model_id, quantization=d.quantization,
            max_context=d.max_context,
            capacity_tps=float(capacity.get((d.node_id, d.engine_model_id), 0.0)),
            verified=verified, renter_id=renter_id,
            ramp=balancer.ramp((now - since).total_seconds()),
            engine_queue=(d.engine_running or 0) + (d.engine_waiting or 0),
            ramp_since=since.timestamp(), slots=slots[(d.node_id, d.engine_model_id)],
            engine_key=engine_keys.unseal(d.node.engine_key_sealed),
            tls_pin=d.node.engine_tls_certificate))
    return workers


def workers_of(deployment_ids) -> list[Worker]:
    """The pool's workers among these deployments, as a refresh reads them (unannounced checks
    send to them what the proxy would)."""
    entries, mapping = _entries()
    node_ids = set(Deployment.objects.filter(pk__in=deployment_ids)
                   .values_list("node_id", flat=True))
    wanted = set(deployment_ids)
    return [w for workers in _workers(entries, mapping, timezone.now(), node_ids).values()
            for w in workers if w.deployment_id in wanted]


def _version(entries: dict[str, ModelEntry], sums: dict[str, int]) -> str:
    """A digest of the snapshot's content, load excluded: the same rows, the same version."""
    return hashlib.sha256(json.dumps(
        [[(e.name, e.context_length, [(t.isoformat(), p.price_id) for t, p in e.prices])
          for e in entries.values()], sorted(sums.items())],
        default=str).encode()).hexdigest()[:12]


def _finish(generation: int, entries, mapping, fleets: dict[str, Fleet], digests: dict,
            sums: dict, feed, full_at: float) -> Snapshot:
    fleets = {name: fleet for name, fleet in fleets.items() if len(fleet)}
    snap = Snapshot(
        version=_version(entries, {n: sums[n] for n in fleets}), generation=generation,
        built_at=time.monotonic(), models=entries, workers=fleets, feed=feed,
        mapping=mapping, digests=digests, sums=sums, full_at=full_at)
    return snap.with_load(*_exchange_now())


def build(generation: int = 0, now: datetime | None = None) -> Snapshot:
    """Read the whole pool from the database. Runs in a worker thread, never on the event
    loop."""
    now = now or timezone.now()
    feed = changes.start()  # before the read: what commits during it is read again next time
    entries, mapping = _entries()
    fleets = {name: Fleet(ws) for name, ws in _workers(entries, mapping, now).items()}
    digests = {w.deployment_id: _digest(w) for fleet in fleets.values() for w in fleet}
    sums = {name: sum(digests[w.deployment_id] for w in fleet) % 2**64
            for name, fleet in fleets.items()}
    return _finish(generation, entries, mapping, fleets, digests, sums, feed, time.monotonic())


def refreshed(previous: Snapshot | None, generation: int = 0,
              now: datetime | None = None) -> Snapshot:
    """`previous` with what changed since it was read: the nodes the change feed names read
    again, engine queues, the cold-start ramp, the load. A full read when there is no
    previous snapshot, a model or engine model id changed, the feed's rows may have been
    trimmed since the last read, or FULL_EVERY_S passed."""
    now = now or timezone.now()
    mono = time.monotonic()
    if (previous is None or previous.feed is None or mono - previous.full_at > FULL_EVERY_S
            or mono - previous.built_at > changes.KEEP_S / 2):
        return build(generation, now)
    found = changes.read(previous.feed)
    entries, mapping = previous.models, previous.mapping
    if found.models:
        entries, mapping = _entries()
        if mapping != previous.mapping or set(entries) != set(previous.models):
            return build(generation, now)  # workers change model: read them all
    fleets = dict(previous.workers)
    digests, sums = previous.digests, dict(previous.sums)
    fresh = _workers(entries, mapping, now, found.nodes) if found.nodes else {}
    queues = _queues(found.queues) if found.queues else {}
    now_ts = now.timestamp()
    for name in set(fleets) | set(fresh):
        fleet = fleets.get(name) or Fleet()
        drop = np.isin(fleet.cols["node"], list(found.nodes)) if found.nodes else \
            np.zeros(len(fleet), bool)
        # Engine queues and ramps change in place: the worker is dropped and added back.
        changed = {}
        if queues:
            at, _ = fleet.positions(list(queues))
            for i in at[~drop[at]].tolist():
                w = fleet[i]
                changed[i] = replace(w, engine_queue=queues[w.deployment_id])
        ramping = np.flatnonzero((fleet.cols["ramp"] < 1.0) & ~drop)
        if len(ramping):
            ramps = balancer.ramps(now_ts - fleet.cols["since"][ramping])
            for i in ramping[ramps != fleet.cols["ramp"][ramping]].tolist():
                w = changed.get(i, fleet[i])
                changed[i] = replace(w, ramp=balancer.ramp(now_ts - w.ramp_since))
        add = [*fresh.get(name, ()), *changed.values()]
        if not drop.any() and not add:
            continue
        drop[list(changed)] = True
        if digests is previous.digests:
            digests = dict(digests)
        total = sums.get(name, 0)
        for i in np.flatnonzero(drop).tolist():
            total -= digests.pop(fleet[i].deployment_id)
        for w in add:
            digests[w.deployment_id] = _digest(w)
            total += digests[w.deployment_id]
        sums[name] = total % 2**64
        fleets[name] = fleet.patch(drop, add)
    return _finish(generation, entries, mapping, fleets, digests, sums, found.position,
                   previous.full_at)


def _queues(deployment_ids) -> dict[int, int]:
    return {pk: (running or 0) + (waiting or 0) for pk, running, waiting in
            Deployment.objects.filter(pk__in=deployment_ids).values_list(
                "pk", "engine_running", "engine_waiting")}


class PoolUnavailable(Exception):
    """No snapshot could be built (the database is away) and none was built before."""


class Pool:
    """This process's snapshot and the task that keeps it fresh on the running event loop."""

    def __init__(self, builder=refreshed, refresh_s: float = REFRESH_S):
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
            snap = await calls.run(self.builder, self.snapshot, self.generation)
            if epoch == self._epoch:
                break
        self.snapshot = snap
        for listener in self.listeners:
            listener(snap)
        return snap

    async def exchange(self) -> None:
        """Every process's load into the snapshot, between two refreshes."""
        from routing import calls

        snap = self.snapshot
        if snap is None:
            return
        exchanged = await calls.run(_exchange_now)
        if self.snapshot is snap:  # not refreshed or invalidated meanwhile
            self.snapshot = snap.with_load(*exchanged)

    async def _run(self):
        refresh_at = time.monotonic() + self.refresh_s
        while True:
            await asyncio.sleep(min(LOAD_EXCHANGE_S, self.refresh_s))
            try:
                if time.monotonic() >= refresh_at:
                    refresh_at = time.monotonic() + self.refresh_s
                    await self.refresh()
                else:
                    await self.exchange()
            except Exception:  # keep serving the last snapshot; MAX_AGE_S bounds how long
                log.exception("pool refresh failed (pid %s)", os.getpid())


POOL = Pool()
