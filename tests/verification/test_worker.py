"""The verification chain on a real Celery worker process, through Redis."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from django.conf import settings

from fleetsim.profiles import get_profile
from fleetsim.server import EngineServer, ServerThread
from tests.verification.conftest import SwitchingEngine, YardstickAgent
from tests.verification.test_pipeline import enrolled_node, h200_probe, h200_report
from verification import services, tasks
from verification.models import Finding, Measurement, VerificationRun

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _database_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def _worker():
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "--pool=solo",
         "--without-gossip", "--without-mingle", "--loglevel=WARNING"],
        env=dict(os.environ, DATABASE_URL=_database_url(), RIGSHARE_LOAD_TEST_LEVELS="1,8",
                 RIGSHARE_LOAD_TEST_REMEASURE_AFTER_S="5"),
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


def test_the_chain_runs_on_a_real_worker(bob, settings, gpu_specs):
    """The load test, the yardstick's switch and back, evaluation and publication: the
    worker's process waits for the agent's heartbeats as they reach the database."""
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 8)
    engine = SwitchingEngine(get_profile("h200"), time_scale=10)
    with ServerThread(engine) as server:
        report = h200_report(engine_url=server.url, reachable=True)
        report["engine"]["supervisor"] = {"state": "ready", "mode": "command",
                                          "argv": ["engine"]}
        node = enrolled_node(bob, report)
        run = services.run_start(node_id=node.pk, trigger="enrolment")
        job = services.jobs_for_node(node.pk)[0]
        services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                                   result=h200_probe())
        agent = YardstickAgent(node.pk, engine, report)
        agent.start()
        worker = _worker()
        try:
            def done():  # the advance queues the chain, and again for a reading taken again
                if services.runs_ready_for_load_test() == [run.pk]:
                    tasks.verification_advance.delay()
                return VerificationRun.objects.get(pk=run.pk).status == "done"

            tasks.verification_advance.delay()
            assert _wait_for(done, timeout=180)
        finally:
            _stop(worker)
            agent.stop.set()
            agent.join()
    assert agent.failure is None and agent.served_yardstick
    assert Measurement.objects.filter(run=run, metric="tps@8").exists()
    assert Measurement.objects.filter(run=run, metric="ytps@8").exists()
    assert node.cards.get().verification_status == "verified"


def _worker_with_beat(schedule_dir, *extra):
    """A worker that also runs the beat schedule (advance every 5 s, the sweep every 15 s)."""
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-B",
         "--schedule", str(schedule_dir / "beat-schedule"), "--without-gossip",
         "--without-mingle", "--loglevel=WARNING", *extra],
        # No agent heartbeats here: the beat must not mark the node offline meanwhile (an
        # offline node is not load-tested).
        # A reading taken again (serving read short on a crowded machine) is taken within
        # seconds, not the minute or more production waits.
        env=dict(os.environ, DATABASE_URL=_database_url(), RIGSHARE_LOAD_TEST_LEVELS="1,8",
                 RIGSHARE_OFFLINE_AFTER_MISSED="1000", RIGSHARE_LOAD_TEST_REMEASURE_AFTER_S="5"),
        start_new_session=True)


def _answered_run(bob, engine):
    node = enrolled_node(bob, h200_report(engine_url=engine.url, reachable=True))
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                               result=h200_probe())
    return run


# Levels 1 and 8, and 128: an H200 is measured where its published figure is.
EXPECTED_METRICS = {f"{name}@{level}" for name in ("tps", "ttft_p50", "ttft_p99")
                    for level in (1, 8, 128)} | {"prefix_speedup", "context_accepted",
                                                 "spec_tokens_per_pass"}


def test_a_worker_killed_mid_load_test_is_taken_up_again_within_two_minutes(bob, tmp_path):
    with ServerThread(EngineServer(get_profile("2x-rtx-4090"), time_scale=1)) as engine:
        run = _answered_run(bob, engine)
        worker = _worker_with_beat(tmp_path, "--pool=solo")
        try:
            assert _wait_for(lambda: VerificationRun.objects.get(pk=run.pk).status
                             == "load_testing", timeout=60)
        finally:
            _stop(worker, signal.SIGKILL)  # mid-step, no chance to clean up or ack
        killed = time.monotonic()
        # Its message stays unacked for the broker's visibility timeout (an hour): the sweep,
        # seeing no progress stamp, queues the step again on the next worker.
        worker = _worker_with_beat(tmp_path, "--pool=solo")
        try:
            assert _wait_for(lambda: VerificationRun.objects.get(pk=run.pk).resumed == 1,
                             timeout=120)
            taken_up = time.monotonic() - killed
            assert _wait_for(lambda: VerificationRun.objects.get(pk=run.pk).status == "done",
                             timeout=180)
        finally:
            _stop(worker)
    assert taken_up < 120
    run.refresh_from_db()
    assert run.resumed == 1 and "taken up again" not in run.step_detail
    metrics = list(Measurement.objects.filter(run=run, card__isnull=True)
                   .values_list("metric", flat=True))
    assert sorted(metrics) == sorted(EXPECTED_METRICS)  # each once, none from the lost try
    assert Finding.objects.filter(run=run, metric="serving").count() == 1


def test_a_second_chain_for_a_run_in_progress_waits_and_never_evaluates_early(bob, tmp_path):
    """Two chains for one run (the advance queued it twice while workers were busy): the second
    finds the load test taken and must not evaluate the run before its measurements exist."""
    with ServerThread(EngineServer(get_profile("2x-rtx-4090"), time_scale=2)) as engine:
        run = _answered_run(bob, engine)
        worker = _worker_with_beat(tmp_path, "--pool=threads", "--concurrency=3")
        try:
            tasks.pipeline(run.pk).apply_async()
            tasks.pipeline(run.pk).apply_async()
            assert _wait_for(lambda: VerificationRun.objects.get(pk=run.pk).status == "done",
                             timeout=120)
        finally:
            _stop(worker)
    run.refresh_from_db()
    assert run.resumed == 0
    serving = Finding.objects.get(run=run, metric="serving")
    assert serving.measured  # judged after the load test, not before it
    assert Measurement.objects.filter(run=run, metric="tps@8").count() == 1


def test_one_worker_runs_a_burst_of_load_tests_at_once_and_takes_none_for_dead(bob, tmp_path):
    """Machines that join together: their load tests wait on the network, so one worker process
    runs them at once (threads), and each run's evaluation, queued behind the others' load
    tests, is never taken for a step whose worker died."""
    machines = 4
    with contextlib.ExitStack() as stack:
        runs = []
        for i in range(machines):
            engine = stack.enter_context(ServerThread(EngineServer(
                get_profile("2x-rtx-4090"), time_scale=1)))
            node = enrolled_node(bob, h200_report(uuid=f"GPU-burst-{i}", engine_url=engine.url,
                                                  reachable=True))
            run = services.run_start(node_id=node.pk, trigger="enrolment")
            job = services.jobs_for_node(node.pk)[0]
            services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                                       result=h200_probe())
            runs.append(run.pk)
        worker = _worker_with_beat(tmp_path, "--pool=threads", f"--concurrency={machines}")
        at_once = 0
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                rows = list(VerificationRun.objects.filter(pk__in=runs).values_list(
                    "status", "step_running"))
                at_once = max(at_once, sum(r == ("load_testing", True) for r in rows))
                if all(status == "done" for status, _ in rows):
                    break
                time.sleep(0.3)
        finally:
            _stop(worker)
    done = VerificationRun.objects.filter(pk__in=runs)
    assert sorted(done.values_list("status", flat=True)) == ["done"] * machines
    assert set(done.values_list("resumed", flat=True)) == {0}
    assert at_once >= machines - 1, at_once
