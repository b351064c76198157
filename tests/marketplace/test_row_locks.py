"""A heartbeat locks its node's row, then writes its cards; verification publishes a verdict
on a card, then commits rows that refer to the node (PostgreSQL checks their foreign keys at
commit, with FOR KEY SHARE on the node's row). Both at once on one node must both go through,
on the real PostgreSQL: the node's lock must not block a key check (a deadlock otherwise), and
the heartbeat, which read the card before the verdict was committed, must not write back its
stale copy of the card (the verdict lost: a verified card read "unverified")."""

import threading
import time

import pytest
from django.db import connection, transaction

from marketplace import services
from marketplace.models import Card
from tests.verification.test_pipeline import enrolled_node, h200_report
from verification.models import ProbeJob, VerificationRun

pytestmark = pytest.mark.django_db(transaction=True)


def waiting_on_a_lock() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'")
        return cursor.fetchone()[0]


def test_a_heartbeat_and_a_verdict_on_one_node_at_once_both_go_through(bob):
    node = enrolled_node(bob, h200_report())
    card = Card.objects.get(node=node)
    run = VerificationRun.objects.create(node=node, trigger="enrolment")
    card_locked, heartbeat_waits = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def verdict():
        try:
            with transaction.atomic():
                services.card_verification_publish(card_id=card.pk, status="verified",
                                                   tokens_per_s=100.0, reference_spec="H200")
                ProbeJob.objects.create(run=run, node=node)  # refers to the node
                card_locked.set()
                heartbeat_waits.wait(10)
        except BaseException as exc:
            failures.append(exc)
        finally:
            connection.close()

    moved = h200_report()  # the GPU's link moved: the heartbeat writes the card
    moved["gpus"][0]["pcie_gen_current"] = 1

    def heartbeat():
        try:
            card_locked.wait(10)
            services.node_heartbeat_record(node_id=node.pk, report=moved)
        except BaseException as exc:
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=verdict), threading.Thread(target=heartbeat)]
    for thread in threads:
        thread.start()
    card_locked.wait(10)
    deadline = time.monotonic() + 10
    while not waiting_on_a_lock() and time.monotonic() < deadline:
        time.sleep(0.02)  # the heartbeat holds the node and waits for the card
    assert waiting_on_a_lock(), "the heartbeat never waited for the card"
    heartbeat_waits.set()
    for thread in threads:
        thread.join(20)
    assert failures == []
    assert Card.objects.get(pk=card.pk).verification_status == "verified"
    assert ProbeJob.objects.filter(run=run).exists()
