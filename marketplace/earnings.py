"""What a provider earned, by machine and by day: rental time and tokens served.

Reads the ledger (billing) and the rentals (marketplace) together, which is why it lives here,
above both in the dependency order.
"""

from datetime import date, datetime, timedelta

from django.db.models import Count, F, Prefetch, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing import ledger
from billing.models import Account, Charge, Entry, Transfer
from marketplace.models import Card, Node, Rental, ref_id


def provider_earnings(provider, *, days: int = 30, now: datetime | None = None) -> dict:
    """Earnings per machine and per day over the last `days` days, plus tokens served and
    rental hours; five aggregate queries whatever the history's length.

    Per machine, not per card: a rental pays for one card, but a served request is answered
    by the machine's engine, which may span all its cards (tensor parallel)."""
    now = now or timezone.now()
    since = (now - timedelta(days=days - 1)).replace(hour=0, minute=0, second=0, microsecond=0)
    account = ledger.account_id(Account.Kind.EARNINGS, provider.pk)
    # Rental time from the ledger (its transfers name the card); tokens from the charges
    # (they name the machine).
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
    nodes = {n.pk: n for n in Node.objects.filter(owner=provider).prefetch_related(
        Prefetch("cards", queryset=Card.objects.order_by("index")))}
    node_of_card = {c.pk: n.pk for n in nodes.values() for c in n.cards.all()}

    by_node: dict[int | None, dict] = {}
    by_day: dict[date, dict] = {}

    def row(table, key, **init):
        return table.setdefault(key, {"rental_micros": 0, "token_micros": 0, "requests": 0,
                                      "tokens": 0, "rental_hours": 0.0, **init})

    def machine(node_id):
        return row(by_node, node_id, node=nodes.get(node_id))

    for e in rented:
        machine(node_of_card.get(ref_id(e["ref"], "card")))["rental_micros"] += e["micros"]
        row(by_day, e["day"], day=e["day"])["rental_micros"] += e["micros"]
    usage = []
    for s in served:
        tokens = (s["prompt"] or 0) + (s["completion"] or 0)
        node_id = ref_id(s["worker"], "node")
        for r in (machine(node_id), row(by_day, s["day"], day=s["day"])):
            r["requests"] += s["requests"]
            r["tokens"] += tokens
            r["token_micros"] += s["micros"] or 0
        usage.append(dict(s, node=nodes.get(node_id)))
    for card_id, seconds in hours.items():
        machine(node_of_card.get(card_id))["rental_hours"] += (seconds or 0) / 3600
    for table in (by_node, by_day):
        for r in table.values():
            r["total_micros"] = r["rental_micros"] + r["token_micros"]
    return {
        "since": since.date(),
        "unpaid_micros": ledger.balance(Account.Kind.EARNINGS, provider.pk),
        "by_machine": sorted(by_node.values(), key=lambda r: -r["total_micros"]),
        "by_day": [by_day[d] for d in sorted(by_day, reverse=True)],
        "usage": sorted(usage, key=lambda u: (u["day"], u["worker"], u["model"]), reverse=True),
        "total_micros": sum(r["total_micros"] for r in by_node.values()),
    }
