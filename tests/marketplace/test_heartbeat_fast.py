"""Repeated heartbeats answered at the ASGI front from Redis (agentapi.asgi), through the real
ASGI app under uvicorn, on the real PostgreSQL and Redis."""

import copy
import json
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import httpx
import pytest
from django.contrib.admin.sites import site
from django.db import connection, transaction
from django.utils import timezone

from config import redis as config_redis
from fleetsim.server import ServerThread
from marketplace import heartbeat_fast, services
from marketplace.admin import NodeAdmin
from marketplace.models import Node, NodeUptimeHour
from tests.marketplace.test_agent_api import H200
from verification import services as verification
from verification.models import VerificationRun

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "/api/agent/heartbeat/"


def report(**overrides):
    body = {"agent_version": "0.1.0", "hostname": "gpu-box-1", "os": "Linux 6.8.0",
            "simulated": False, "nvidia": False, "driver_version": None, "cuda_version": None,
            "gpus": [],
            "engine": {"url": "", "reachable": False, "models": [], "error": "no engine"}}
    body.update(overrides)
    return body


@pytest.fixture(scope="session")
def platform(server_threads_closed):
    from config.asgi import application

    with ServerThread(application) as server:
        yield server


@pytest.fixture
def agent(platform, bob):
    """agent(body) -> the reply to a heartbeat of an enrolled node of bob's; .node_id,
    .credential and .prefix say which."""
    _, token = services.enrolment_token_create(owner=bob)
    enrolment = services.node_enroll(token=token, hostname="gpu-box-1", agent_version="0.1.0")
    client = httpx.Client(base_url=platform.url, timeout=10)

    class Agent:
        node_id = enrolment.node.pk
        credential = enrolment.credential
        prefix = enrolment.node.credential_prefix

        def __call__(self, body, credential=None):
            return client.post(PATH, json=body, headers={
                "Authorization": f"Bearer {credential or self.credential}"})

    yield Agent()
    client.close()


def entry(prefix):
    return config_redis.redis_client().get(heartbeat_fast.entry_key(prefix))


def live():
    return config_redis.redis_client().hgetall(heartbeat_fast.LIVE)


def counted(node_id) -> int:
    return sum(NodeUptimeHour.objects.filter(node_id=node_id).values_list("heartbeats",
                                                                          flat=True))


def test_a_repeated_report_is_answered_without_touching_the_database(agent):
    first = agent(report())
    assert first.status_code == 200, first.content
    assert first.json() == {"node_id": agent.node_id, "status": "online", "needs_review": False,
                            "heartbeat_interval_s": 10, "jobs": [], "report_power": False}
    assert entry(agent.prefix) is not None
    stored = Node.objects.get(pk=agent.node_id).last_heartbeat_at
    assert counted(agent.node_id) == 1

    # The same report with its keys in another order is the same report.
    again = agent(dict(reversed(list(report().items()))))
    assert again.status_code == 200 and again.json() == first.json()
    node = Node.objects.get(pk=agent.node_id)
    assert node.last_heartbeat_at == stored and counted(agent.node_id) == 1
    assert set(live()) == {str(agent.node_id).encode()}


def test_the_flush_moves_liveness_forward_and_adds_the_counts_once(agent):
    assert agent(report()).status_code == 200
    stored = Node.objects.get(pk=agent.node_id).last_heartbeat_at
    for _ in range(3):
        assert agent(report()).status_code == 200
    assert counted(agent.node_id) == 1

    assert services.heartbeats_flush() == 1
    node = Node.objects.get(pk=agent.node_id)
    assert node.last_heartbeat_at > stored and counted(agent.node_id) == 4
    assert services.heartbeats_flush() == 0  # taken once
    assert counted(agent.node_id) == 4

    # A fast heartbeat older than what the database holds never moves it back.
    later = node.last_heartbeat_at + timedelta(seconds=30)
    Node.objects.filter(pk=agent.node_id).update(last_heartbeat_at=later)
    assert agent(report()).status_code == 200
    services.heartbeats_flush()
    assert Node.objects.get(pk=agent.node_id).last_heartbeat_at == later
    assert counted(agent.node_id) == 5


def test_flushes_racing_heartbeats_count_each_heartbeat_once(agent):
    assert agent(report()).status_code == 200
    done = threading.Event()

    def flushing():
        while not done.is_set():
            services.heartbeats_flush()

    flushers = [threading.Thread(target=flushing) for _ in range(2)]
    for thread in flushers:
        thread.start()
    try:
        for _ in range(40):
            assert agent(report()).status_code == 200
    finally:
        done.set()
        for thread in flushers:
            thread.join(30)
    services.heartbeats_flush()
    assert counted(agent.node_id) == 41


def test_a_flush_does_not_wait_for_a_node_a_full_heartbeat_holds(agent):
    assert agent(report()).status_code == 200
    assert agent(report()).status_code == 200  # fast
    locked, release = threading.Event(), threading.Event()

    def full_heartbeat_in_progress():
        with transaction.atomic():
            Node.objects.select_for_update().get(pk=agent.node_id)
            locked.set()
            release.wait(30)
        connection.close()

    holder = threading.Thread(target=full_heartbeat_in_progress)
    holder.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        assert services.heartbeats_flush() == 0
        assert time.monotonic() - started < 5
        assert counted(agent.node_id) == 1
    finally:
        release.set()
        holder.join(30)
    assert services.heartbeats_flush() == 1  # the next flush takes it
    assert counted(agent.node_id) == 2


def test_a_changed_report_takes_the_full_path(agent):
    assert agent(report()).status_code == 200
    before = entry(agent.prefix)
    assert before is not None

    changed = agent(report(hostname="gpu-box-2"))
    assert changed.status_code == 200
    node = Node.objects.get(pk=agent.node_id)
    assert node.hostname == "gpu-box-2" and counted(agent.node_id) == 2
    assert live() == {}
    after = entry(agent.prefix)
    assert after is not None and after != before  # the new report is the one repeated now


def test_a_revoked_node_is_refused_at_its_next_heartbeat(agent, bob):
    assert agent(report()).status_code == 200
    assert entry(agent.prefix) is not None

    assert services.node_revoke(owner=bob, node_id=agent.node_id)
    assert entry(agent.prefix) is None
    refused = agent(report())
    assert refused.status_code == 403 and "revoked" in refused.json()["detail"]
    assert live() == {}


def test_a_wrong_secret_behind_a_known_prefix_is_refused(agent):
    assert agent(report()).status_code == 200
    assert entry(agent.prefix) is not None
    forged = agent.credential[:-4] + ("AAAA" if not agent.credential.endswith("AAAA") else "BBBB")

    refused = agent(report(), credential=forged)
    assert refused.status_code == 401
    assert live() == {}


def test_a_queued_job_reaches_the_agent_at_its_next_heartbeat(agent, bob):
    assert agent(report()).status_code == 200
    assert entry(agent.prefix) is not None

    run = verification.run_request_by_provider(owner=bob, node_id=agent.node_id)
    assert entry(agent.prefix) is None
    for _ in range(2):  # listed at every heartbeat until it is answered
        jobs = agent(report()).json()["jobs"]
        assert [job["id"] for job in jobs] == list(run.jobs.values_list("pk", flat=True))
    assert entry(agent.prefix) is None


def test_a_hold_put_by_an_operator_is_told_at_the_next_heartbeat(agent):
    assert agent(report()).json()["needs_review"] is False
    assert entry(agent.prefix) is not None

    node = Node.objects.get(pk=agent.node_id)
    node.needs_review = True
    NodeAdmin(Node, site).save_model(None, node, SimpleNamespace(changed_data=["needs_review"]),
                                     change=True)
    assert agent(report()).json()["needs_review"] is True


def test_a_gpu_uuid_let_go_by_its_holder_frees_the_newcomer_at_once(platform, bob):
    """The newcomer's repeated answer says it is held out; the holder dropping the UUID
    voids it, so the newcomer's next heartbeat is judged again."""
    agents = []
    for hostname in ("holder", "newcomer"):
        _, token = services.enrolment_token_create(owner=bob)
        enrolment = services.node_enroll(token=token, hostname=hostname, agent_version="0.1")
        agents.append(enrolment)
    client = httpx.Client(base_url=platform.url, timeout=10)

    def beat(enrolment, gpus):
        body = report(hostname=enrolment.node.hostname, nvidia=True, gpus=gpus)
        response = client.post(PATH, json=body,
                               headers={"Authorization": f"Bearer {enrolment.credential}"})
        assert response.status_code == 200, response.content
        return response.json()

    holder, newcomer = agents
    try:
        for enrolment in agents:
            beat(enrolment, [copy.deepcopy(H200)])  # the first report queues verification
            verified(enrolment.node.pk)
        assert beat(newcomer, [copy.deepcopy(H200)])["needs_review"] is True
        assert entry(newcomer.node.credential_prefix) is not None

        beat(holder, [])  # the holder's GPU is gone
        assert entry(newcomer.node.credential_prefix) is None
        assert beat(newcomer, [copy.deepcopy(H200)])["needs_review"] is False
    finally:
        client.close()


def test_marking_nodes_offline_counts_fast_heartbeats_first(agent):
    assert agent(report()).status_code == 200
    # As if the node's last full heartbeat were long ago and every one since a fast one.
    long_ago = timezone.now() - timedelta(minutes=5)
    Node.objects.filter(pk=agent.node_id).update(last_heartbeat_at=long_ago)
    assert agent(report()).status_code == 200
    assert entry(agent.prefix) is not None

    assert services.nodes_mark_offline() == []
    node = Node.objects.get(pk=agent.node_id)
    assert node.status == Node.Status.ONLINE and node.last_heartbeat_at > long_ago


def test_a_node_marked_offline_comes_back_through_the_full_path(agent):
    assert agent(report()).status_code == 200
    assert entry(agent.prefix) is not None
    long_ago = timezone.now() - timedelta(minutes=5)
    Node.objects.filter(pk=agent.node_id).update(last_heartbeat_at=long_ago)

    assert services.nodes_mark_offline() == [agent.node_id]
    assert entry(agent.prefix) is None
    assert agent(report()).json()["status"] == "online"
    assert Node.objects.get(pk=agent.node_id).status == Node.Status.ONLINE


def test_an_entry_voided_while_a_full_heartbeat_runs_is_not_written(agent):
    """A forget between the full path's first read and its write wins: the answer it made may
    be stale already (a job queued meanwhile)."""
    node = Node.objects.get(pk=agent.node_id)
    generation = heartbeat_fast.generation(agent.prefix)
    assert generation == ""
    services.node_heartbeat_forget(node_ids=[agent.node_id])
    assert not services.node_heartbeat_remember(node=node, generation=generation,
                                                report=b"{}", answer=b"{}")
    assert entry(agent.prefix) is None
    assert services.node_heartbeat_remember(node=node, generation=heartbeat_fast.generation(
        agent.prefix), report=b"{}", answer=b"{}")
    assert entry(agent.prefix) is not None


@pytest.fixture
def own_redis(settings, redis_server):
    """The platform's Redis is a redis-server of the test's own, to kill and start again."""
    real = settings.REDIS_URL
    settings.REDIS_URL = redis_server.url
    config_redis.redis_client.cache_clear()
    yield redis_server
    settings.REDIS_URL = real
    config_redis.redis_client.cache_clear()


def test_with_redis_away_heartbeats_take_the_full_path(agent, own_redis):
    assert agent(report()).status_code == 200
    assert entry(agent.prefix) is not None
    assert agent(report()).status_code == 200  # fast
    stored = Node.objects.get(pk=agent.node_id).last_heartbeat_at

    own_redis.kill()
    for _ in range(2):
        response = agent(report())
        assert response.status_code == 200, response.content
    node = Node.objects.get(pk=agent.node_id)
    assert node.last_heartbeat_at > stored and node.status == Node.Status.ONLINE
    assert services.heartbeats_flush() == 0  # nothing to take, and no error
    assert services.nodes_mark_offline() == []


def test_a_revocation_redis_missed_holds_from_the_next_flush(agent, bob, own_redis):
    assert agent(report()).status_code == 200
    assert entry(agent.prefix) is not None
    own_redis.kill()
    assert services.node_revoke(owner=bob, node_id=agent.node_id)  # Redis is not told
    own_redis.start()  # back with what it had: the entry answers once more
    assert entry(agent.prefix) is not None
    assert agent(report()).status_code == 200

    services.heartbeats_flush()
    assert entry(agent.prefix) is None
    assert agent(report()).status_code == 403


def test_a_pcie_link_that_moves_with_load_is_no_new_report(platform, bob):
    _, token = services.enrolment_token_create(owner=bob)
    enrolment = services.node_enroll(token=token, hostname="gpu-box-1", agent_version="0.1")
    node_id = enrolment.node.pk

    def beat(**gpu):
        body = report(nvidia=True, gpus=[copy.deepcopy(H200) | gpu])
        response = httpx.post(f"{platform.url}{PATH}", json=body, timeout=10,
                              headers={"Authorization": f"Bearer {enrolment.credential}"})
        assert response.status_code == 200, response.content
        return response.json()

    beat()  # the first report queues verification
    verified(node_id)
    beat()
    assert entry(enrolment.node.credential_prefix) is not None
    beat(pcie_gen_current=1, pcie_width_current=8)  # idle: the link slowed down
    assert set(live()) == {str(node_id).encode()}  # answered from Redis
    beat(pcie_gen_max=4)  # a different card slot: a new report
    assert Node.objects.get(pk=node_id).cards.get().pcie_gen_max == 4


def verified(node_id):
    """The node's verification run, taken to its end (its probes failed, it has no engine to
    load-test): while a run measures a machine its heartbeats are never repeated answers."""
    for job in verification.jobs_for_node(node_id):
        verification.job_result_record(node_id=node_id, job_id=job["id"], status="failed",
                                       result=None, error="no GPU")
    run = VerificationRun.objects.get(node_id=node_id)
    assert verification.run_load_test(run_id=run.pk) and verification.run_evaluate(run_id=run.pk)
    assert verification.run_publish(run_id=run.pk)


def test_while_a_run_measures_the_machine_its_gpus_report_power_in_full(platform, bob):
    """A run asks for the GPUs' power draw (report_power), and once its probes are in, a
    heartbeat a second; none of those answers is kept for repeats. After the run a draw that
    moved makes no new report either."""
    _, token = services.enrolment_token_create(owner=bob)
    enrolment = services.node_enroll(token=token, hostname="gpu-box-1", agent_version="0.1")
    node_id, prefix = enrolment.node.pk, enrolment.node.credential_prefix

    def beat(**gpu):
        body = report(nvidia=True, gpus=[copy.deepcopy(H200) | gpu])
        response = httpx.post(f"{platform.url}{PATH}", json=body, timeout=10,
                              headers={"Authorization": f"Bearer {enrolment.credential}"})
        assert response.status_code == 200, response.content
        return response.json()

    beat()  # the first report queues verification
    answer = beat()
    assert answer["report_power"] is True and answer["jobs"]
    assert answer["heartbeat_interval_s"] == 10  # probes running: the usual pace
    for job in verification.jobs_for_node(node_id):
        verification.job_result_record(node_id=node_id, job_id=job["id"], status="failed",
                                       result=None, error="no GPU")
    answer = beat(power_draw_w=118)
    assert (answer["report_power"], answer["heartbeat_interval_s"]) == (True, 1)
    card = Node.objects.get(pk=node_id).cards.get()
    assert card.power_draw_w == 118 and card.power_read_at is not None
    beat(power_draw_w=121)
    assert entry(prefix) is None and live() == {}  # every one of them taken in full
    assert Node.objects.get(pk=node_id).cards.get().power_draw_w == 121

    verified(node_id)
    answer = beat(power_draw_w=95)
    assert (answer["report_power"], answer["heartbeat_interval_s"]) == (False, 10)
    assert entry(prefix) is not None
    beat(power_draw_w=390)  # a draw that moved is the same report
    assert set(live()) == {str(node_id).encode()}
    assert Node.objects.get(pk=node_id).cards.get().power_draw_w == 95  # kept for the next full


def test_a_report_repeated_after_the_bound_takes_the_full_path(agent):
    assert agent(report()).status_code == 200
    stored = Node.objects.get(pk=agent.node_id).last_heartbeat_at
    # The entry's full heartbeat is as old as the bound allows, and one second more.
    key = heartbeat_fast.entry_key(agent.prefix)
    old = json.loads(entry(agent.prefix))
    old["at"] -= heartbeat_fast.FULL_EVERY_S + 1
    config_redis.redis_client().set(key, json.dumps(old), keepttl=True)

    assert agent(report()).status_code == 200
    assert Node.objects.get(pk=agent.node_id).last_heartbeat_at > stored
    assert counted(agent.node_id) == 2 and live() == {}
    assert json.loads(entry(agent.prefix))["at"] > old["at"] + heartbeat_fast.FULL_EVERY_S
