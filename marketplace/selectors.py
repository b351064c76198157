"""Reads shared by pages and the REST API."""

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from billing import pricing
from billing.selectors import wallet_balance
from marketplace import services, uptime
from marketplace.models import (
    Card,
    EnrolmentToken,
    Node,
    NodeUptimeHour,
    Rental,
    UuidConflict,
)


def _active_rental():
    return Rental.objects.filter(card=OuterRef("pk"), stopped_at__isnull=True)


def cards_for_catalog(filters: dict) -> QuerySet[Card]:
    """Listed, present cards of online nodes that nobody rents now, filtered and sorted.

    One query whatever the number of listings: node, listing and the node's card count are
    joined or annotated, never fetched per row.
    """
    cards_per_node = (Card.objects.filter(node=OuterRef("node"), present=True)
                      .order_by().values("node").annotate(n=Count("pk")).values("n"))
    qs = (Card.objects
          .filter(present=True, listing__is_listed=True, node__status=Node.Status.ONLINE,
                  node__credential_revoked_at__isnull=True, node__needs_review=False,
                  node__uuid_conflict=False)
          .exclude(Exists(_active_rental()))
          .select_related("node", "listing")
          .annotate(cards_per_node=Subquery(cards_per_node)))
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
    return qs.order_by(*filters.get("sort", ("listing__price_per_hour_micros", "id")))


def catalog_choices() -> dict[str, list[str]]:
    """GPU models and regions on offer, for the filter drop-downs (two queries)."""
    offered = Card.objects.filter(present=True, listing__is_listed=True)
    return {
        "gpus": list(offered.order_by("name").values_list("name", flat=True).distinct()),
        "regions": list(offered.exclude(node__region="").order_by("node__region")
                        .values_list("node__region", flat=True).distinct()),
    }


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
