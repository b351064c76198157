"""The load test records each GPU's power draw, idle and at the verified concurrency, from the
heartbeats around and during it: an agent thread heartbeats as fleetsim's simulated RTX 4090
would (its draw follows its engine's batch), against a real simulated engine."""

import threading
import time

import pytest
from django.db import connection

from fleetsim.machine import engine_running
from fleetsim.profiles import get_profile, power_draw_w
from fleetsim.server import EngineServer, ServerThread
from marketplace import services as marketplace
from marketplace.models import Card, Node
from tests.verification.conftest import SCALE
from verification import loadtest, services
from verification.models import Measurement

pytestmark = pytest.mark.django_db(transaction=True)

PROFILE = get_profile("rtx-4090")
UUID = "GPU-4090aaaa-1111-2222-3333-444444444444"


def report(engine_url, power_draw_w=None):
    gpu = {"index": 0, "name": "NVIDIA GeForce RTX 4090", "uuid": UUID,
           "memory_total_mib": 24564, "compute_capability": "8.9", "pcie_gen_current": 4,
           "pcie_gen_max": 4, "pcie_width_current": 16, "pcie_width_max": 16,
           "power_limit_w": 450}
    if power_draw_w is not None:
        gpu["power_draw_w"] = power_draw_w
    return {"agent_version": "0.1.0", "hostname": "box", "os": "Linux 6.8", "simulated": True,
            "nvidia": True, "driver_version": "550.1", "cuda_version": "12.4", "gpus": [gpu],
            "engine": {"url": engine_url, "reachable": True, "models": [PROFILE.model],
                       "error": None}}


@pytest.fixture
def engine(settings, monkeypatch):
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 8, 32)
    # 32 streams of 256 tokens at the 4090's ~1,000 tok/s (x3): ~3 s of readings at full load
    monkeypatch.setattr(loadtest, "OUTPUT_TOKENS", 256)
    monkeypatch.setattr(loadtest, "PREFIX_WORDS", 500)
    with ServerThread(EngineServer(PROFILE, time_scale=SCALE)) as server:
        yield server.url


def probed_node(owner, engine_url, probe_power=None) -> tuple[Node, int]:
    """An enrolled node whose verification run has its probes answered: with NVML's facts
    only (`probe_power`: the draw they read), or failed when None (this test is about the
    load test)."""
    _, token = marketplace.enrolment_token_create(owner=owner)
    node = marketplace.node_enroll(token=token, hostname="box", agent_version="0.1.0").node
    marketplace.node_heartbeat_record(node_id=node.pk, report=report(engine_url))
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    for job in services.jobs_for_node(node.pk):
        if probe_power is None:
            services.job_result_record(node_id=node.pk, job_id=job["id"], status="failed",
                                       result=None, error="no torch")
        else:
            services.job_result_record(node_id=node.pk, job_id=job["id"], status="done",
                                       result={"device": "cuda", "gpus": [{
                                           "index": 0, "uuid": UUID,
                                           "facts": {"power_draw_w": probe_power}}]})
    return node, run.pk


class Agent(threading.Thread):
    """Heartbeats every `every` s with the GPU's draw for the batch the engine runs now, as
    the agent does for a simulated machine once the platform asks for it; the first one
    `late` s after it starts."""

    def __init__(self, node_id, engine_url, every=0.2, late=0.0):
        super().__init__(daemon=True)
        self.node_id, self.engine_url, self.every, self.late = node_id, engine_url, every, late
        self.stop = threading.Event()
        self.sent: list[int] = []

    def run(self):
        try:
            self.stop.wait(self.late)
            while not self.stop.is_set():
                watts = power_draw_w(PROFILE, engine_running(self.engine_url))
                marketplace.node_heartbeat_record(node_id=self.node_id,
                                                  report=report(self.engine_url, watts))
                self.sent.append(watts)
                self.stop.wait(self.every)
        finally:
            connection.close()


def test_idle_and_loaded_draw_are_measured_and_published(bob, engine):
    node, run_id = probed_node(bob, engine)
    agent = Agent(node.pk, engine)
    agent.start()
    try:
        # Asked since the run began (report_power), the agent has reported a draw already.
        while Card.objects.get(node=node).power_draw_w is None:
            time.sleep(0.05)
        assert services.run_load_test(run_id=run_id)
    finally:
        agent.stop.set()
        agent.join()
    card = Card.objects.get(node=node)
    power = {m.metric: m for m in Measurement.objects.filter(run_id=run_id, card=card)}
    # Idle: the profile's 25 W, from the readings before the first request.
    idle = power["power_idle_w"]
    assert idle.value == 25 and len(idle.details["readings"]) >= services.POWER_IDLE_READINGS
    # At 32 concurrent: 90% of the 4090's 450 W limit (fleetsim's model), read while the level
    # ran; the median keeps the ramp at either end out.
    loaded = power["power_loaded_w"]
    assert loaded.details["concurrency"] == 32 and len(loaded.details["readings"]) >= 3
    assert loaded.value == pytest.approx(power_draw_w(PROFILE, 32), abs=15)
    assert max(agent.sent) == power_draw_w(PROFILE, 32)  # the agent did see the full batch

    assert services.run_evaluate(run_id=run_id) and services.run_publish(run_id=run_id)
    card.refresh_from_db()
    tps = {m.metric: m.value for m in Measurement.objects.filter(run_id=run_id, card=None)}
    assert (card.power_idle_w, card.power_loaded_w) == (idle.value, loaded.value)
    assert card.verified_single_tokens_per_s == pytest.approx(tps["tps@1"])
    assert card.verified_tokens_per_s == pytest.approx(tps["tps@32"])
    # One stream alone serves far fewer tokens than 32 at once (90 vs 218 tok/s, x3 here).
    assert card.verified_single_tokens_per_s < card.verified_tokens_per_s / 1.5


def test_a_machine_that_reports_no_power_is_not_waited_for(bob, engine, settings):
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 32)
    node, run_id = probed_node(bob, engine)
    started = time.monotonic()
    assert services.run_load_test(run_id=run_id)
    # No reading to wait for: no idle wait of a heartbeat interval (10 s here).
    assert time.monotonic() - started < settings.RIGSHARE_HEARTBEAT_INTERVAL_S
    assert not Measurement.objects.filter(run_id=run_id, metric__startswith="power").exists()
    assert services.run_evaluate(run_id=run_id) and services.run_publish(run_id=run_id)
    card = Card.objects.get(node=node)
    assert (card.power_idle_w, card.power_loaded_w) == (None, None)
    assert card.verified_single_tokens_per_s is not None  # tps@1 was measured all the same


def test_a_machine_whose_probes_read_power_is_waited_for(bob, engine, settings):
    """The probes came back before the agent's next heartbeat (simulated probes take no time):
    no reading yet, but NVML read a draw in the probes, so the load test waits for the
    heartbeats' readings before its first request."""
    settings.RIGSHARE_LOAD_TEST_LEVELS = (1, 32)
    node, run_id = probed_node(bob, engine, probe_power=25)
    assert Card.objects.get(node=node).power_draw_w is None
    agent = Agent(node.pk, engine, late=1.5)
    agent.start()
    started = time.monotonic()
    try:
        assert services.run_load_test(run_id=run_id)
    finally:
        agent.stop.set()
        agent.join()
    assert time.monotonic() - started >= 1.5  # it waited for the first heartbeat
    power = dict(Measurement.objects.filter(run_id=run_id, card__node=node,
                                            metric__startswith="power")
                 .values_list("metric", "value"))
    assert power["power_idle_w"] == 25
    assert power["power_loaded_w"] == pytest.approx(power_draw_w(PROFILE, 32), abs=15)
