"""The verification pipeline against a real simulated engine (fleetsim on 127.0.0.1)."""

import copy
import gc
import sys
import threading
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace import services as marketplace
from marketplace.models import Card, Node
from tests.verification.conftest import SCALE, YardstickAgent
from verification import loadtest, services, tasks
from verification.models import Finding, Measurement, ProbeJob, VerificationRun, VerifiedCapacity

pytestmark = pytest.mark.django_db

H200_UUID = "GPU-0a0a0a0a-1111-2222-3333-444444444444"


def h200_report(uuid=H200_UUID, engine_url="", reachable=False):
    return {"agent_version": "0.1.0", "hostname": "box", "os": "Linux 6.8", "simulated": True,
            "nvidia": True, "driver_version": "570.1", "cuda_version": "12.8",
            "gpus": [{"index": 0, "name": "NVIDIA H200", "uuid": uuid,
                      "memory_total_mib": 143771, "compute_capability": "9.0",
                      "pcie_gen_current": 5, "pcie_gen_max": 5, "pcie_width_current": 16,
                      "pcie_width_max": 16, "power_limit_w": 700}],
            "engine": {"url": engine_url, "reachable": reachable, "models": ["Qwen/Qwen3-27B"],
                       "served": [{"id": "Qwen/Qwen3-27B", "engine": "vllm",
                                   "max_context": 262_144, "quantization": "fp8"}],
                       "error": None}}


def h200_probe(**gpu_overrides):
    gpu = {"index": 0, "uuid": H200_UUID,
           "facts": {"name": "NVIDIA H200", "compute_capability": "9.0",
                     "compute_capability_cuda": "9.0", "sm_count": 132,
                     "memory_total_mib": 143771, "memory_bus_width_bits": 6144,
                     "max_memory_clock_mhz": 3201, "theoretical_bandwidth_gbs": 4917.0,
                     "pcie_gen_current": 5, "pcie_gen_max": 5, "pcie_width_current": 16,
                     "pcie_width_max": 16, "power_limit_w": 700, "power_default_limit_w": 700,
                     "virtualization_mode": 0},
           "bandwidth": {"kernel": "triad", "best_gbs": 4210.0, "median_gbs": 4190.0},
           "matmul": {"dtype": "bfloat16", "n": 8192, "best_tflops": 760.0,
                      "median_tflops": 750.0},
           "host_device": {"pinned": True, "h2d_gbs": 51.0, "d2h_gbs": 50.0},
           "vram": {"free_bytes": int(139 * 2**30), "tested_bytes": int(125 * 2**30),
                    "pattern_ok": True}}
    for key, value in gpu_overrides.items():
        (gpu["facts"] if key in gpu["facts"] else gpu)[key] = value
    return {"device": "cuda", "kernel_release": "6.8.0", "wsl": False, "gpus": [gpu]}


def enrolled_node(owner, report) -> Node:
    _, token = marketplace.enrolment_token_create(owner=owner)
    node = marketplace.node_enroll(token=token, hostname="box", agent_version="0.1.0").node
    marketplace.node_heartbeat_record(node_id=node.pk, report=report)
    return Node.objects.get(pk=node.pk)


def probed(node, trigger):
    """A new run of the node's, its probes answered as an honest H200's."""
    run = services.run_start(node_id=node.pk, trigger=trigger)
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                               result=h200_probe())
    return run


def run_pipeline(run):
    assert services.runs_ready_for_load_test() == [run.pk]
    assert services.run_load_test(run_id=run.pk)
    assert services.run_evaluate(run_id=run.pk)
    assert services.run_publish(run_id=run.pk)
    run.refresh_from_db()
    return run


@pytest.mark.django_db(transaction=True)  # the agent's heartbeats come from another thread
def test_an_honest_h200_is_verified_with_its_capacity_published(bob, switching_h200):
    url, engine = switching_h200
    report = h200_report(engine_url=url, reachable=True)
    report["engine"]["supervisor"] = {"state": "ready", "mode": "command", "argv": ["engine"]}
    node = enrolled_node(bob, report)
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    jobs = services.jobs_for_node(node.pk)
    assert [j["kind"] for j in jobs] == ["probes"] and jobs[0]["params"]["iterations"] >= 20
    assert services.runs_ready_for_load_test() == []  # still waiting for the agent
    services.job_result_record(node_id=node.pk, job_id=jobs[0]["id"], status="done",
                               result=h200_probe())
    assert services.jobs_for_node(node.pk) == []
    agent = YardstickAgent(node.pk, engine, report)
    agent.start()
    try:
        run = run_pipeline(run)
    finally:
        agent.stop.set()
        agent.join()
    assert agent.failure is None, agent.failure
    assert run.status == "done" and run.progress_pct == 100, run.error
    assert run.model == "Qwen/Qwen3-27B", run.error
    assert agent.served_yardstick and run.yardstick_state == "done", run.yardstick_note
    card = Card.objects.get(node=node)
    assert card.verification_status == "verified" and card.reference_spec == "H200"
    tps = {m.metric: m.value for m in Measurement.objects.filter(run=run, card=None)}
    # The profile's curve: 170 tok/s alone, far more at 32 and 128 concurrent.
    assert 120 < tps["tps@1"] / SCALE < 200
    # Many streams at once serve several times one stream (this process reads the streams
    # and serves them too, so the exact curve is for `make bench-verification` to show).
    assert tps["tps@32"] > 4 * tps["tps@1"] and tps["tps@128"] > 4 * tps["tps@1"]
    assert tps["prefix_speedup"] > 2 and tps["context_accepted"] == 1.0
    # The engine decodes three tokens a pass (its multi-token-prediction head), as its
    # metrics say; the yardstick, a plain 8B, one.
    assert tps["spec_tokens_per_pass"] == pytest.approx(3.0, abs=0.05)
    assert {f"ytps@{n}" for n in (1, 8, 32)} <= set(tps)
    assert card.verified_tokens_per_s == pytest.approx(tps["tps@32"])
    # What the figure means, and the bandwidth against the spec, as the catalog shows them.
    assert (card.verified_model, card.verified_concurrency) == ("Qwen/Qwen3-27B", 32)
    assert (card.bandwidth_gbs, card.spec_bandwidth_gbs) == (4210.0, 4800)
    assert VerifiedCapacity.objects.get(card=card).tokens_per_s == pytest.approx(tps["tps@32"])
    severities = dict(Finding.objects.filter(run=run).values_list("metric", "severity"))
    assert {"identity", "bandwidth", "compute", "vram", "pcie", "serving", "prefix_cache",
            "context", "yardstick"} <= set(severities)
    # The first machine serving its model: its answers are kept, nothing to compare them with.
    assert severities.pop("fingerprint") == "not_measured"
    assert set(severities.values()) == {"ok"}, severities


@pytest.mark.django_db(transaction=True)  # the agent's heartbeats come from another thread
def test_serving_read_short_is_read_again_before_a_card_is_flagged(bob, switching_h200, settings,
                                                                   monkeypatch):
    """Serving short of what the machine should serve, with nothing else wrong, is read a second
    time a while later before the card is flagged on it: a machine busy for a while (its
    owner's own job, a platform crowded by a burst of machines joining) reads short once and
    passes the next time; a slow card is slow both times. A run started on served traffic
    flags at once: the traffic was the first reading."""
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 8)
    monkeypatch.setattr(services, "_advertised_concurrency", lambda node: None)
    url, engine = switching_h200
    report = h200_report(engine_url=url, reachable=True)
    report["engine"]["supervisor"] = {"state": "ready", "mode": "command", "argv": ["engine"]}
    node = enrolled_node(bob, report)
    agent = YardstickAgent(node.pk, engine, report)
    agent.start()

    def probed_run(trigger):
        return probed(node, trigger)

    def ready(run):  # the agent's next heartbeat: its own engine back from the yardstick
        deadline = time.monotonic() + 10
        while services.runs_ready_for_load_test() != [run.pk] and time.monotonic() < deadline:
            time.sleep(0.1)
        return run

    def first_reading(run):
        ready(run)
        before = Card.objects.get(node=node).verification_status
        assert services.run_load_test(run_id=run.pk)
        assert services.run_evaluate(run_id=run.pk) is False  # the chain stops here
        run.refresh_from_db()
        assert (run.status, run.remeasured) == ("probing", 1), run.step_detail
        assert set(run.first_reading["findings"]) == {"serving"}, run.first_reading
        assert 55 < (run.measure_after - timezone.now()).total_seconds() <= 90
        assert not Finding.objects.filter(run=run).exists()
        assert Card.objects.get(node=node).verification_status == before  # nothing said yet
        assert services.runs_ready_for_load_test() == []  # not before its time
        VerificationRun.objects.filter(pk=run.pk).update(measure_after=timezone.now())
        return ready(run)

    try:
        # Busy during the first reading, itself again for the second: verified.
        engine.own.engine.speed = 0.1  # 30% of the card: the engine runs SCALE x fast
        run = first_reading(probed_run("enrolment"))
        engine.own.engine.speed = 1.0
        run = run_pipeline(run)
        card = Card.objects.get(node=node)
        assert card.verification_status == "verified", card.verification_status
        serving = Finding.objects.get(run=run, metric="serving")
        assert serving.severity == "ok" and "this one stands" in serving.message
        # Slow both times: flagged, on both readings.
        engine.own.engine.speed = 0.1  # 30% of the card: the engine runs SCALE x fast
        run = run_pipeline(first_reading(probed_run("operator")))
        assert Card.objects.get(node=node).verification_status == "flagged"
        serving = Finding.objects.get(run=run, metric="serving")
        assert serving.severity == "mismatch" and "agreed" in serving.message
        # Started on served traffic: flagged on its one reading.
        run = run_pipeline(ready(probed_run("served_traffic")))
        assert run.remeasured == 0 and not run.first_reading
        assert Card.objects.get(node=node).verification_status == "flagged"
    finally:
        agent.stop.set()
        agent.join()
    assert agent.failure is None, agent.failure


def test_an_engine_its_provider_runs_by_hand_is_measured_but_never_verified(bob, h200_engine):
    node = enrolled_node(bob, h200_report(engine_url=h200_engine, reachable=True))
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                               result=h200_probe())
    run = run_pipeline(run)
    assert run.yardstick_state == "skipped" and "by hand" in run.yardstick_note
    card = Card.objects.get(node=node)
    assert card.verification_status == "not_judged"
    assert card.verified_tokens_per_s > 0  # routing weighs it by what was measured
    serving = Finding.objects.get(run=run, metric="serving")
    assert serving.severity == "not_measured" and "by hand" in serving.message


def test_liars_are_flagged(bob, mallory, h200_engine):
    honest = enrolled_node(bob, h200_report(engine_url=h200_engine, reachable=True))
    liar = enrolled_node(mallory, h200_report(engine_url=h200_engine, reachable=True))
    run = services.run_start(node_id=liar.pk, trigger="enrolment")
    job = services.jobs_for_node(liar.pk)[0]
    services.job_result_record(node_id=liar.pk, job_id=job["id"], status="done",
                               result=h200_probe(bandwidth={"best_gbs": 2319.0}))
    run = run_pipeline(run)
    card = Card.objects.get(node=liar)
    assert card.verification_status == "flagged"
    severities = dict(Finding.objects.filter(run=run).values_list("metric", "severity"))
    assert severities["bandwidth"] == "mismatch"
    assert severities["uuid"] == "mismatch"  # the honest node reports the same GPU UUID
    assert Card.objects.get(node=honest).verification_status == "unverified"


def test_steps_are_idempotent_and_never_duplicate(bob, h200_engine):
    node = enrolled_node(bob, h200_report(engine_url=h200_engine, reachable=True))
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    assert services.run_start(node_id=node.pk, trigger="provider") == run  # one at a time
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                               result=h200_probe())
    with pytest.raises(services.JobAlreadyAnswered):
        services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                                   result=h200_probe(bandwidth={"best_gbs": 1.0}))
    assert services.run_load_test(run_id=run.pk)
    assert not services.run_load_test(run_id=run.pk)  # a redelivered task does nothing
    count = Measurement.objects.filter(run=run).count()
    assert services.run_evaluate(run_id=run.pk)
    assert not services.run_evaluate(run_id=run.pk)
    assert services.run_publish(run_id=run.pk) and not services.run_publish(run_id=run.pk)
    assert Measurement.objects.filter(run=run).count() == count
    findings = Finding.objects.filter(run=run).count()
    # A worker killed after evaluating, the step run again by hand: same findings, once.
    VerificationRun.objects.filter(pk=run.pk).update(status="load_testing")
    assert services.run_evaluate(run_id=run.pk)
    assert Finding.objects.filter(run=run).count() == findings


def test_a_run_without_probe_answer_is_judged_without_it_after_the_wait(bob, settings):
    settings.RIGSHARE_PROBE_WAIT = timedelta(seconds=0)
    node = enrolled_node(bob, h200_report())
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    assert services.runs_ready_for_load_test() == [run.pk]
    run = run_pipeline(run)
    assert run.status == "done"
    assert ProbeJob.objects.get(run=run).status == "failed"
    # Nothing was measured (no probes, no engine): nothing is shown as passed.
    assert Card.objects.get(node=node).verification_status == "unverified"
    bandwidth = Finding.objects.get(run=run, metric="bandwidth")
    assert bandwidth.severity == "not_measured" and bandwidth.measured == ""
    assert "did not answer in time" in bandwidth.message


def test_a_stale_run_is_timed_out_and_restarted(bob):
    node = enrolled_node(bob, h200_report())
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    VerificationRun.objects.filter(pk=run.pk).update(
        updated_at=timezone.now() - timedelta(hours=1))
    restarted = services.runs_time_out_stale()
    run.refresh_from_db()
    assert run.status == "timed_out" and len(restarted) == 1
    fresh = VerificationRun.objects.get(pk=restarted[0])
    assert fresh.trigger == "restart" and fresh.status == "probing"
    assert ProbeJob.objects.get(run=run).status == "failed"


def test_weekly_runs_only_for_nodes_not_verified_this_week(bob, mallory):
    recent = enrolled_node(bob, h200_report())
    services.run_start(node_id=recent.pk, trigger="enrolment")
    due = enrolled_node(mallory, h200_report(uuid="GPU-other"))
    assert services.runs_start_weekly() == 1
    assert VerificationRun.objects.get(node=due).trigger == "schedule"


def test_provider_may_ask_again_at_most_once_an_hour(client, bob, mallory):
    node = enrolled_node(bob, h200_report())
    client.force_login(mallory)
    assert client.post(f"/verification/nodes/{node.pk}/reverify/").status_code == 404
    assert not VerificationRun.objects.exists()
    client.force_login(bob)
    client.post(f"/verification/nodes/{node.pk}/reverify/")
    run = VerificationRun.objects.get(node=node)
    assert run.trigger == "provider"
    VerificationRun.objects.filter(pk=run.pk).update(status="done")
    response = client.post(f"/verification/nodes/{node.pk}/reverify/", follow=True)
    assert "at most once an hour" in response.content.decode()
    assert VerificationRun.objects.filter(node=node).count() == 1


def test_job_result_endpoint(api, bob, mallory):
    node = enrolled_node(bob, h200_report())
    services.run_start(node_id=node.pk, trigger="enrolment")
    job = services.jobs_for_node(node.pk)[0]
    _, token = marketplace.enrolment_token_create(owner=mallory)
    other = marketplace.node_enroll(token=token, hostname="x", agent_version="0")
    url = f"/api/agent/jobs/{job['id']}/result/"
    body = {"status": "done", "result": h200_probe(), "error": None}
    assert api.post(url, body, format="json").status_code == 401
    assert api.post(url, body, format="json",
                    HTTP_AUTHORIZATION=f"Bearer {other.credential}").status_code == 404
    _, token = marketplace.enrolment_token_create(owner=bob)
    mine = marketplace.node_enroll(token=token, hostname="y", agent_version="0")
    assert api.post(url, body, format="json",  # bob's, but another node of his
                    HTTP_AUTHORIZATION=f"Bearer {mine.credential}").status_code == 404
    credential = _credential_for(node)
    assert api.post(url, {"status": "maybe"}, format="json",
                    HTTP_AUTHORIZATION=f"Bearer {credential}").status_code == 400
    assert api.post(url, body, format="json",
                    HTTP_AUTHORIZATION=f"Bearer {credential}").status_code == 200
    assert api.post(url, body, format="json",
                    HTTP_AUTHORIZATION=f"Bearer {credential}").status_code == 409
    assert Measurement.objects.filter(metric="bandwidth_gbs").get().value == 4210.0


def _credential_for(node: Node) -> str:
    """A fresh credential for an existing node (tests only: production issues it at enrol)."""
    from accounts.secrets import secret_issue

    issued = secret_issue("rsn")
    Node.objects.filter(pk=node.pk).update(credential_prefix=issued.prefix,
                                           credential_digest=issued.digest)
    return issued.token


@pytest.mark.django_db(transaction=True)
def test_first_heartbeat_starts_a_run_and_the_reply_carries_the_job(api, bob):
    _, token = marketplace.enrolment_token_create(owner=bob)
    enrolled = api.post("/api/agent/enroll/", {"token": token}, format="json").json()
    reply = api.post("/api/agent/heartbeat/", h200_report(), format="json",
                     HTTP_AUTHORIZATION=f"Bearer {enrolled['credential']}").json()
    run = VerificationRun.objects.get(node_id=enrolled["node_id"])
    assert run.trigger == "enrolment"
    assert [j["id"] for j in reply["jobs"]] == [run.jobs.get().pk]
    # A changed power limit starts no second run while one is under way ...
    changed = copy.deepcopy(h200_report())
    changed["gpus"][0]["power_limit_w"] = 400
    api.post("/api/agent/heartbeat/", changed, format="json",
             HTTP_AUTHORIZATION=f"Bearer {enrolled['credential']}")
    assert VerificationRun.objects.count() == 1
    # ... but does once the first is over.
    VerificationRun.objects.filter(pk=run.pk).update(status="done")
    changed["gpus"][0]["power_limit_w"] = 350
    api.post("/api/agent/heartbeat/", changed, format="json",
             HTTP_AUTHORIZATION=f"Bearer {enrolled['credential']}")
    assert VerificationRun.objects.filter(trigger="hardware_change").count() == 1


def test_the_advance_task_runs_the_chain_eagerly(bob, h200_engine, settings):
    settings.CELERY_TASK_ALWAYS_EAGER = True
    from config.celery import app

    app.conf.task_always_eager = True
    try:
        node = enrolled_node(bob, h200_report(engine_url=h200_engine, reachable=True))
        run = services.run_start(node_id=node.pk, trigger="enrolment")
        job = services.jobs_for_node(node.pk)[0]
        services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                                   result=h200_probe())
        assert tasks.verification_advance.apply().get() == 1
        run.refresh_from_db()
        assert run.status == "done"
    finally:
        app.conf.task_always_eager = False


def test_a_run_waiting_for_its_next_step_is_never_taken_for_a_dead_worker(bob, h200_engine):
    """A step's staleness counts from when it started: a run whose load test is done waits for
    its evaluation behind a burst of other load tests as long as the queue takes, is queued
    again (not resumed, not failed) only after REQUEUE_AFTER, and is never timed out for it."""
    node = enrolled_node(bob, h200_report(engine_url=h200_engine, reachable=True))
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                               result=h200_probe())
    assert services.run_load_test(run_id=run.pk)
    run.refresh_from_db()
    assert (run.status, run.step_running) == ("load_testing", False)
    queued = timezone.now() - services.STALE_AFTER - timedelta(minutes=1)
    VerificationRun.objects.filter(pk=run.pk).update(updated_at=queued)
    assert services.runs_resume_stale() == []
    assert services.runs_time_out_stale() == []
    assert services.runs_requeue_waiting() == [(run.pk, "evaluate")]
    assert services.runs_requeue_waiting() == []  # stamped: not again for REQUEUE_AFTER
    assert services.run_evaluate(run_id=run.pk)
    VerificationRun.objects.filter(pk=run.pk).update(updated_at=queued)
    assert services.runs_resume_stale() == []
    assert services.runs_requeue_waiting() == [(run.pk, "publish")]
    assert services.run_publish(run_id=run.pk)
    run.refresh_from_db()
    assert (run.status, run.resumed, run.error) == ("done", 0, "")


def test_a_running_step_without_a_stamp_lost_its_worker(bob):
    node = enrolled_node(bob, h200_report())
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    VerificationRun.objects.filter(pk=run.pk).update(
        status="load_testing", step_running=True,
        updated_at=timezone.now() - services.STEP_STALE - timedelta(seconds=1))
    assert services.runs_resume_stale() == [(run.pk, "load_testing")]
    assert services.runs_requeue_waiting() == []


def test_a_run_waits_for_the_engine_its_agent_is_bringing_up(bob, settings):
    """A machine that just joined: its agent reports the engine loading; the load test waits
    for it as for the probes, up to the same wait."""
    report = h200_report(engine_url="http://127.0.0.1:9", reachable=False)
    report["engine"]["supervisor"] = {"state": "loading", "mode": "command", "argv": ["engine"]}
    node = enrolled_node(bob, report)
    run = probed(node, "enrolment")
    assert services.runs_ready_for_load_test() == []
    Node.objects.filter(pk=node.pk).update(engine_state="ready")
    assert services.runs_ready_for_load_test() == [run.pk]
    # An engine that never comes up does not hold the run for ever.
    Node.objects.filter(pk=node.pk).update(engine_state="starting")
    VerificationRun.objects.filter(pk=run.pk).update(
        created_at=timezone.now() - settings.RIGSHARE_PROBE_WAIT - timedelta(seconds=1))
    assert services.runs_ready_for_load_test() == [run.pk]


class Hog(threading.Thread):
    """A thread that keeps this interpreter busy and holds it for `slice_s` at a time: the
    event loop that reads the load test's streams (a thread of this process, as in a worker
    running many load tests) wakes that late, as a worker crowded by a burst of joining
    machines does. Its slice is twice the lateness a level may have
    (RIGSHARE_LOAD_TEST_LAG_MS, 100 ms), so the loop it starves is always read as starved."""

    def __init__(self, slice_s: float = 0.2):
        super().__init__(daemon=True)
        self.slice_s, self.stop = slice_s, threading.Event()

    def run(self):
        while not self.stop.is_set():
            sum(range(10_000))

    def __enter__(self):
        self.interval = sys.getswitchinterval()
        sys.setswitchinterval(self.slice_s)
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()
        sys.setswitchinterval(self.interval)


def test_a_load_test_read_by_a_starved_worker_is_measured_again_later(bob, h200_engine,
                                                                      settings, monkeypatch):
    """Tokens are stamped when the platform's loop reads them: a loop that cannot keep up
    reads an honest engine slow (or, its stamps bunched, impossibly fast). Such a load test is
    not judged; the run waits and measures again later; after RIGSHARE_LOAD_TEST_REMEASURES
    tries it is judged without serving figures (never flagged on figures nobody could take)."""
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 8)
    settings.RIGSHARE_LOAD_TEST_REMEASURES = 1
    monkeypatch.setattr(services, "_advertised_concurrency", lambda node: None)
    monkeypatch.setattr(loadtest, "OUTPUT_TOKENS", 24)  # a starved reader is slow to read
    node = enrolled_node(bob, h200_report(engine_url=h200_engine, reachable=True))

    def probed_run(trigger):
        return probed(node, trigger)

    # A worker that keeps up: measured and judged, the loop's lateness beside each level.
    gc.collect()  # not in the middle of a level this short (a pause of this long process)
    run = run_pipeline(probed_run("enrolment"))
    tps = {m.metric: m for m in Measurement.objects.filter(run=run, card=None)}
    assert tps["tps@8"].value > 3 * tps["tps@1"].value
    assert tps["tps@8"].details["loop_lag_p90_ms"] < settings.RIGSHARE_LOAD_TEST_LAG_MS

    # A starved one: the run waits for its load test again, a minute or more later.
    run = probed_run("provider")
    assert services.runs_ready_for_load_test() == [run.pk]
    with Hog():
        assert services.run_load_test(run_id=run.pk) is False  # the chain stops here
    run.refresh_from_db()
    assert (run.status, run.remeasured, run.step_running) == ("probing", 1, False)
    assert "overloaded Rigshare worker" in run.step_detail, run.step_detail
    assert 55 < (run.measure_after - timezone.now()).total_seconds() <= 90
    assert not Measurement.objects.filter(run=run, card=None).exists()
    assert services.runs_ready_for_load_test() == []  # not before its time
    assert services.run_evaluate(run_id=run.pk) is False  # a stale chain's next step
    # Its time comes, and the worker keeps up: judged as any run.
    VerificationRun.objects.filter(pk=run.pk).update(measure_after=timezone.now())
    gc.collect()
    run = run_pipeline(run)
    assert run.status == "done" and not run.error, run.error
    assert Finding.objects.get(run=run, metric="serving").measured

    # Starved every time: the run goes on without serving figures, and flags nothing.
    run = probed_run("operator")
    for _ in range(2):
        VerificationRun.objects.filter(pk=run.pk).update(measure_after=None)
        with Hog():
            services.run_load_test(run_id=run.pk)
    run.refresh_from_db()
    assert run.status == "load_testing" and run.remeasured == 1
    assert run.error.startswith("no load test: the load test was read by an overloaded")
    assert services.run_evaluate(run_id=run.pk) and services.run_publish(run_id=run.pk)
    assert not Measurement.objects.filter(run=run, metric__startswith="tps@").exists()
    assert not Finding.objects.get(run=run, metric="serving").measured
    assert Card.objects.get(node=node).verification_status != "flagged"


def test_a_worker_reads_fewer_levels_at_once_while_they_are_read_late():
    """The load tests of one worker process share one gate: a level read late halves how many
    read at once, one read in time lets one more in, never fewer than one."""
    gate = loadtest.ReadingGate(most=8, late_ms=50)
    assert all(gate.try_enter() for _ in range(8)) and not gate.try_enter()
    gate.leave(120.0)  # late: 4 at once from now on, 7 reading
    assert (gate.limit, gate.reading) == (4, 7) and not gate.try_enter()
    for _ in range(4):
        gate.leave(10.0)  # in time: back up one each
    assert (gate.limit, gate.reading) == (8, 3)
    assert gate.try_enter()
    for lag in (500.0,) * 6:
        gate.leave(lag)
        gate.try_enter()
    assert gate.limit == 1.0  # never below one
    while gate.reading:
        gate.leave(0.0)
    assert gate.try_enter() and gate.reading == 1


def test_a_run_measured_again_waits_for_the_providers_engine_back(bob, settings):
    """A try that was measured again later may have switched the machine to the yardstick:
    the next try waits until its agent serves the provider's engine again, as for an engine
    coming up (the same bounded wait)."""
    report = h200_report(engine_url="http://127.0.0.1:9", reachable=True)
    serving = {"state": "ready", "mode": "command", "argv": ["engine"],
               "yardstick": {"run": 1, "version": "abc"}}
    report["engine"]["supervisor"] = serving
    node = enrolled_node(bob, report)
    run = probed(node, "enrolment")
    assert services.runs_ready_for_load_test() == []
    Node.objects.filter(pk=node.pk).update(engine_process={**serving, "yardstick": None})
    assert services.runs_ready_for_load_test() == [run.pk]
    # An agent that never gives the engine back does not hold the run for ever.
    Node.objects.filter(pk=node.pk).update(engine_process=serving)
    VerificationRun.objects.filter(pk=run.pk).update(
        created_at=timezone.now() - settings.RIGSHARE_PROBE_WAIT - timedelta(seconds=1))
    assert services.runs_ready_for_load_test() == [run.pk]
    # The wait counts from the try's own time, not the run's start.
    VerificationRun.objects.filter(pk=run.pk).update(measure_after=timezone.now())
    assert services.runs_ready_for_load_test() == []
