"""Alerts to providers: raised once at the change that causes them, shown on the provider's
pages until read, emailed once through Django's mail backend."""

from datetime import timedelta

import pytest
from django.core import mail

from marketplace import alerts, services
from marketplace.models import Card, Node, ProviderAlert
from tests.factories import CardFactory, NodeFactory
from tests.marketplace.test_agent_api import beat, enroll, report

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def eager_celery():
    """The alert's email task runs where it is enqueued (the demo's way; a real worker is
    what production has, tested for the schedule in test_schedule.py)."""
    from config.celery import app

    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


def test_a_machine_going_offline_and_back_alerts_its_provider_once_each(
        api, bob, django_capture_on_commit_callbacks):
    enrolled = enroll(api, bob, hostname="rig-7")
    beat(api, enrolled["credential"], report())  # its first report raises nothing
    node = Node.objects.get(pk=enrolled["node_id"])
    assert not ProviderAlert.objects.exists()
    with django_capture_on_commit_callbacks(execute=True):
        services.nodes_mark_offline(now=node.last_heartbeat_at + timedelta(seconds=31))
        services.nodes_mark_offline(now=node.last_heartbeat_at + timedelta(seconds=61))
    [offline] = ProviderAlert.objects.all()
    assert (offline.owner, offline.node, offline.kind) == (bob, node, "node_offline")
    assert len(mail.outbox) == 1 and mail.outbox[0].to == [bob.email]
    assert "offline" in mail.outbox[0].subject and node.name in mail.outbox[0].body
    with django_capture_on_commit_callbacks(execute=True):
        beat(api, enrolled["credential"], report())
        beat(api, enrolled["credential"], report())
    assert list(ProviderAlert.objects.order_by("pk").values_list("kind", flat=True)) == [
        "node_offline", "node_back"]
    assert len(mail.outbox) == 2


def test_a_card_newly_flagged_alerts_its_provider_and_a_repeat_verdict_does_not(
        bob, django_capture_on_commit_callbacks):
    card = CardFactory(node=NodeFactory(owner=bob, name="box"))
    publish = dict(card_id=card.pk, tokens_per_s=None, reference_spec="")
    with django_capture_on_commit_callbacks(execute=True):
        services.card_verification_publish(status="verified", **publish)
        services.card_verification_publish(status="flagged", problems=2, **publish)
        services.card_verification_publish(status="flagged", problems=2, **publish)
    [flagged] = ProviderAlert.objects.all()
    assert (flagged.kind, flagged.card_id) == ("card_flagged", card.pk)
    assert f"{card.name} #{card.number} on box" in flagged.message
    assert Card.objects.get(pk=card.pk).verification_problems == 2
    assert len(mail.outbox) == 1


def test_an_alert_is_emailed_once_and_a_failed_send_is_tried_again(bob, settings):
    node = NodeFactory(owner=bob)
    alert = ProviderAlert.objects.create(owner=bob, node=node, kind="node_offline",
                                         message="m")
    settings.EMAIL_BACKEND = "tests.marketplace.test_alerts.FailingBackend"
    with pytest.raises(OSError):
        alerts.alert_email_send(alert.pk)
    alert.refresh_from_db()
    assert alert.emailed_at is None  # the claim is given back for the retry
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    assert alerts.alert_email_send(alert.pk) is True
    assert alerts.alert_email_send(alert.pk) is False  # a second delivery of the task
    assert len(mail.outbox) == 1


class FailingBackend:
    def __init__(self, *args, **kwargs):
        pass

    def send_messages(self, messages):
        raise OSError("SMTP server away")


def test_alerts_are_shown_to_their_owner_only_and_marked_read(client, bob, mallory):
    node = NodeFactory(owner=bob, name="rig-9")
    alerts.nodes_offline(node_ids=[node.pk])
    client.force_login(bob)
    dashboard = client.get("/provider/").content.decode()
    assert "New alerts" in dashboard and "rig-9 stopped reporting" in dashboard
    assert "rig-9 stopped reporting" in client.get("/provider/alerts/").content.decode()
    client.force_login(mallory)
    assert "rig-9" not in client.get("/provider/alerts/").content.decode()
    client.post("/provider/alerts/")  # mallory marks her own, not bob's
    assert ProviderAlert.objects.get().read_at is None
    client.force_login(bob)
    assert client.post("/provider/alerts/", {"back": "dashboard"})["Location"] == "/provider/"
    assert ProviderAlert.objects.get().read_at is not None
    assert "New alerts" not in client.get("/provider/").content.decode()
