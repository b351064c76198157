"""The periodic tasks: eagerly through the in-process scheduler, and through a real Celery
worker consuming from Redis."""

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone

from config.celery import app
from marketplace.models import Node, Rental
from tests.factories import NodeFactory, RentalFactory, listed_card


@pytest.mark.django_db
def test_run_schedule_once_runs_every_beat_entry():
    stale = NodeFactory(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    rental = RentalFactory(card=listed_card(), ends_at=timezone.now() - timedelta(minutes=1))
    call_command("run_schedule", "--once")
    stale.refresh_from_db()
    rental.refresh_from_db()
    assert stale.status == Node.Status.OFFLINE
    assert rental.stop_reason == Rental.StopReason.EXPIRED


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_real_celery_worker_marks_silent_nodes_offline():
    stale = NodeFactory(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    env = dict(os.environ, DATABASE_URL=_test_database_url())
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "--pool=solo",
         "--concurrency=1", "--without-gossip", "--without-mingle", "-Q", "celery",
         "--loglevel=WARNING"], env=env, start_new_session=True)
    try:
        result = app.send_task("marketplace.tasks.nodes_mark_offline")
        assert result.get(timeout=60) == 1
        stale.refresh_from_db()
        assert stale.status == Node.Status.OFFLINE
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)


def _test_database_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"

