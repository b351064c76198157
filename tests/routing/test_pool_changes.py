"""The incremental snapshot: after any change a router's pool depends on, a refresh that reads
only what the change feed names holds exactly what a full read holds; a refresh with nothing
changed reads nothing. (Each change is its own transaction, as in production: the feed skips
the transactions it has applied, so one test transaction around them all would hide them.)"""

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from billing.models import ModelPrice
from marketplace.models import Card, Node, Rental
from routing import balancer, changes, pool, tasks
from routing.models import Deployment, EngineModel
from tests.factories import RentalFactory
from tests.routing.conftest import MODEL
from verification.models import VerifiedCapacity

pytestmark = pytest.mark.django_db(transaction=True)


def content(snap: pool.Snapshot) -> dict:
    return {name: list(fleet) for name, fleet in snap.workers.items()}


def same_as_full(previous: pool.Snapshot, now=None) -> pool.Snapshot:
    incremental = pool.refreshed(previous, now=now)
    full = pool.build(now=now)
    assert content(incremental) == content(full)
    assert incremental.models == full.models and incremental.version == full.version
    for name, fleet in incremental.workers.items():  # the arrays agree with the rows
        for column in ("id", "node", "capacity", "ramp", "context", "renter", "queue"):
            assert (fleet.cols[column] == full.workers[name].cols[column]).all(), column
    return incremental


def test_every_kind_of_change_reaches_the_snapshot_as_a_full_read_would(deploy, alice, model):
    a, b, c = deploy("http://a"), deploy("http://b", "2x-rtx-4090"), deploy("http://c")
    snap = pool.refreshed(None)
    steps = [
        lambda: Node.objects.filter(pk=a.node_id).update(status=Node.Status.OFFLINE),
        lambda: Node.objects.filter(pk=a.node_id).update(status=Node.Status.ONLINE,
                                                         status_changed_at=timezone.now()),
        lambda: Card.objects.filter(node_id=b.node_id).update(
            verification_status=Card.Verification.FLAGGED),
        lambda: Card.objects.filter(node_id=b.node_id).update(
            verification_status=Card.Verification.VERIFIED),
        lambda: RentalFactory(card=Card.objects.filter(node_id=c.node_id).first(),
                              renter=alice),
        lambda: Rental.objects.filter(card__node_id=c.node_id).update(
            stopped_at=timezone.now()),
        lambda: VerifiedCapacity.objects.filter(card__node_id=b.node_id).update(
            routing_tps=300.0),
        lambda: Deployment.objects.filter(pk=c.pk).update(max_context=8192),
        lambda: Deployment.objects.filter(pk=c.pk).update(engine_running=7, engine_waiting=2),
        lambda: Deployment.objects.filter(pk=a.pk).update(healthy=False),
        lambda: Deployment.objects.filter(pk=a.pk).update(healthy=True),
        lambda: Node.objects.filter(pk=b.node_id).update(needs_review=True),
        lambda: Node.objects.filter(pk=b.node_id).update(needs_review=False,
                                                         engine_connect_url="http://b2"),
        lambda: Node.objects.filter(pk=c.node_id).update(credential_revoked_at=timezone.now()),
        lambda: Card.objects.filter(node_id=a.node_id).update(present=False),
        lambda: deploy("http://d", "2x-rtx-4090"),
        lambda: Deployment.objects.filter(pk=b.pk).delete(),
        lambda: ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=1,
                                          output_micros_per_mtok=2,
                                          effective_at=timezone.now() + timedelta(days=1)),
        lambda: EngineModel.objects.create(engine_model_id="other/engine-id", model=model),
        lambda: deploy("http://e", engine_model="other/engine-id"),
    ]
    for step in steps:
        step()
        snap = same_as_full(snap)
    assert snap.size >= 2


def test_the_ramp_moves_on_with_time_alone(deploy):
    old = deploy("http://a", capacity=1000.0)
    deploy("http://b", capacity=1000.0)  # in traffic from now
    hour_ago = timezone.now() - timedelta(hours=1)
    Deployment.objects.filter(pk=old.pk).update(first_seen_at=hour_ago)
    Node.objects.filter(pk=old.node_id).update(status_changed_at=hour_ago)
    VerifiedCapacity.objects.filter(card__node_id=old.node_id).update(routed_since=hour_ago)
    snap = pool.refreshed(None)
    assert {w.ramp for w in snap.workers[MODEL]} == {1.0, 1 / balancer.RAMP_STEPS}
    later = timezone.now() + timedelta(seconds=balancer.RAMP_STEP_S * 1.5)
    snap = same_as_full(snap, now=later)
    assert {w.ramp for w in snap.workers[MODEL]} == {1.0, 2 / balancer.RAMP_STEPS}


def test_a_refresh_with_nothing_changed_reads_no_rows(deploy, django_assert_max_num_queries):
    deploy("http://a")
    snap = pool.refreshed(None)
    found = changes.read(snap.feed)
    assert not found.nodes and not found.queues and not found.models
    with django_assert_max_num_queries(1):  # the feed; Redis gives the load
        again = pool.refreshed(snap)
    assert again.version == snap.version and content(again) == content(snap)


def test_a_long_transaction_elsewhere_does_not_make_a_refresh_read_again(
        deploy, django_assert_max_num_queries):
    """A transaction left open on another connection (a report, a console session: any
    database of the cluster) holds the horizon back below the changes a full read has just
    read; the next refresh still reads none of them again."""
    import psycopg

    settings = connection.settings_dict
    with psycopg.connect(host=settings["HOST"], port=settings["PORT"] or 5432,
                         user=settings["USER"], dbname=settings["NAME"]) as other:
        other.execute("SELECT pg_current_xact_id()")  # holds an xid, in a transaction
        a = deploy("http://a")
        deploy("http://b", "2x-rtx-4090")
        snap = pool.refreshed(None)
        assert snap.feed.xmin <= int(other.execute("SELECT pg_current_xact_id()::text")
                                     .fetchone()[0])
        found = changes.read(snap.feed)
        assert not found.nodes and not found.queues and not found.models
        with django_assert_max_num_queries(1):
            again = pool.refreshed(snap)
        assert again.version == snap.version
        Node.objects.filter(pk=a.node_id).update(status=Node.Status.OFFLINE)
        assert same_as_full(again).version != snap.version  # a change still reaches it
        other.rollback()


def test_a_process_that_read_long_ago_reads_everything_again(deploy, monkeypatch):
    deploy("http://a")
    snap = pool.refreshed(None)
    monkeypatch.setattr(changes, "read", lambda since: pytest.fail("the feed may be trimmed"))
    old = pool.Snapshot(**{**snap.__dict__, "built_at": snap.built_at - changes.KEEP_S})
    assert content(pool.refreshed(old)) == content(snap)


def test_the_feed_is_trimmed(deploy):
    deploy("http://a")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE routing_poolchange SET at = now() - interval '1 hour'")
    assert tasks.pool_changes_trim.apply().get() > 0  # beat runs it every minute
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM routing_poolchange WHERE at < now() - "
                       "interval '11 minutes'")
        assert cursor.fetchone()[0] == 0
