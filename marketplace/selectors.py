"""Reads shared by pages and the REST API."""

import contextlib
import hashlib
import json
import shlex
import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from billing import pricing
from billing.selectors import wallet_balance
from config.redis import REDIS_ERRORS
from marketplace import costs, engine_config, keyset, model_data, services, signals, uptime
from marketplace.filters import SORTS
from marketplace.models import (
    Card,
    EngineOverride,
    EnrolmentToken,
    Listing,
    Node,
    NodeUptimeHour,
    ProviderAlert,
    Rental,
    UuidConflict,
)


def _active_rental():
    return Rental.objects.filter(card=OuterRef("pk"), stopped_at__isnull=True)


def _catalog_matches(filters: dict) -> QuerySet[Card]:
    """Listed, present cards of online nodes that nobody rents now, filtered; unordered."""
    qs = (Card.objects
          .filter(present=True, listing__is_listed=True, node__status=Node.Status.ONLINE,
                  node__credential_revoked_at__isnull=True, node__needs_review=False,
                  node__uuid_conflict=False)
          .exclude(Exists(_active_rental())))
    if filters.get("search"):
        qs = qs.filter(_search(filters["search"]))
    if filters.get("gpu"):
        qs = qs.filter(name__iexact=filters["gpu"])
    if filters.get("min_vram_mib") is not None:
        qs = qs.filter(memory_total_mib__gte=filters["min_vram_mib"])
    if filters.get("max_price_micros") is not None:
        qs = qs.filter(listing__price_per_hour_micros__lte=filters["max_price_micros"])
    if filters.get("min_reliability") is not None:
        qs = qs.filter(node__reliability_pct__gte=filters["min_reliability"])
    if filters.get("region"):
        qs = qs.filter(node__region__iexact=filters["region"])
    if filters.get("verified_only"):
        qs = qs.filter(verification_status=Card.Verification.VERIFIED)
    return qs


def _search(term: str) -> Q:
    """The card's GPU, its machine's name, or a model the machine serves contains `term`, in
    any case. GPU names on offer are few and already cached for the drop-down: they are
    matched here, so that the database searches only the machines' search_text, through its
    trigram index (migrations/0008)."""
    needle = term.casefold()
    gpus = [name for name in catalog_choices()["gpus"] if needle in name.casefold()]
    machines = Q(node__search_text__contains=term.upper())
    return machines | Q(name__in=gpus) if gpus else machines


def cards_for_catalog(filters: dict) -> QuerySet[Card]:
    """The catalog's cards with what a row shows: node, listing and the node's card count are
    joined or annotated, never fetched per row. Unordered: catalog_page() pages through it."""
    cards_per_node = (Card.objects.filter(node=OuterRef("node"), present=True)
                      .order_by().values("node").annotate(n=Count("pk")).values("n"))
    return (_catalog_matches(filters).select_related("node", "listing")
            .annotate(cards_per_node=Subquery(cards_per_node)))


# Up to this many matches the catalog counts them; beyond, it says "about N", N being the
# planner's estimate: counting 100,000 matches would cost more than the page itself.
EXACT_COUNT_UP_TO = 1000


@dataclass
class CatalogPage:
    cards: list[Card]
    count: int
    # More than EXACT_COUNT_UP_TO match, and count is PostgreSQL's estimate of how many (or,
    # where it guessed fewer than that, EXACT_COUNT_UP_TO + 1: "more than" it).
    count_estimated: bool
    next_cursor: str | None
    previous_cursor: str | None

    @property
    def count_is_floor(self) -> bool:
        return self.count_estimated and self.count == EXACT_COUNT_UP_TO + 1


def catalog_page(filters: dict, *, sort: str = "price", cursor: tuple[bool, list] | None = None,
                 size: int) -> CatalogPage:
    """One page of the catalog in `sort` order, after (or, backwards, before) the row the
    cursor names, and the number of matches: three queries whatever the catalog's size."""
    order = SORTS[sort]
    backwards, values = cursor if cursor else (False, None)
    cards = cards_for_catalog(filters).annotate(**order.aliases())
    if values is not None:
        cards = cards.filter(*order.after(values, backwards=backwards))
    rows = list(cards.order_by(*order.ordering(backwards=backwards))[:size + 1])
    more, rows = len(rows) > size, rows[:size]
    if backwards:
        rows.reverse()
    has_next = more if not backwards else True
    has_previous = more if backwards else values is not None
    count, estimated = catalog_count(filters)
    return CatalogPage(
        cards=rows, count=count, count_estimated=estimated,
        next_cursor=keyset.encode(sort, False, order.values_of(rows[-1]))
        if has_next and rows else None,
        previous_cursor=keyset.encode(sort, True, order.values_of(rows[0]))
        if has_previous and rows else None)


def catalog_count(filters: dict) -> tuple[int, bool]:
    """(matches, estimated): exact up to EXACT_COUNT_UP_TO, else PostgreSQL's estimate (never
    below the bound it passed). Two queries on PostgreSQL whatever the size, so that a page's
    query count does not depend on the catalog: the estimate is a plan, nothing is read."""
    matches = _catalog_matches(filters).order_by().values("pk")
    if connection.vendor != "postgresql":
        return matches.count(), False  # the zero-setup demo: a small catalog on SQLite
    sql, params = matches.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    bounded = matches[:EXACT_COUNT_UP_TO + 1].count()
    if bounded <= EXACT_COUNT_UP_TO:
        return bounded, False
    return max(EXACT_COUNT_UP_TO + 1, round_estimate(int(plan[0]["Plan"]["Plan Rows"]))), True


def round_estimate(n: int) -> int:
    """Two significant figures: an estimate should not look more precise than it is."""
    if n < 100:
        return n
    scale = 10 ** (len(str(n)) - 2)
    return round(n / scale) * scale


CHOICES_FRESH_S = 60


def catalog_choices() -> dict[str, list[str]]:
    """GPU models and regions on offer, for the filter drop-downs and the search: two queries
    that read every listing, so cached until a listing changes (services.catalog_choices_forget)
    or a minute passes. With Redis away, the database answers every time."""
    try:
        choices = cache.get(services.CATALOG_CHOICES_KEY)
    except REDIS_ERRORS:
        choices = None
    if choices is None:
        offered = Card.objects.filter(present=True, listing__is_listed=True)
        choices = {
            "gpus": list(offered.order_by("name").values_list("name", flat=True).distinct()),
            "regions": list(offered.exclude(node__region="").order_by("node__region")
                            .values_list("node__region", flat=True).distinct()),
        }
        try:
            cache.add(services.CATALOG_CHOICES_KEY, choices, CHOICES_FRESH_S)
        except REDIS_ERRORS:
            pass
    return choices


def card_for_rent_page(card_id: int) -> Card:
    return (Card.objects.select_related("node", "node__owner", "listing")
            .annotate(cards_per_node=Subquery(
                Card.objects.filter(node=OuterRef("node"), present=True).order_by()
                .values("node").annotate(n=Count("pk")).values("n")))
            .get(pk=card_id))


def card_active_rental(card_id: int) -> Rental | None:
    return Rental.objects.filter(card_id=card_id, stopped_at__isnull=True).first()


def node_uptime_bars(node: Node, *, hours: int = 48,
                     now: datetime | None = None) -> list[uptime.HourBar]:
    now = now or timezone.now()
    start = uptime.hour_floor(now) - timedelta(hours=hours - 1)
    counts = dict(NodeUptimeHour.objects.filter(node=node, hour__gte=start)
                  .values_list("hour", "heartbeats"))
    return uptime.hour_bars(counts, start=start, end=now,
                            interval_s=settings.RIGSHARE_HEARTBEAT_INTERVAL_S,
                            not_before=node.created_at)


def rentals_of(user) -> QuerySet[Rental]:
    return Rental.objects.filter(renter=user).select_related("card", "card__node")


def provider_nodes(user) -> QuerySet[Node]:
    return (Node.objects.filter(owner=user).order_by("name", "id")
            .prefetch_related("cards", "cards__listing"))


def open_uuid_conflicts(node_ids: list[int]) -> list[UuidConflict]:
    """Open GPU UUID conflicts in which any of these nodes is the newcomer or the incumbent."""
    return list(UuidConflict.objects.filter(Q(node_id__in=node_ids) | Q(incumbent_id__in=node_ids),
                                            closed_at__isnull=True))


@dataclass(frozen=True)
class NodeEngine:
    """A node's engine configuration as its machine page shows it."""

    model: str  # "" until the agent reports a served model
    quantization: str
    inputs: dict  # engine_config.compute()'s arguments, less the overrides
    overrides: list[EngineOverride]
    config: engine_config.EngineConfig | None

    def override_map(self) -> dict[str, str]:
        return {row.flag: row.value for row in self.overrides}


def node_engine_inputs(node: Node) -> dict | None:
    """What the engine configuration of `node` is computed from: its present cards as the
    agent reported them (and verification measured them), its OS, and the first model its
    engine serves that the platform knows; None while the engine reports no model. An agent
    that runs the engine with the platform's configuration names its model (`--serve`) before
    any engine serves it: that model, then."""
    served = [entry for entry in node.engine_served or [] if entry.get("id")]
    served += [{"id": model} for model in node.engine_models or []
               if model not in {entry["id"] for entry in served}]
    wanted = (node.engine_process or {}).get("model") if node.engine_state else None
    if wanted:
        said = next((e for e in served if e["id"] == wanted), {})
        served = [{"id": wanted, "quantization": said.get("quantization")
                   or node.engine_process.get("quantization") or ""}]
    if not served:
        return None
    entry = next((e for e in served if model_data.architecture_for(e["id"])), served[0])
    return node_engine_inputs_for(node, model=entry["id"],
                                  quantization=entry.get("quantization") or "")


def node_engine_inputs_for(node: Node, *, model: str, quantization: str) -> dict:
    """The engine configuration's inputs for serving `model` at `quantization` on `node`."""
    cards = [card for card in node.cards.all() if card.present and card.memory_total_mib]
    facts = engine_config.NodeFacts(
        gpus=tuple(engine_config.Gpu(name=card.name, memory_mib=card.memory_total_mib,
                                     compute_capability=card.compute_capability,
                                     bandwidth_gbs=card.bandwidth_gbs,
                                     pcie_gen=card.pcie_gen_max)
                   for card in sorted(cards, key=lambda card: card.index)),
        # CUDA is there where NVML gave a card a compute capability, whatever the flag says.
        os=node.os, nvidia=node.has_nvidia or any(card.compute_capability for card in cards),
        nvlink=engine_config.nvlink_joined(card.nvlink_links for card in cards))
    inputs = {"node": facts, "model": model, "arch": model_data.architecture_for(model),
              "quantization": quantization}
    # The vLLM the agent found installed (else the version the platform assumes).
    if version := engine_config.parse_vllm_version((node.engine_versions or {}).get("vllm")):
        inputs["vllm_version"] = version
    # HTTPS with the agent's certificate, where the agent says it makes one.
    inputs["tls"] = bool((node.engine_process or {}).get("tls"))
    # --port: where the agent says the engine listens.
    with contextlib.suppress(ValueError):
        if port := urlsplit(node.engine_url).port:
            inputs["port"] = port
    return inputs


def node_engine(node: Node) -> NodeEngine:
    """The node's computed engine command with its stored overrides on top (two queries: the
    cards and the overrides)."""
    overrides = list(EngineOverride.objects.filter(node=node).select_related("set_by"))
    inputs = node_engine_inputs(node)
    if inputs is None:
        return NodeEngine(model="", quantization="", inputs={}, overrides=overrides,
                          config=None)
    config = engine_config.compute(
        overrides={row.flag: row.value for row in overrides},
        override_reasons={row.flag: row.reason for row in overrides}, **inputs)
    return NodeEngine(model=inputs["model"], quantization=inputs["quantization"],
                      inputs=inputs, overrides=overrides, config=config)


# What each state of an engine the agent runs means for its owner.
ENGINE_STATE_TEXT = {
    "starting": "The agent is starting the engine.",
    "loading": "The engine's process runs; it loads the model and does not answer yet.",
    "ready": "The engine answers and takes requests.",
    "draining": "The engine takes no new request: the agent restarts it once the requests in "
                "flight are done.",
    "crashed": "The engine exited; the agent restarts it after a short wait (longer after each "
               "crash in a row).",
    "stopped": "The agent stopped the engine.",
}


@dataclass(frozen=True)
class EngineProcess:
    """The engine the node's agent runs, as its machine page shows it."""

    state: str
    text: str
    since: datetime | None
    mode: str  # "platform" or "command"
    command: str  # the argv as one shell line, its key masked
    pid: int | None
    restarts: int
    exit_code: int | None
    error: str
    log: str
    restart_pending: bool  # asked on the page, not yet acted on by the agent


def node_engine_process(node: Node) -> EngineProcess | None:
    """None where the provider runs the engine (the agent does not)."""
    if not node.engine_state:
        return None
    process = node.engine_process or {}
    return EngineProcess(
        state=node.engine_state, text=ENGINE_STATE_TEXT.get(node.engine_state, ""),
        since=node.engine_state_since, mode=process.get("mode") or "",
        # *** (a masked key) left unquoted: it reads as what it hides, not as a shell word.
        command=" ".join(arg if arg == "***" else shlex.quote(arg)
                         for arg in process.get("argv") or []), pid=process.get("pid"),
        restarts=process.get("restarts") or 0, exit_code=process.get("exit_code"),
        error=process.get("error") or "", log="\n".join(process.get("log_tail") or []),
        restart_pending=node.engine_restarts_requested > (process.get("restart_seen") or 0))


def node_engine_for_agent(node: Node) -> dict:
    """The heartbeat reply's `engine` for an agent that runs the engine: the configuration the
    platform computes for this machine (when the agent runs the platform's), and how many
    restarts the owner has asked for. `version` names the command: reasons and figures may be
    reworded without the engine being restarted."""
    process = node.engine_process or {}
    config = None
    if process.get("mode") == "platform":
        computed = node_engine(node).config
        if computed is not None:
            config = computed.to_json()
            config["version"] = hashlib.sha256(json.dumps(
                [config["engine"], config["argv"]]).encode()).hexdigest()[:16]
        else:
            config = {"version": None, "runnable": False, "argv": [],
                      "problems": ["The agent names no model to serve."]}
    return {"config": config, "restart": node.engine_restarts_requested}


def provider_enrolment_tokens(user) -> QuerySet[EnrolmentToken]:
    return EnrolmentToken.objects.filter(owner=user).select_related("node")


def balance_is_low(user, active_rentals) -> bool:
    """True when the wallet cannot pay the next ten minutes of the user's active rentals."""
    if not active_rentals:
        return False
    need = sum(pricing.rental_due_micros(r.price_per_hour_micros, services.MIN_PREPAID_S)
               for r in active_rentals)
    return wallet_balance(user.pk) < need


# --- the provider's dashboard ---

def price_hints(gpu_names: list[str], *, provider) -> dict[str, dict]:
    """For each GPU name: what comparable cards ask, the median hourly price of the verified,
    listed cards of that GPU that are not this provider's, and how many there are. One
    query: PostgreSQL computes the median; elsewhere (the demo's SQLite, a handful of cards)
    the prices are read and the median taken here."""
    if not gpu_names:
        return {}
    comparable = (Listing.objects.filter(
        is_listed=True, card__present=True, card__name__in=set(gpu_names),
        card__verification_status=Card.Verification.VERIFIED)
        .exclude(card__node__owner=provider))
    if connection.vendor == "postgresql":
        sql, params = comparable.values("card__name", "price_per_hour_micros").query.sql_with_params()
        with connection.cursor() as cur:
            cur.execute("SELECT card__name, percentile_cont(0.5) WITHIN GROUP (ORDER BY "
                        f"price_per_hour_micros), count(*) FROM ({sql}) AS q(card__name, "
                        "price_per_hour_micros) GROUP BY card__name", params)
            return {name: {"median_micros": int(median), "cards": count}
                    for name, median, count in cur.fetchall()}
    prices: dict[str, list[int]] = {}
    for name, price in comparable.values_list("card__name", "price_per_hour_micros"):
        prices.setdefault(name, []).append(price)
    return {name: {"median_micros": int(statistics.median(values)), "cards": len(values)}
            for name, values in prices.items()}


def card_utilization(cards: list[Card], *, days: int = 30,
                     now: datetime | None = None) -> dict[int, dict]:
    """Per card: the running rental (if any) and the share of the last `days` days it was
    rented, or of its time on the platform if that is shorter. One query."""
    now = now or timezone.now()
    window_start = now - timedelta(days=days)
    stats = {card.pk: {"rental": None, "rented_s": 0.0,
                       "window_s": max((now - max(card.first_seen_at, window_start))
                                       .total_seconds(), 1.0)} for card in cards}
    rentals = (Rental.objects.filter(card_id__in=list(stats))
               .filter(Q(stopped_at__isnull=True) | Q(stopped_at__gt=window_start))
               .only("card_id", "started_at", "stopped_at", "renter_id"))
    for rental in rentals:
        start, end = max(rental.started_at, window_start), rental.stopped_at or now
        stats[rental.card_id]["rented_s"] += max((end - start).total_seconds(), 0)
        if rental.stopped_at is None:
            stats[rental.card_id]["rental"] = rental
    for row in stats.values():
        row["utilization_pct"] = min(100.0, 100 * row["rented_s"] / row["window_s"])
    return stats


# --- what a token costs: renting a card, owning one ---

def platform_prices(engine_models) -> dict[str, costs.PlatformPrice]:
    """What the platform's own API charges now per 1M output tokens for each of these engine
    model ids (the models cards were measured with), as routing maps them to public models;
    no query when none is given."""
    ids = frozenset(m for m in engine_models if m)
    if not ids:
        return {}
    found: dict[str, costs.PlatformPrice] = {}
    for _, answer in signals.platform_prices.send(sender=Card, engine_models=ids):
        found.update(answer or {})
    return found


def verified_gpu_models() -> list[tuple[str, str, int]]:
    """(GPU name, model, cards) for each GPU the fleet has verified serving a model: what the
    public break-even calculator offers, most cards first. One query."""
    return list(_verified_cards().values("name", "verified_model")
                .annotate(n=Count("pk")).order_by("-n", "name", "verified_model")
                .values_list("name", "verified_model", "n"))


def _verified_cards() -> QuerySet[Card]:
    return (Card.objects.filter(present=True, verification_status__in=Card.SERVING_JUDGED,
                                verified_tokens_per_s__isnull=False)
            .exclude(verified_model=""))


@dataclass(frozen=True)
class FleetFigures:
    """The fleet's verified figures for one GPU serving one model, each the median over its
    cards that have it (a card of a machine whose agent reported no power has none)."""

    gpu: str
    model: str
    cards: int
    concurrency: int | None  # the verified concurrency most of them were measured at
    tokens_per_s_single: float | None
    tokens_per_s_loaded: float | None
    power_idle_w: float | None
    power_loaded_w: float | None
    price_per_hour_micros: int | None  # of those listed now
    utilization: float | None  # the share of their time they were rented, last 30 days


_FIGURES = ("verified_single_tokens_per_s", "verified_tokens_per_s", "power_idle_w",
            "power_loaded_w")


def fleet_figures(gpu: str, model: str, *, now: datetime | None = None) -> FleetFigures | None:
    """The medians for the public break-even calculator, None when no verified card of `gpu`
    serves `model`. PostgreSQL computes the medians in one query; elsewhere (the demo's
    SQLite, a handful of cards) the figures are read and the medians taken here. Then one query
    for the rentals behind the utilization."""
    cards = _verified_cards().filter(name=gpu, verified_model=model)
    rows = cards.values(*_FIGURES, "listing__price_per_hour_micros", "listing__is_listed",
                        "verified_concurrency")
    if connection.vendor == "postgresql":
        sql, params = rows.query.sql_with_params()
        medians = ", ".join(f"percentile_cont(0.5) WITHIN GROUP (ORDER BY {column})"
                            for column in ("f0", "f1", "f2", "f3"))
        with connection.cursor() as cur:
            cur.execute(f"SELECT count(*), {medians}, percentile_cont(0.5) WITHIN GROUP "
                        "(ORDER BY price) FILTER (WHERE listed), mode() WITHIN GROUP (ORDER BY "
                        f"concurrency) FROM ({sql}) AS q(f0, f1, f2, f3, price, listed, "
                        "concurrency)", params)
            count, *figures, price, concurrency = cur.fetchone()
    else:
        values = list(rows.values_list(*_FIGURES, "listing__price_per_hour_micros",
                                       "listing__is_listed", "verified_concurrency"))
        count = len(values)
        figures = [_median([row[i] for row in values]) for i in range(len(_FIGURES))]
        price = _median([row[4] for row in values if row[5]])
        seen = [row[6] for row in values if row[6] is not None]
        concurrency = statistics.mode(seen) if seen else None
    if not count:
        return None
    usage = card_utilization(list(cards.only("pk", "first_seen_at")), now=now)
    window = sum(row["window_s"] for row in usage.values())
    # A card is rented no longer than it has been on the platform (as card_utilization caps).
    rented = sum(min(row["rented_s"], row["window_s"]) for row in usage.values())
    return FleetFigures(gpu=gpu, model=model, cards=count, concurrency=concurrency,
                        tokens_per_s_single=figures[0], tokens_per_s_loaded=figures[1],
                        power_idle_w=figures[2], power_loaded_w=figures[3],
                        price_per_hour_micros=None if price is None else round(price),
                        utilization=rented / window if window else None)


def _median(values):
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# --- the account holder's own data (download, closure) ---

def personal_data(user) -> dict:
    """What the marketplace holds about a person: their machines and cards, their listings,
    the rentals they made, and their provider alerts (plain JSON values, money in micros)."""
    def when(value):
        return value.isoformat() if value else None

    return {
        "machines": [
            {"id": node.pk, "name": node.name, "region": node.region,
             "hostname": node.hostname, "status": node.status,
             "created_at": when(node.created_at),
             "cards": [{"number": card.number, "gpu": card.name,
                        "memory_mib": card.memory_total_mib,
                        "verification": card.verification_status,
                        "listed": bool(getattr(card, "listing", None) and card.listing.is_listed),
                        "price_per_hour_micros": getattr(getattr(card, "listing", None),
                                                         "price_per_hour_micros", None)}
                       for card in node.cards.all()]}
            for node in provider_nodes(user)],
        "rentals": [
            {"id": r.pk, "card": r.card_id, "gpu": r.card.name,
             "price_per_hour_micros": r.price_per_hour_micros, "started_at": when(r.started_at),
             "stopped_at": when(r.stopped_at), "billed_seconds": r.billed_seconds,
             "charged_micros": r.charged_micros} for r in rentals_of(user).order_by("started_at")],
        "provider_alerts": [
            {"kind": a.kind, "message": a.message, "created_at": when(a.created_at)}
            for a in ProviderAlert.objects.filter(owner=user).order_by("created_at", "id")],
    }


def closure_problems(user) -> list[str]:
    """Why the marketplace cannot let the account close yet: a rental still running, as its
    renter or on one of the account's cards."""
    problems = []
    if Rental.objects.filter(renter=user, stopped_at__isnull=True).exists():
        problems.append("You are renting a card: stop the rental first.")
    if Rental.objects.filter(card__node__owner=user, stopped_at__isnull=True).exists():
        problems.append("Someone is renting one of your cards: it must end first "
                        "(unlist the card so that nobody rents it again).")
    return problems
