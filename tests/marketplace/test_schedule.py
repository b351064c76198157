"""The periodic tasks: eagerly through the in-process scheduler, and through a real Celery
worker consuming from Redis."""

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone

from config.celery import app
from config.schedule import next_tick
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



class Recorder:
    """A stand-in task: records when each run starts and how many run at once."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.starts: list[float] = []
        self.running = self.most_at_once = 0
        self.lock = threading.Lock()

    def apply(self):
        with self.lock:
            self.starts.append(time.monotonic())
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1


def test_a_slow_task_does_not_hold_up_the_others(monkeypatch):
    """A verification load test takes minutes; meanwhile silent nodes must still go offline
    and rentals still be charged on time."""
    slow, fast = Recorder(1.2), Recorder(0.0)
    monkeypatch.setitem(app.tasks, "tests.slow", slow)
    monkeypatch.setitem(app.tasks, "tests.fast", fast)
    monkeypatch.setitem(app.conf, "beat_schedule", {
        "slow": {"task": "tests.slow", "schedule": 0.2},
        "fast": {"task": "tests.fast", "schedule": 0.2}})
    started = time.monotonic()
    call_command("run_schedule", "--for", "2")
    assert time.monotonic() - started < 4  # the slow run in hand gets a few seconds, no more
    # Every 0.2 s whatever the slow one does: runs at 0, 0.2, ... 1.8 s.
    assert len(fast.starts) >= 9
    assert max(b - a for a, b in itertools.pairwise(fast.starts)) < 0.5
    # The slow one never twice at once; the ticks it overran are skipped, not queued up.
    assert slow.most_at_once == 1
    assert len(slow.starts) == 2
    assert 1.2 <= slow.starts[1] - slow.starts[0] < 1.5


def test_next_tick_keeps_the_cadence_and_skips_overrun_ticks():
    assert next_tick(100.0, 5.0, 100.01) == 105.0
    assert next_tick(100.0, 5.0, 104.99) == 105.0
    assert next_tick(100.0, 5.0, 105.0) == 110.0
    assert next_tick(100.0, 5.0, 117.3) == 120.0  # 105, 110 and 115 were overrun: skipped
