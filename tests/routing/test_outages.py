"""Redis or PostgreSQL trouble never becomes a plain 500: with Redis killed, /v1 goes on (keys
checked in PostgreSQL, rate limits uncounted, each process its own in-flight counts) and
recovers when it is back; a failure /v1 cannot get around is a 503 in OpenAI's shape with
Retry-After; the site's pages and REST API answer a database outage with a 503 too."""

import asyncio
import time

import pytest
from django.db import OperationalError

from billing import keys, metering, ratelimit
from billing.models import Charge
from config import redis as config_redis
from routing import pool as routing_pool
from tests.deployment import PrivateRedis
from tests.routing.conftest import MODEL
from tests.routing.test_api import CHAT, post

pytestmark = pytest.mark.django_db(transaction=True)


def _use_redis(settings, url: str) -> None:
    """Point every Redis client of this process at `url`, as a process started with it."""
    settings.REDIS_URL = url
    settings.CACHES = {"default": settings.CACHES["default"] | {"LOCATION": url}}
    config_redis.redis_client.cache_clear()
    ratelimit._script.cache_clear()
    config_redis._async_clients.clear()
    keys.near_cache_clear()


@pytest.fixture
def private_redis(settings):
    redis = PrivateRedis()
    redis.start()
    real = settings.REDIS_URL
    _use_redis(settings, redis.url)
    yield redis
    if redis.process.poll() is None:
        redis.kill()
    _use_redis(settings, real)


def test_a_redis_restart_under_traffic_costs_no_request(v1, engine, deploy, carol_key, settled,
                                                        private_redis):
    deploy(engine())
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5}
    statuses = [post(v1, carol_key, body | {"stream": i % 2 == 0}).status_code
                for i in range(4)]
    private_redis.kill()
    started = time.monotonic()
    while time.monotonic() - started < 3:  # Redis away
        statuses.append(post(v1, carol_key, body).status_code)
    private_redis.start()  # back, empty: every pooled connection to it is dead
    back = time.monotonic()
    while time.monotonic() - back < 2:
        statuses.append(post(v1, carol_key, body | {"stream": True}).status_code)
    settled()
    assert set(statuses) == {200}, statuses
    assert Charge.objects.count() == len(statuses)  # every request billed, once


def test_the_fallbacks_while_redis_is_away(carol, carol_key, settings, private_redis):
    private_redis.kill()
    info = keys.api_key_authenticate(carol_key)  # PostgreSQL answers
    assert info is not None and info.user_id == carol.pk
    assert asyncio.run(keys.api_key_cached(carol_key)) == (False, None)
    assert ratelimit.take(key_id=info.key_id, requests_limit=1, tokens_limit=None,
                          tokens=1) is None  # uncounted, not a failure
    assert routing_pool.load_exchange({7: 2}) == {7: 2}  # its own counts


def test_a_fresh_key_under_a_burst_wants_no_more_connections_than_the_pool_has(carol_key):
    """200 requests at once on a key nobody has read yet: the pool waits for a free
    connection instead of failing with MaxConnectionsError."""
    async def burst():
        return await asyncio.gather(*(keys.api_key_cached(carol_key) for _ in range(400)))

    config_redis._async_clients.clear()
    answers = asyncio.run(burst())
    assert len(answers) == 400 and all(found in (True, False) for found, _ in answers)


def test_a_failure_v1_cannot_get_around_is_a_503_in_openais_shape(v1, engine, deploy, carol_key,
                                                                  monkeypatch, settled):
    deploy(engine())

    def database_away(**kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(metering, "reserve", database_away)
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5})
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "service_unavailable" and response.headers["X-Request-Id"]
    settled()


def test_no_worker_says_when_to_come_back(v1, model, carol_key):
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT})
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_capacity"
    assert response.headers["Retry-After"] == "1"


@pytest.mark.parametrize("path, kind", [("/", "text/html"), ("/api/cards/", "application/json")])
def test_pages_and_the_rest_api_answer_a_database_outage_with_a_503(client, monkeypatch, path,
                                                                    kind):
    from marketplace import selectors

    def database_away(*args, **kwargs):
        raise OperationalError("the database system is shutting down")

    monkeypatch.setattr(selectors, "cards_for_catalog", database_away)
    client.raise_request_exception = False
    response = client.get(path)
    assert response.status_code == 503 and response.headers["Retry-After"] == "2"
    assert response["Content-Type"].startswith(kind)


def test_a_bug_is_still_a_500(client, monkeypatch):
    from marketplace import selectors

    monkeypatch.setattr(selectors, "cards_for_catalog", lambda *a, **k: 1 / 0)
    client.raise_request_exception = False
    assert client.get("/").status_code == 500
