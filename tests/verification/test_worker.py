"""The verification chain on a real Celery worker process, through Redis."""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from fleetsim.profiles import get_profile
from fleetsim.server import EngineServer, ServerThread
from tests.verification.test_pipeline import enrolled_node, h200_probe, h200_report
from verification import services, tasks
from verification.models import Measurement, VerificationRun

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _database_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def _worker():
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "--pool=solo",
         "--without-gossip", "--without-mingle", "--loglevel=WARNING"],
        env=dict(os.environ, DATABASE_URL=_database_url(), RIGSHARE_LOAD_TEST_LEVELS="1,8"),
        start_new_session=True)


def _stop(worker, sig=signal.SIGTERM):
    os.killpg(worker.pid, sig)
    worker.wait(30)


def _wait_for(predicate, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


def test_the_chain_runs_on_a_real_worker(bob):
    with ServerThread(EngineServer(get_profile("h200"), time_scale=10)) as engine:
        node = enrolled_node(bob, h200_report(engine_url=engine.url, reachable=True))
        run = services.run_start(node_id=node.pk, trigger="enrolment")
        job = services.jobs_for_node(node.pk)[0]
        services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                                   result=h200_probe())
        worker = _worker()
        try:
            tasks.verification_advance.delay()
            assert _wait_for(lambda: VerificationRun.objects.get(pk=run.pk).status == "done")
        finally:
            _stop(worker)
    assert Measurement.objects.filter(run=run, metric="tps@8").exists()
    assert node.cards.get().verification_status == "verified"


def test_a_worker_killed_mid_load_test_leaves_no_stuck_run_and_no_duplicates(bob):
    with ServerThread(EngineServer(get_profile("2x-rtx-4090"), time_scale=1)) as engine:
        node = enrolled_node(bob, h200_report(engine_url=engine.url, reachable=True))
        run = services.run_start(node_id=node.pk, trigger="enrolment")
        job = services.jobs_for_node(node.pk)[0]
        services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                                   result=h200_probe())
        worker = _worker()
        try:
            tasks.verification_advance.delay()
            assert _wait_for(lambda: VerificationRun.objects.get(pk=run.pk).status
                             == "load_testing")
        finally:
            _stop(worker, signal.SIGKILL)  # mid-step, no chance to clean up
    before = Measurement.objects.filter(run=run).count()
    # Twenty minutes on, the sweep finds it stale: timed out, and a fresh run takes its place.
    restarted = services.runs_time_out_stale(now=timezone.now() + timedelta(minutes=21))
    run.refresh_from_db()
    assert run.status == "timed_out" and len(restarted) == 1
    assert VerificationRun.objects.get(pk=restarted[0]).status == "probing"
    assert Measurement.objects.filter(run=run).count() == before
