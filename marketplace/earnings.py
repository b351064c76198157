"""What a provider earned, by card and by day: rental time and tokens served.

Reads the ledger (billing) and the rentals (marketplace) together, which is why it lives here,
above both in the dependency order.
"""

from datetime import date, datetime, timedelta

from django.db.models import Count, F, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing import ledger
from billing.models import Account, Charge, Entry, Transfer
from marketplace.models import Card, Rental


def _card_id(reference: str) -> int | None:
    kind, _, value = reference.partition(":")
    return int(value) if kind == "card" and value.isdigit() else None


def provider_earnings(provider, *, days: int = 30, now: datetime | None = None) -> dict:
    """Earnings per card and per day over the last `days` days, plus tokens served and rental
    hours; five aggregate queries whatever the history's length."""
    now = now or timezone.now()
    since = (now - timedelta(days=days - 1)).replace(hour=0, minute=0, second=0, microsecond=0)
    account = ledger.account_id(Account.Kind.EARNINGS, provider.pk)
    # Rental time from the ledger (its transfers name the card); tokens from the charges.
    rented = (Entry.objects.filter(account_id=account, amount_micros__gt=0,
                                   transfer__kind=Transfer.Kind.RENTAL,
                                   transfer__created_at__gte=since)
              .annotate(day=TruncDate("transfer__created_at"), ref=F("transfer__reference"))
              .values("day", "ref").annotate(micros=Sum("amount_micros")))
    served = (Charge.objects.filter(provider=provider, created_at__gte=since)
              .annotate(day=TruncDate("created_at"))
              .values("day", "worker", "model")
              .annotate(requests=Count("pk"), prompt=Sum("prompt_tokens"),
                        completion=Sum("completion_tokens"), micros=Sum("provider_micros")))
    hours = dict(Rental.objects.filter(card__node__owner=provider)
                 .values("card_id").annotate(s=Sum("billed_seconds")).values_list("card_id", "s"))
    cards = {c.pk: c for c in Card.objects.filter(node__owner=provider).select_related("node")}

    by_card: dict[int | None, dict] = {}
    by_day: dict[date, dict] = {}

    def row(table, key, **init):
        return table.setdefault(key, {"rental_micros": 0, "token_micros": 0, "requests": 0,
                                      "tokens": 0, **init})

    for e in rented:
        card_id = _card_id(e["ref"])
        row(by_card, card_id, card=cards.get(card_id))["rental_micros"] += e["micros"]
        row(by_day, e["day"], day=e["day"])["rental_micros"] += e["micros"]
    usage = []
    for s in served:
        tokens = (s["prompt"] or 0) + (s["completion"] or 0)
        card_id = _card_id(s["worker"])
        for r in (row(by_card, card_id, card=cards.get(card_id)), row(by_day, s["day"],
                                                                       day=s["day"])):
            r["requests"] += s["requests"]
            r["tokens"] += tokens
            r["token_micros"] += s["micros"] or 0
        usage.append(dict(s, card=cards.get(card_id)))
    for card_id, seconds in hours.items():
        row(by_card, card_id, card=cards.get(card_id))["rental_hours"] = (seconds or 0) / 3600
    for table in (by_card, by_day):
        for r in table.values():
            r["total_micros"] = r["rental_micros"] + r["token_micros"]
    return {
        "since": since.date(),
        "unpaid_micros": ledger.balance(Account.Kind.EARNINGS, provider.pk),
        "by_card": sorted(by_card.values(), key=lambda r: -r["total_micros"]),
        "by_day": [by_day[d] for d in sorted(by_day, reverse=True)],
        "usage": sorted(usage, key=lambda u: (u["day"], u["worker"], u["model"]), reverse=True),
        "total_micros": sum(r["total_micros"] for r in by_card.values()),
    }
