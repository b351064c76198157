"""Alerts to providers: a machine went offline or came back, verification flagged a card.
Each is raised once, at the change that causes it (the offline sweep, a verdict), shown on the
provider's pages until read, and emailed once through Django's mail backend after the change
commits; a failed send is retried by its task and never undoes the change."""

from datetime import datetime

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from marketplace.models import Card, Node, ProviderAlert

Kind = ProviderAlert.Kind


def alert_raise(*, kind: str, node: Node, card: Card | None = None, message: str,
                now: datetime | None = None) -> ProviderAlert:
    alert = ProviderAlert.objects.create(owner_id=node.owner_id, kind=kind, node=node,
                                         card=card, message=message,
                                         created_at=now or timezone.now())
    from marketplace import tasks

    transaction.on_commit(lambda: tasks.alert_email.delay(alert.pk))
    return alert


def nodes_offline(*, node_ids: list[int], now: datetime | None = None) -> None:
    for node in Node.objects.filter(pk__in=node_ids):
        alert_raise(kind=Kind.NODE_OFFLINE, node=node, now=now, message=(
            f"{node.name} stopped reporting: it is offline, out of the catalog and of "
            "inference traffic, and a running rental is not charged while it is away."))


def node_back(*, node: Node, now: datetime | None = None) -> None:
    alert_raise(kind=Kind.NODE_BACK, node=node, now=now,
                message=f"{node.name} is reporting again and back online.")


def card_flagged(*, card: Card, now: datetime | None = None) -> None:
    alert_raise(kind=Kind.CARD_FLAGGED, node=card.node, card=card, now=now, message=(
        f"Verification flagged {card.name} #{card.number} on {card.node.name}: it measured "
        "below what it claims. Renters are warned before they rent it; its findings are on "
        "its rent page."))


def served_slow(*, node, model: str, served_tps: float, verified_tps: float, level: int,
                streams: int, now: datetime | None = None) -> None:
    alert_raise(kind=Kind.SERVED_SLOW, node=node, now=now, message=(
        f"{node.name} served {model} at {served_tps:.1f} tokens/s per stream over {streams} "
        f"requests, {100 * served_tps / verified_tps:.0f}% of the {verified_tps:.1f} it was "
        f"verified at ({level} concurrent). It gets less traffic until a verification run, "
        "started now, measures it again."))


def alerts_mark_read(*, owner, now: datetime | None = None) -> int:
    return ProviderAlert.objects.filter(owner=owner, read_at__isnull=True).update(
        read_at=now or timezone.now())


def alert_email_send(alert_id: int, *, now: datetime | None = None) -> bool:
    """Email the alert to its owner, once; False when it was sent already. The alert is
    claimed first (compare-and-set), so two workers never both send it; a send that fails
    gives the claim back, for the task's retry."""
    if not ProviderAlert.objects.filter(pk=alert_id, emailed_at__isnull=True).update(
            emailed_at=now or timezone.now()):
        return False
    alert = ProviderAlert.objects.select_related("owner").get(pk=alert_id)
    site = settings.RIGSHARE_PUBLIC_URL or "http://127.0.0.1:8000"
    try:
        send_mail(f"Rigshare: {alert.get_kind_display()}",
                  f"{alert.message}\n\nYour machines: {site}{reverse('marketplace:provider')}\n",
                  None, [alert.owner.email])
    except Exception:
        ProviderAlert.objects.filter(pk=alert_id).update(emailed_at=None)
        raise
    return True
