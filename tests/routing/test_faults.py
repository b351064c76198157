"""Fault injection on a production-like deployment (tests/deployment.py): uvicorn with two
worker processes, a Celery worker with beat, a Redis of the test's own that persists, and
PostgreSQL behind a gate. Under streaming load, PostgreSQL is cut and opened again, or Redis
is killed and started again. What a client sees: 200, or a 503 in OpenAI's shape with
Retry-After, never a plain 500; service back within seconds. What the ledger sees: every
stream that completed is charged once, at its usage, and nothing is left pending or
unbalanced."""

import asyncio
import collections
import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from django.db import connection

from billing.models import Charge, Hold
from billing.selectors import ledger_problems
from tests.deployment import Deployment
from tests.routing.conftest import MODEL
from tests.routing.test_api import CHAT

pytestmark = pytest.mark.django_db(transaction=True)

CONCURRENCY = 12
BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 48, "stream": True,
        "stream_options": {"include_usage": True}}


@dataclass
class Result:
    started: float
    finished: float
    status: int | None  # None: no HTTP answer at all
    request_id: str = ""
    done: bool = False  # the stream ended with [DONE]
    usage: dict | None = None
    error: dict | None = None
    retry_after: str | None = None


@pytest.fixture
def deployment(transactional_db, pg_gate, redis_server, tmp_path):
    deployment = Deployment(database=connection.settings_dict["NAME"], gate=pg_gate,
                            redis_url=redis_server.url, directory=tmp_path, celery=True)
    deployment.start()
    yield deployment
    deployment.stop()


async def _stream_once(client: httpx.AsyncClient, url: str, key: str) -> Result:
    started = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=BODY,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            result = Result(started, 0.0, resp.status_code,
                            resp.headers.get("x-request-id", ""),
                            retry_after=resp.headers.get("retry-after"))
            if resp.status_code != 200:
                try:
                    result.error = json.loads(await resp.aread())["error"]
                except (ValueError, KeyError, TypeError):
                    result.error = {"plain": True}
            else:
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        result.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        result.usage = chunk.get("usage") or result.usage
                        result.error = chunk.get("error") or result.error
    except httpx.HTTPError as exc:
        result = Result(started, 0.0, None, error={"transport": type(exc).__name__})
    result.finished = time.monotonic()
    return result


def _load(url: str, key: str, seconds: float) -> list[Result]:
    async def drive():
        results: list[Result] = []
        async with httpx.AsyncClient(timeout=30) as client:
            async def loop():
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    result = await _stream_once(client, url, key)
                    results.append(result)
                    if result.status != 200:
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
        return results

    return asyncio.run(drive())


def _under_load(url: str, key: str, seconds: float, fault) -> list[Result]:
    """Drive the load for `seconds` while `fault()` runs beside it."""
    results: list[Result] = []
    driver = threading.Thread(target=lambda: results.extend(_load(url, key, seconds)))
    driver.start()
    fault()
    driver.join()
    return results


def _settled(timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while Hold.objects.filter(status=Hold.Status.PENDING).exists():
        if time.monotonic() > deadline:
            pending = list(Hold.objects.filter(status=Hold.Status.PENDING)
                           .values_list("request_id", flat=True))
            raise AssertionError(f"holds still pending: {pending}")
        time.sleep(0.25)


def _check_money(results: list[Result]) -> None:
    """Every completed stream charged once at its usage; the ledger balanced."""
    completed = [r for r in results if r.status == 200 and r.done and r.usage]
    charges = {c.request_id: c for c in Charge.objects.all()}
    for result in completed:
        charge = charges.get(result.request_id)
        assert charge is not None, f"{result.request_id} delivered {result.usage}, unbilled"
        assert (charge.prompt_tokens, charge.completion_tokens) == (
            result.usage["prompt_tokens"], result.usage["completion_tokens"])
        assert not charge.estimated
    assert Charge.objects.count() == len(charges)  # one per request id
    assert ledger_problems() == []


def _check_answers(results: list[Result]) -> collections.Counter:
    statuses = collections.Counter(r.status for r in results)
    assert set(statuses) <= {200, 503}, statuses
    for result in results:
        if result.status == 503:
            assert result.retry_after and set(result.error) == {"message", "type", "param",
                                                                "code"}, result
    return statuses


def _recovery_s(results: list[Result], back_at: float) -> float:
    """From the service's return to the first request started after it that succeeded."""
    ok = [r.finished for r in results if r.started >= back_at and r.status == 200 and r.done]
    assert ok, "no request succeeded after the service came back"
    return min(ok) - back_at


def _outage(deployment, key: str, seconds: float, down, up, down_for: float):
    """Streaming load for `seconds`; 2.5 s in, `down()`, then `up()` `down_for` s later. Checks
    what the clients saw and the money; returns the results, the status counts, the seconds
    from `up()` to the first success, and the streams that ended while the service was down."""
    times = {}

    def fault():
        time.sleep(2.5)
        down()
        times["down"] = time.monotonic()
        time.sleep(down_for)
        up()
        times["up"] = time.monotonic()

    results = _under_load(deployment.url, key, seconds, fault)
    statuses = _check_answers(results)
    recovery = _recovery_s(results, times["up"])
    _settled()
    _check_money(results)
    during = [r for r in results if r.status == 200 and r.done
              and times["down"] < r.finished < times["up"]]
    return results, statuses, recovery, during


def test_postgresql_cut_under_streaming_load(deployment, pg_gate, engine, deploy, carol_key):
    deploy(engine(time_scale=2))
    # Longer than any settle retry: only the usage journal can bill what ends meanwhile.
    results, statuses, recovery, during = _outage(deployment, carol_key, 16, pg_gate.cut,
                                                  pg_gate.open, down_for=8)
    print(f"\nPostgreSQL cut 8 s: {len(results)} requests, statuses {dict(statuses)}, every "
          f"completed stream charged once ({len(during)} ended while the database was away), "
          f"service back {recovery:.2f} s after the database")
    assert during, "no stream ended during the outage: the test proved nothing"
    assert statuses[503], "requests during the outage should have been refused"
    assert recovery < 5.0


def test_redis_killed_under_streaming_load(deployment, redis_server, engine, deploy,
                                           carol_key):
    deploy(engine(time_scale=2))
    results, statuses, recovery, during = _outage(deployment, carol_key, 12, redis_server.kill,
                                                  redis_server.start, down_for=4)
    print(f"\nRedis killed 4 s: {len(results)} requests, statuses {dict(statuses)}, every "
          f"completed stream charged once ({len(during)} ended while Redis was away), first "
          f"success {recovery:.2f} s after Redis returned")
    assert during, "no stream ended while Redis was away: the test proved nothing"
    assert recovery < 5.0
