"""The staff's pool page and what feeds it: the engines' own /metrics read at each health
check (their queue, which the balancer counts too, and their prefix cache counters)."""

from dataclasses import replace
from datetime import timedelta

import pytest
from django.utils import timezone

from routing import balancer, pool, services
from routing.models import Deployment, RequestLog
from routing.retry import BREAKER, POLICY
from tests.factories import UserFactory
from tests.routing.test_balancer import keys, worker

pytestmark = pytest.mark.django_db(transaction=True)

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 870.0
"""
LLAMACPP = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""


def test_an_engines_metrics_are_read_by_their_names():
    assert services.engine_metrics(VLLM) == {"engine_running": 7, "engine_waiting": 3,
                                             "prefix_queries": 1000, "prefix_hits": 870}
    assert services.engine_metrics(LLAMACPP) == {"engine_running": 2, "engine_waiting": 5}
    assert services.engine_metrics("not { prometheus") == {}


def test_the_health_check_keeps_what_a_real_engines_metrics_say(engine, deploy, v1,
                                                                 carol_key, settled):
    from tests.routing.conftest import MODEL
    from tests.routing.test_api import post

    deployment = deploy(engine("rtx-pro-6000"))
    long_prompt = [{"role": "user", "content": "Compare these GPUs for serving. " * 40}]
    for _ in range(3):  # the same long prompt again: its blocks are in the prefix cache
        assert post(v1, carol_key, {"model": MODEL, "messages": long_prompt,
                                    "max_tokens": 3}).status_code == 200
    settled()
    services.deployments_check_health()
    deployment.refresh_from_db()
    assert (deployment.engine_running, deployment.engine_waiting) == (0, 0)
    assert deployment.prefix_queries > 0 and deployment.prefix_hits > 0


def test_a_busy_engine_queue_spills_its_keys_even_if_no_router_sent_it_anything():
    fleet = [worker(1, 500.0), worker(2, 500.0)]
    key = keys(1)[0]
    top = balancer.rank(fleet, key.key)[0]
    queued = [replace(w, engine_queue=50) if w is top else w for w in fleet]
    placed = balancer.place(queued, key, {})
    assert placed.affinity == balancer.SPILL and placed.workers[0].deployment_id != \
        top.deployment_id


def test_only_staff_see_the_pool(client, bob):
    assert client.get("/staff/pool/").status_code == 302  # to the admin's log-in
    client.force_login(bob)
    assert client.get("/staff/pool/").status_code == 302


def test_the_pool_page_shows_weights_shares_load_health_and_traffic(client, engine, deploy):
    pro = deploy(engine("rtx-pro-6000"), "rtx-pro-6000")
    pair = deploy(engine("2x-rtx-4090"), "2x-rtx-4090")
    Deployment.objects.filter(pk=pair.pk).update(prefix_queries=200, prefix_hits=150)
    sick = deploy("http://127.0.0.1:9")
    Deployment.objects.filter(pk=sick.pk).update(healthy=False, health_error="refused")
    now = timezone.now()
    RequestLog.objects.bulk_create(
        RequestLog(request_id=f"r{i}", created_at=now - timedelta(minutes=2), endpoint="chat",
                   model="qwen3-27b", deployment_id=pro.pk if i % 4 else pair.pk, status=200,
                   latency_ms=1.0) for i in range(40))
    client.force_login(UserFactory(email="ops@example.com", is_staff=True, two_factor=True))
    response = client.get("/staff/pool/")
    assert response.status_code == 200
    html = response.content.decode()
    pool = response.context["pool"]
    (model,) = pool["models"]
    rows = {r["ref"]: r for r in model["workers"]}
    assert rows[pro.worker_ref]["key_share_pct"] > rows[pair.worker_ref]["key_share_pct"]
    assert rows[pair.worker_ref]["prefix_hit_pct"] == 75.0
    assert rows[pro.worker_ref]["healthy"] and rows[pro.worker_ref]["breaker_open"] == 0
    assert [d["ref"] for d in pool["out_of_pool"]] == [sick.worker_ref]
    assert "unhealthy: refused" in html
    chart = model["chart"]
    assert sum(chart["totals"]) == 40
    last = [cells[-1]["pct"] for ref, cells in sorted(chart["share_pct"].items())]
    assert sorted(last) == [25.0, 75.0]
    assert f'data-worker="{pro.worker_ref}"' in html


def test_a_circuit_another_process_holds_open_shows_on_the_page(client, engine, deploy,
                                                                 monkeypatch):
    pro = deploy(engine("rtx-pro-6000"), "rtx-pro-6000")
    with monkeypatch.context() as other:  # another server process opens it...
        other.setattr(pool, "PROCESS_ID", "another-process")
        for _ in range(POLICY.breaker_failures):
            BREAKER.failure(pro.pk)
        pool.load_exchange({})  # ...and says so with its load
    BREAKER.__init__()  # this one never saw it fail
    client.force_login(UserFactory(email="ops@example.com", is_staff=True, two_factor=True))
    response = client.get("/staff/pool/")
    (model,) = response.context["pool"]["models"]
    assert {r["ref"]: r["breaker_open"] for r in model["workers"]}[pro.worker_ref] == 1
    assert "open in 1 process<" in response.content.decode()
