"""The pool snapshot: who may take traffic, from the database's facts."""

import asyncio

import httpx
import pytest
from django.utils import timezone

from billing.models import Charge, Hold
from config.redis import redis_client
from marketplace.models import Card, Node
from routing import pool, services
from routing.models import Deployment, EngineModel, Model, RequestLog
from tests.factories import NodeFactory, RentalFactory
from tests.routing.conftest import MODEL
from tests.routing.test_api import CHAT, post

pytestmark = pytest.mark.django_db(transaction=True)


def workers(snapshot) -> list[int]:
    return sorted(w.deployment_id for w in snapshot.workers.get(MODEL, ()))


def test_snapshot_holds_healthy_mapped_deployments_with_verified_capacity(deploy, model):
    good = deploy("http://a", "2x-rtx-4090")
    offline = deploy("http://b")
    Node.objects.filter(pk=offline.node_id).update(status=Node.Status.OFFLINE)
    unhealthy = deploy("http://c")
    Deployment.objects.filter(pk=unhealthy.pk).update(healthy=False)
    gone = deploy("http://d")
    Deployment.objects.filter(pk=gone.pk).update(reported=False)
    unmapped = deploy("http://e", engine_model="some/other-model")
    same_name = deploy("http://f", engine_model=MODEL)  # an engine id equal to a public name
    snap = pool.build()
    assert workers(snap) == sorted([good.pk, same_name.pk])
    entry = next(w for w in snap.workers[MODEL] if w.deployment_id == good.pk)
    # Two cards of 217.5 each: the engine's capacity is their sum.
    assert (entry.capacity_tps, entry.verified, entry.renter_id) == (435.0, True, None)
    assert unmapped.pk not in workers(snap)
    EngineModel.objects.create(engine_model_id="some/other-model", model=model)
    assert unmapped.pk in workers(pool.build())


def test_version_is_the_content_not_the_moment(deploy):
    deploy("http://a")
    first, again = pool.build(generation=1), pool.build(generation=2)
    assert first.version == again.version and first.generation != again.generation
    deploy("http://b")
    assert pool.build().version != first.version


def test_flagged_cards_and_rentals_show_in_the_snapshot(deploy, alice):
    flagged = deploy("http://a")
    Card.objects.filter(node_id=flagged.node_id).update(
        verification_status=Card.Verification.FLAGGED)
    rented = deploy("http://b")
    RentalFactory(card=Card.objects.get(node_id=rented.node_id), renter=alice)
    by_id = {w.deployment_id: w for w in pool.build().workers[MODEL]}
    assert by_id[flagged.pk].verified is False
    assert by_id[rented.pk].renter_id == alice.pk


@pytest.mark.parametrize("hold", [{"needs_review": True}, {"uuid_conflict": True}])
def test_a_node_held_out_gets_no_shared_traffic_even_with_verified_cards(deploy, hold):
    held = deploy("http://a")
    Node.objects.filter(pk=held.node_id).update(**hold)
    fine = deploy("http://b")
    by_id = {w.deployment_id: w for w in pool.build().workers[MODEL]}
    assert by_id[held.pk].verified is False and by_id[fine.pk].verified is True


def test_a_serving_verified_node_takes_shared_traffic(deploy):
    mac = deploy("http://a")
    Card.objects.filter(node_id=mac.node_id).update(
        verification_status=Card.Verification.SERVING_VERIFIED)
    assert next(w for w in pool.build().workers[MODEL] if w.deployment_id == mac.pk).verified


def test_a_rented_card_answers_only_its_renters_keys_and_bills_no_tokens(
        v1, engine, deploy, carol, carol_key, mallory, fund, settled):
    from billing.keys import api_key_create

    deployment = deploy(engine())
    RentalFactory(card=Card.objects.get(node_id=deployment.node_id), renter=carol)
    pool.POOL.invalidate()
    fund(mallory, 10_000_000)
    _, other_key = api_key_create(user=mallory, name="other", spend_limit_micros=10**12,
                                  by_operator=True)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5}
    for stream in (False, True):
        response = post(v1, carol_key, body | {"stream": stream})
        assert response.status_code == 200
        assert response.headers["x-rigshare-worker"] == f"deployment:{deployment.pk}"
    refused = post(v1, other_key, body)
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "no_capacity")
    settled()
    # Her rental is paid by the second; its tokens are logged, not billed again.
    assert not Hold.objects.exists() and not Charge.objects.exists()
    assert sorted(RequestLog.objects.values_list("status", "completion_tokens")) == [
        (200, 5), (200, 5), (503, 0)]


def test_unverified_worker_gets_no_shared_traffic(v1, engine, deploy, carol_key):
    deploy(engine(), verified=False)
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5})
    assert (response.status_code, response.json()["error"]["code"]) == (503, "no_capacity")


def test_a_held_out_node_serves_no_shared_request(v1, engine, deploy, carol_key):
    """A node an operator holds for review, or whose GPU UUID another node holds, answers no
    shared /v1 request even though its cards were verified before."""
    held = deploy(engine())
    Node.objects.filter(pk=held.node_id).update(uuid_conflict=True)
    pool.POOL.invalidate()
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5})
    assert (response.status_code, response.json()["error"]["code"]) == (503, "no_capacity")


def test_load_is_shared_between_processes_through_redis(settings):
    pool.INFLIGHT.clear()
    pool.INFLIGHT[7] = 3
    mine = pool.load_exchange(dict(pool.INFLIGHT))
    assert mine[7] >= 3
    # Another process's counts, as it publishes them.
    r = redis_client()
    r.hset("rigshare:routing:load:other", mapping={"7": 2, "_": 0})
    r.expire("rigshare:routing:load:other", 10)
    r.sadd("rigshare:routing:procs", "other")
    assert pool.load_exchange(dict(pool.INFLIGHT))[7] == mine[7] + 2
    r.delete("rigshare:routing:load:other")  # gone: forgotten on the next exchange
    assert pool.load_exchange(dict(pool.INFLIGHT))[7] == mine[7]
    pool.INFLIGHT.clear()


def test_the_pool_refreshes_itself_on_the_event_loop(deploy):
    calls = []

    def builder(previous, generation):
        calls.append(generation)
        return pool.refreshed(previous, generation)

    holder = pool.Pool(builder=builder, refresh_s=0.05)

    async def run():
        first = await holder.current()
        await asyncio.sleep(0.3)
        return first, holder.snapshot

    first, later = asyncio.run(run())
    assert later.generation > first.generation and len(calls) >= 3


# --- from the agents' reports, and the platform's own health check ---

def test_heartbeats_create_and_retire_deployments(api, bob):
    from tests.marketplace.test_agent_api import beat, enroll, report

    enrolled = enroll(api, bob)
    served = {"id": "Qwen/Qwen3-27B", "engine": "vllm", "max_context": 65_536,
              "quantization": "awq-int4"}
    engine = {"url": "http://127.0.0.1:8000", "reachable": True, "models": [served["id"]],
              "error": None, "served": [served]}
    assert beat(api, enrolled["credential"], report(engine=engine)).status_code == 200
    row = Deployment.objects.get()
    assert (row.node_id, row.engine, row.max_context, row.quantization, row.reported) == (
        enrolled["node_id"], "vllm", 65_536, "awq-int4", True)
    engine |= {"models": [], "served": []}
    beat(api, enrolled["credential"], report(engine=engine))
    assert Deployment.objects.get().reported is False
    engine |= {"models": [served["id"]], "served": [served]}
    beat(api, enrolled["credential"], report(engine=engine))
    assert Deployment.objects.get().reported is True and Deployment.objects.count() == 1


def test_an_old_agent_reporting_ids_only_still_makes_deployments(bob):
    node = NodeFactory(owner=bob, engine_url="http://x", engine_reachable=True,
                       engine_models=["m1"], engine_served=[])
    services.deployments_sync(node_id=node.pk)
    row = Deployment.objects.get()
    assert (row.engine_model_id, row.engine, row.max_context) == ("m1", "", None)


def test_two_heartbeats_of_one_node_at_once_make_one_deployment(bob):
    """An agent's retry overlapping its first try: both sync the node's deployments at once;
    the second waits for the first instead of failing on the unique (node, model)."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    def sync(node_id):
        try:
            return services.deployments_sync(node_id=node_id)
        finally:
            connection.close()

    for _ in range(15):
        node = NodeFactory(owner=bob, engine_url="http://x", engine_reachable=True,
                           engine_models=["m1", "m2"], engine_served=[])
        with ThreadPoolExecutor(4) as pool_:
            answers = list(pool_.map(sync, [node.pk] * 4))
        assert len({tuple(a) for a in answers}) == 1
        assert Deployment.objects.filter(node=node).count() == 2


def test_health_check_takes_a_dead_engine_out_and_brings_it_back(engine, deploy):
    alive = deploy(engine())
    dead = deploy("http://127.0.0.1:9")
    now = timezone.now()
    for _ in range(services.UNHEALTHY_AFTER):
        results = services.deployments_check_health(now=now)
    assert results[alive.node_id] == "" and results[dead.node_id]
    alive.refresh_from_db()
    dead.refresh_from_db()
    assert alive.healthy and not dead.healthy and dead.health_failures == 2
    assert workers(pool.build()) == [alive.pk]
    # fleetsim's engine takes no key: the check saw it serve a request without one.
    assert Node.objects.get(pk=alive.node_id).engine_key_enforced is False
    assert Node.objects.get(pk=dead.node_id).engine_key_enforced is None
    Node.objects.filter(pk=dead.node_id).update(engine_url=alive.node.engine_url,
                                                engine_connect_url=alive.node.engine_url)
    services.deployments_check_health()
    dead.refresh_from_db()
    assert dead.healthy and dead.health_failures == 0


def test_metrics_count_requests_tokens_and_the_pool(v1, engine, deploy, carol_key, settled,
                                                    settings):
    deployment = deploy(engine())
    assert post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 7}
                ).status_code == 200
    settled()
    base = v1.removesuffix("/v1")
    text = httpx.get(base + "/metrics").text  # from this machine: allowed without a token
    ref = f'worker="deployment:{deployment.pk}"'
    assert any(line.startswith("rigshare_requests_total{") and ref in line
               and 'status="200"' in line and line.endswith(" 1.0")
               for line in text.splitlines())
    assert any(line.startswith("rigshare_tokens_total{") and 'kind="completion"' in line
               and ref in line and line.endswith(" 7.0") for line in text.splitlines())
    assert "rigshare_ttft_seconds_bucket" in text and "rigshare_pool_workers{" in text
    settings.RIGSHARE_METRICS_TOKEN = "s3cret"
    assert httpx.get(base + "/metrics").status_code == 403
    assert httpx.get(base + "/metrics", headers={"Authorization": "Bearer s3cret"}
                     ).status_code == 200


def test_models_marks_what_can_be_served_now(v1, engine, deploy, carol_key):
    Model.objects.create(name="idle-model", context_length=4096)
    from billing.models import ModelPrice

    ModelPrice.objects.create(model="idle-model", input_micros_per_mtok=1,
                              output_micros_per_mtok=1, effective_at=timezone.now())
    deploy(engine())  # (makes the server read the pool again)
    data = httpx.get(v1 + "/models", headers={"Authorization": f"Bearer {carol_key}"}).json()
    assert {m["id"]: m["available"] for m in data["data"]} == {"idle-model": False,
                                                               MODEL: True}


def test_a_database_outage_serves_the_last_snapshot_or_answers_503(monkeypatch, deploy):
    deploy("http://a")
    calls = []

    def failing(previous, generation):
        calls.append(generation)
        raise RuntimeError("database away")

    holder = pool.Pool(refresh_s=60)

    async def run():
        first = await holder.current()
        holder.builder = failing
        holder.snapshot = pool.Snapshot(**{**first.__dict__, "built_at": 0.0})  # too old
        kept = await holder.current()
        holder.snapshot = None
        try:
            await holder.current()
        except pool.PoolUnavailable:
            return first, kept, True
        return first, kept, False

    first, kept, refused = asyncio.run(run())
    assert kept.version == first.version and refused and len(calls) >= 2
