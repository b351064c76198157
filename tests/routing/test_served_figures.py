"""Live figures from served traffic: requests through the real /v1 proxy (uvicorn on a thread,
fleetsim engines) add to their deployment's buckets as the request log is written, and the
minute's refresh turns the buckets into each card's and each model's figures over the last hour
and day, shown on the catalog, the rent page, the provider dashboard, /models/ and /v1/models."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import openai
import psycopg
import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import Hold
from fleetsim.profiles import get_profile
from marketplace.models import Card
from routing import requestlog, served, traffic
from routing.models import RequestLog, TrafficBucket
from tests.factories import CardFactory, ListingFactory, NodeFactory
from tests.routing.conftest import MODEL, seen_rate, streamed

pytestmark = pytest.mark.django_db(transaction=True)

SCALE = 4  # slow enough that a stream's decode time is far above the event loop's noise
TOKENS = 64


def sdk(v1, key):
    return openai.OpenAI(base_url=v1, api_key=key, max_retries=0, timeout=60)


def stream(client) -> int:
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about GPUs."}],
        max_tokens=TOKENS, stream=True, stream_options={"include_usage": True})
    return sum(1 for _ in chunks)


def figures_of(card: Card) -> dict:
    card.refresh_from_db()
    (entry,) = card.served["models"]
    return entry


def test_served_traffic_becomes_each_cards_live_figures(v1, carol_key, engine, deploy, settled,
                                                        client, bob):
    profile = get_profile("rtx-pro-6000")
    deployment = deploy(engine("rtx-pro-6000", time_scale=SCALE))
    client_ = sdk(v1, carol_key)
    alone = [streamed(client_, max_tokens=TOKENS) for _ in range(5)]  # one at a time
    client_.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=TOKENS)  # not streamed
    together = threading.Barrier(6)  # six at once, even on a crowded machine

    def one_of_six(_):
        together.wait(30)
        return streamed(client_, max_tokens=TOKENS)

    with ThreadPoolExecutor(6) as pool:
        six = list(pool.map(one_of_six, range(6)))
    settled()

    assert served.served_figures_refresh()["deployments"] == 1
    card = deployment.node.cards.get()
    ListingFactory(card=card)
    entry = figures_of(card)
    hour = entry["hour"]
    assert (entry["model"], hour["requests"], hour["errors"], hour["streams"]) == (MODEL, 12, 0,
                                                                                    11)
    bands = {b["band"]: b for b in hour["bands"]}
    assert bands[1]["requests"] == 6 and bands[1]["streams"] == 5
    assert sum(b["streams"] for b in hour["bands"]) == 11
    # Each band's speed per stream is what its clients saw from the first token on. Alone, a
    # stream decodes near the card's single-stream speed (scaled as the engine is: its clock
    # runs SCALE times fast and falls behind on a crowded machine, so the bound below is loose).
    assert 0.75 < bands[1]["tokens_per_s"] / seen_rate(alone) < 1.33
    assert bands[1]["tokens_per_s"] < 1.25 * profile.single_stream_tps * SCALE
    assert bands[2]["streams"] == 6
    assert 0.75 < bands[2]["tokens_per_s"] / seen_rate(six) < 1.33
    assert hour["ttft_p50_ms"] is not None and hour["ttft_p95_ms"] >= hour["ttft_p50_ms"]
    assert hour["uptime_pct"] == 100.0
    assert entry["day"]["requests"] == 12
    assert card.served_tokens_per_s == hour["tokens_per_s"]

    # The rent page and the provider's dashboard show them; the catalog sorts by them.
    page = client.get(f"/cards/{card.pk}/").content.decode()
    assert 'id="served"' in page and f"{bands[1]['tokens_per_s']:g}" in page
    client.force_login(bob)
    assert "tok/s per stream" in client.get("/provider/").content.decode()
    # /v1/models and /models/: the model's figures, summed over its workers.
    listed = httpx.get(f"{v1}/models", headers={"Authorization": f"Bearer {carol_key}"}).json()
    model_served = listed["data"][0]["x_rigshare"]["served"]
    assert model_served["hour"]["requests"] == 12
    assert model_served["hour"]["tokens_per_s"] == hour["tokens_per_s"]
    assert "12 requests" in client.get("/models/").content.decode()


def test_a_worker_that_fails_counts_errors_and_the_window_forgets_old_traffic(
        v1, carol_key, deploy, settled):
    # An engine nobody answers on: each request fails on it (no other worker to retry on).
    deployment = deploy("http://127.0.0.1:9")
    client_ = sdk(v1, carol_key)
    for _ in range(3):
        with pytest.raises(openai.APIStatusError):
            stream(client_)
    settled()
    served.served_figures_refresh()
    hour = figures_of(deployment.node.cards.get())["hour"]
    assert (hour["requests"], hour["errors"], hour["error_pct"]) == (3, 3, 100.0)
    assert hour["tokens_per_s"] is None

    # Two hours on: the hour's window is empty, the day's still holds them.
    later = timezone.now() + timedelta(hours=2)
    served.served_figures_refresh(now=later)
    entry = figures_of(deployment.node.cards.get())
    assert entry["hour"]["requests"] == 0 and entry["day"]["requests"] == 3
    assert TrafficBucket.objects.filter(span_s=traffic.FIVE_MINUTES).count() == 0
    # Two days on: nothing is left, and the card says so.
    served.served_figures_refresh(now=later + timedelta(days=2))
    card = deployment.node.cards.get()
    assert card.served == {} and card.served_tokens_per_s is None
    assert not TrafficBucket.objects.exists()


def test_a_streams_time_ends_with_its_last_token_not_with_the_billing_after_it(
        v1, carol_key, engine, deploy, settled):
    """The settle that follows a stream waits here on a lock (a busy database): the stream's
    latency and decode time, and so its card's speed, stay what the client saw."""
    deployment = deploy(engine("rtx-pro-6000", time_scale=SCALE))
    chunks = sdk(v1, carol_key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about GPUs."}],
        max_tokens=TOKENS, stream=True)
    started = time.monotonic()
    with psycopg.connect(_dsn()) as db:
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                # The request's hold is in: every hold is locked until well after the end.
                db.execute(f"SELECT 1 FROM {Hold._meta.db_table} FOR UPDATE")
                break
        for _ in chunks:
            pass
        seen_ms = (time.monotonic() - started) * 1000
        time.sleep(0.8)
        db.rollback()
    settled()
    row = RequestLog.objects.get(deployment_id=deployment.pk)
    assert row.completion_tokens == TOKENS and row.ttft_ms is not None
    assert row.latency_ms < seen_ms + 200 < 800
    served.served_figures_refresh()
    (band,) = figures_of(deployment.node.cards.get())["hour"]["bands"]
    assert band["tokens_per_s"] > (TOKENS - 1) / (seen_ms / 1000)


def _dsn() -> str:
    s = connection.settings_dict
    return f"host={s['HOST']} port={s['PORT'] or 5432} dbname={s['NAME']} user={s['USER']}"


def _rows(deployment_id: int, n: int, **kw) -> list[dict]:
    now = timezone.now()
    return [dict(request_id=f"r{deployment_id}-{i}-{threading.get_ident()}", created_at=now,
                 endpoint="chat", model=MODEL, deployment_id=deployment_id, stream=True,
                 status=200, attempts=1, prompt_tokens=10, completion_tokens=101,
                 ttft_ms=100.0, latency_ms=1100.0, concurrency=1, **kw) for i in range(n)]


def test_router_processes_writing_the_same_buckets_at_once_lose_nothing(deploy):
    deployment = deploy("http://127.0.0.1:9")
    barrier = threading.Barrier(4)

    def writer(_):
        try:
            barrier.wait()
            for _ in range(10):
                requestlog.write(_rows(deployment.pk, 25))
        finally:
            connections.close_all()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(writer, range(4)))
    sums = {span: (r, s, t) for span, r, s, t in TrafficBucket.objects.values_list(
        "span_s", "requests", "streams", "decode_tokens")}
    assert sums == {traffic.FIVE_MINUTES: (1000, 1000, 100_000),
                    traffic.HOUR: (1000, 1000, 100_000)}


def test_the_catalog_sorts_by_served_speed_in_constant_queries(client, deploy):
    fast, slow, idle = (deploy("http://127.0.0.1:9") for _ in range(3))
    for deployment, ms in ((fast, 1100.0), (slow, 4100.0)):
        requestlog.write([r | {"latency_ms": ms} for r in _rows(deployment.pk, 20)])
    served.served_figures_refresh()
    for d in (fast, slow, idle):
        ListingFactory(card=d.node.cards.get(), is_listed=True)
    order = [r["id"] for r in client.get("/api/cards/", {"sort": "-served"}).json()["results"]]
    cards = [d.node.cards.get().pk for d in (fast, slow, idle)]
    assert order == cards
    first = client.get("/api/cards/", {"sort": "-served"}).json()["results"][0]
    assert first["served"]["tokens_per_s"] == 100.0
    assert first["served"]["models"][0]["hour"]["requests"] == 20
    assert "tok/s per stream" in client.get("/", {"sort": "-served"}).content.decode()

    # More cards with figures cost the page no more queries.
    with CaptureQueriesContext(connection) as few:
        client.get("/", {"sort": "-served"})
    for _ in range(6):
        node = NodeFactory()
        ListingFactory(card=CardFactory(node=node), is_listed=True)
        more = deploy("http://127.0.0.1:9")
        requestlog.write(_rows(more.pk, 3))
        ListingFactory(card=more.node.cards.get(), is_listed=True)
    served.served_figures_refresh()
    with CaptureQueriesContext(connection) as many:
        client.get("/", {"sort": "-served"})
    assert len(many) == len(few)
