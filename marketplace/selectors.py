"""Reads shared by pages and the REST API."""

import json
import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from billing import pricing
from billing.selectors import wallet_balance
from config.redis import REDIS_ERRORS
from marketplace import keyset, services, uptime
from marketplace.filters import SORTS
from marketplace.models import (
    Card,
    EnrolmentToken,
    Listing,
    Node,
    NodeUptimeHour,
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
