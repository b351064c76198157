"""What goes wrong between the proxy and a worker: before the first byte (retry on the next
worker), after it (an error event, billed for what was delivered), and a client that leaves."""

import asyncio
import json
import threading
import time

import httpx
import pytest
from django.db import OperationalError

from billing.models import Charge, Hold
from fleetsim.server import ServerThread
from routing import balancer
from routing.models import RequestLog
from routing.pool import POOL
from routing.retry import BREAKER, POLICY
from tests.routing.conftest import MODEL
from tests.routing.test_api import CHAT, post, sdk

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def first_wins(monkeypatch):
    """The balancer ranks deployments by id: the first deployed serves, the next is the retry."""
    monkeypatch.setattr(balancer, "_scores",
                        lambda key, fleet: -fleet.cols["id"].astype(float))


def events(response: httpx.Response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_worker_dying_mid_stream_ends_with_an_error_event_and_bills_what_was_delivered(
        v1, engine, deploy, carol_key, settled):
    deployment = deploy(engine(die_after_tokens=5))
    with httpx.stream("POST", v1 + "/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {carol_key}"},
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 50,
                            "stream": True}) as response:
        assert response.status_code == 200
        got = events(response)
    assert got[-1] == "[DONE]"
    assert got[-2]["error"]["code"] == "upstream_disconnected"
    content = [e for e in got[:-2] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(content) == 5
    settled()
    charge = Charge.objects.get()
    assert (charge.completion_tokens, charge.estimated) == (5, True)
    assert charge.prompt_tokens > 0  # the prompt is billed as estimated, never 0
    assert charge.worker == f"node:{deployment.node_id}"
    assert RequestLog.objects.get().error_code == "upstream_disconnected"


def test_the_sdk_sees_a_mid_stream_death_as_an_error(v1, engine, deploy, carol_key, settled):
    import openai

    deploy(engine(die_after_tokens=3))
    stream = sdk(v1, carol_key).chat.completions.create(model=MODEL, messages=CHAT,
                                                        max_tokens=40, stream=True)
    with pytest.raises(openai.APIError, match="stopped mid-stream"):
        for _ in stream:
            pass
    settled()
    assert Charge.objects.get().completion_tokens == 3


def test_client_leaving_mid_stream_stops_the_worker_and_is_billed_for_what_it_got(
        v1, engine, deploy, carol_key, settled):
    url = engine("rtx-pro-6000", time_scale=1)  # ~100 tok/s: plenty left when the client goes
    deploy(url)
    received = 0
    with httpx.stream("POST", v1 + "/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {carol_key}"},
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 2000,
                            "stream": True}) as response:
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                received += 1
            if received == 3:
                break
    settled()
    charge = Charge.objects.get()
    assert charge.estimated and 3 <= charge.completion_tokens < 100
    assert RequestLog.objects.get().status == 499
    # The engine was told: its request stopped running.
    deadline = time.monotonic() + 5
    while "vllm:num_requests_running{" in (text := httpx.get(url + "/metrics").text) and \
            _running(text) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(text) == 0


def _running(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running in the engine's metrics")


def test_unreachable_worker_is_retried_on_the_next_then_left_alone(v1, engine, deploy,
                                                                   carol_key, first_wins,
                                                                   settled):
    dead = deploy("http://127.0.0.1:9")  # nothing listens there
    alive = deploy(engine())
    for _ in range(POLICY.breaker_failures + 1):
        response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5})
        assert response.status_code == 200, response.text
        assert response.headers["x-rigshare-worker"] == f"deployment:{alive.pk}"
    settled()
    attempts = list(RequestLog.objects.order_by("created_at").values_list("attempts", flat=True))
    # Three failures open the dead worker's circuit: the fourth request goes straight on.
    assert attempts == [2, 2, 2, 1]
    assert BREAKER.is_open(dead.pk)
    assert Charge.objects.count() == 4 and not Hold.objects.filter(status="pending").exists()


async def _fails(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"error": "overloaded"}'})


@pytest.mark.parametrize("stream", [False, True])
def test_5xx_before_the_first_byte_is_retried(v1, engine, deploy, carol_key, first_wins,
                                              stream, settled):
    with ServerThread(_fails) as failing:
        deploy(failing.url)
        alive = deploy(engine())
        response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                        "stream": stream})
        assert response.status_code == 200
        assert response.headers["x-rigshare-worker"] == f"deployment:{alive.pk}"
        settled()
    assert Charge.objects.get().completion_tokens == 5


async def _dies_after_its_headers(scope, receive, send):
    """An engine that accepted the stream (its 200 went out) and died before a first token."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    raise RuntimeError("the engine died while reading the prompt")


def test_engine_dying_after_its_200_ends_the_stream_with_an_error_not_a_retry(
        v1, engine, deploy, carol_key, first_wins, settled):
    # The stream's headers went out with the engine's 200 (see the next test): from there on
    # the client has an answer that names its worker, so there is no quiet retry elsewhere.
    with ServerThread(_dies_after_its_headers) as dying:
        dead = deploy(dying.url)
        deploy(engine())
        with httpx.stream("POST", v1 + "/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {carol_key}"},
                          json={"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["x-rigshare-worker"] == f"deployment:{dead.pk}"
            got = events(response)
        settled()
    assert got[-1] == "[DONE]" and len(got) == 2
    assert got[0]["error"]["code"] == "upstream_disconnected"
    charge = Charge.objects.get()
    assert (charge.completion_tokens, charge.estimated) == (0, True)
    assert charge.prompt_tokens > 0  # the engine may have read the prompt: billed as a cut
    log_row = RequestLog.objects.get()
    assert (log_row.attempts, log_row.error_code) == (1, "upstream_disconnected")
    assert BREAKER.failures == {dead.pk: 1}


class _SlowFirstToken:
    """An engine that sends its headers at once and its first token when the test says."""

    def __init__(self):
        self.go = threading.Event()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        while not self.go.is_set():
            await asyncio.sleep(0.01)
        chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "engine-model",
                 "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
        usage = {"id": "c1", "object": "chat.completion.chunk", "model": "engine-model",
                 "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1,
                                          "total_tokens": 8}}
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (chunk, usage))
        await send({"type": "http.response.body", "body": body + b"data: [DONE]\n\n"})


def test_stream_headers_reach_the_client_while_the_engine_reads_the_prompt(
        v1, deploy, carol_key, settled):
    slow = _SlowFirstToken()
    with ServerThread(slow) as server:
        worker = deploy(server.url)
        with httpx.stream("POST", v1 + "/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {carol_key}"},
                          json={"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                "stream": True}) as response:
            # No token yet: the engine is still "prefilling".
            assert not slow.go.is_set()
            assert response.status_code == 200
            assert response.headers["x-rigshare-worker"] == f"deployment:{worker.pk}"
            slow.go.set()
            got = events(response)
        settled()
    assert got[0]["choices"][0]["delta"]["content"] == "Hi" and got[-1] == "[DONE]"
    charge = Charge.objects.get()
    assert (charge.prompt_tokens, charge.completion_tokens, charge.estimated) == (7, 1, False)


@pytest.mark.parametrize("stream", [False, True])
def test_both_workers_failing_is_502_and_the_hold_goes_back(v1, deploy, carol_key, stream,
                                                            settled):
    # A refused connection fails within a millisecond, before the reserve may be done: the
    # hold it then makes is given back all the same.
    deploy("http://127.0.0.1:9")
    deploy("http://127.0.0.1:11")
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                    "stream": stream})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"
    settled()
    assert Hold.objects.get().status == "released" and not Charge.objects.exists()


def test_context_rejection_by_the_engine_is_retried_on_a_worker_that_holds_it(
        v1, engine, deploy, carol_key, first_wins, settled):
    # The first claims more context than its engine really has (32,768).
    deploy(engine("rtx-4090", time_scale=400), max_context=262_144)
    big = deploy(engine("rtx-pro-6000", time_scale=400))
    long = [{"role": "user", "content": "word " * 10_000}]
    response = post(v1, carol_key, {"model": MODEL, "messages": long, "max_tokens": 23_000})
    assert response.status_code == 200, response.text
    assert response.headers["x-rigshare-worker"] == f"deployment:{big.pk}"
    settled()
    assert RequestLog.objects.get().attempts == 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("refusing", ["wants another engine key", "serves another model"])
def test_an_engine_refusing_the_platform_is_the_workers_failure_not_the_clients(
        v1, engine, deploy, carol_key, first_wins, stream, refusing, settled):
    # An engine that wants an engine key the platform does not hold for it answers 401; one
    # that serves another model than its deployment says, 404: neither is the client's doing.
    if refusing == "wants another engine key":
        bad = deploy(engine(api_key="rsk_not-the-one-the-platform-sends"))
    else:
        bad = deploy(engine("rtx-pro-6000-llama8b"), engine_model="Qwen/Qwen3-27B")
    alive = deploy(engine())
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                    "stream": stream})
    assert response.status_code == 200, response.text
    assert response.headers["x-rigshare-worker"] == f"deployment:{alive.pk}"
    settled()
    assert RequestLog.objects.get().attempts == 2 and BREAKER.failures == {bad.pk: 1}
    assert Charge.objects.get().completion_tokens == 5

    # With no other worker: an upstream error; the client's key and request were good.
    alive.delete()
    POOL.invalidate()
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                    "stream": stream})
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error"
    settled()


async def _refuses(scope, receive, send):
    """vLLM's answer to a request it will not run (its error shape, not OpenAI's)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({
        "object": "error", "message": "top_k must be -1 (disable), or at least 1, got -5.",
        "type": "BadRequestError", "param": None, "code": 400}).encode()})


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusing_the_request_itself_passes_its_error_and_bills_nothing(
        v1, deploy, carol_key, stream, settled):
    with ServerThread(_refuses) as refusing:
        deploy(refusing.url)
        response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                        "top_k": -5, "stream": stream})
        assert response.status_code == 400
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] == "top_k must be -1 (disable), or at least 1, got -5."
        settled()
    assert Hold.objects.get().status == "released" and not Charge.objects.exists()
    assert not BREAKER.failures  # the client's mistake is not the worker's failure


@pytest.mark.parametrize("stream", [False, True])
def test_a_settle_that_fails_leaves_the_usage_to_the_journal(v1, engine, deploy, carol_key,
                                                             monkeypatch, settled, stream):
    from billing import metering, usage

    real, failures = metering.settle, []

    def away(**kwargs):  # on the first try and on a fresh connection
        if len(failures) < 2:
            failures.append(1)
            raise OperationalError("the database is away")
        return real(**kwargs)

    monkeypatch.setattr(metering, "settle", away)
    deploy(engine())
    response = post(v1, carol_key, {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                    "stream": stream})
    assert response.status_code == 200
    settled()
    assert failures == [1, 1] and Hold.objects.get().status == "pending"
    request_id = response.headers["X-Request-Id"]
    assert usage.recorded([request_id])[request_id].final
    assert usage.drain() == 1  # the database answers again
    assert Charge.objects.get().completion_tokens == 5
    assert Hold.objects.get().status == "settled"
    assert usage.recorded([request_id]) == {}


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_while_the_reserve_runs_still_settles_its_hold(
        v1, engine, deploy, carol_key, monkeypatch, stream, settled):
    from billing import metering

    real = metering.reserve

    def slow_reserve(**kwargs):  # the database slow to answer: the client gives up first
        time.sleep(1.0)
        return real(**kwargs)

    monkeypatch.setattr(metering, "reserve", slow_reserve)
    deploy(engine())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(v1 + "/chat/completions", timeout=0.3,
                   headers={"Authorization": f"Bearer {carol_key}"},
                   json={"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": stream})
    time.sleep(1.0)  # the reserve ends after the client left
    settled()
    # The engine may have read the prompt: billed as estimated, as a cut stream is; the hold
    # is closed, not left to expire.
    assert Hold.objects.get().status == "settled"
    charge = Charge.objects.get()
    assert (charge.completion_tokens, charge.estimated) == (0, True) and charge.prompt_tokens > 0
    assert RequestLog.objects.get().status == 499
