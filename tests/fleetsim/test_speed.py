"""The speed model: processor-shared decode, queueing, prefill and the prefix cache, faults."""

import asyncio
import json
import re
import time

import httpx
import pytest

from fleetsim.profiles import get_profile
from tests.fleetsim.test_server import metric

MODEL = get_profile("h200").model
TOKEN_CHUNK = re.compile(r'data: \{.*"(content|text)":"[^"]')


async def timed_stream(http: httpx.AsyncClient, url: str, payload: dict) -> dict:
    """Stream one request; return the time to the first token, to the last byte, and the
    number of content chunks."""
    start = time.perf_counter()
    ttft, chunks = None, 0
    async with http.stream("POST", url, json=payload | {"stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            # A chunk with a token in it; a regex is cheaper than parsing JSON, which would
            # slow the client down.
            if TOKEN_CHUNK.match(line):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
    return {"ttft": ttft, "total": time.perf_counter() - start, "chunks": chunks}


def run(coro):
    return asyncio.run(coro)


def completion(prompt: str = "Tell me a story.", max_tokens: int = 100) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}


def test_aggregate_throughput_follows_the_profile_curve(engine):
    """8 streams share the card: each is slower than one alone, together they are faster, in
    the proportion the published curve gives (2x RTX 4090: 94 tok/s alone, ~299 at 8)."""
    # Few chunks per second of wall time: the test must hold on a busy 2-core machine, where
    # Python's per-chunk work (server and client share this process) would skew the timing.
    scale, tokens = 4, 60
    url, _ = engine("2x-rtx-4090", time_scale=scale)
    p = get_profile("2x-rtx-4090")

    async def measure(n: int) -> float:
        async with httpx.AsyncClient(timeout=10) as http:
            # Open the connections first: connecting is not the engine's time.
            await asyncio.gather(*(http.get(url + "/health") for _ in range(n)))
            start = time.perf_counter()
            results = await asyncio.gather(*(
                timed_stream(http, url + "/v1/completions", completion(max_tokens=tokens))
                for _ in range(n)))
            elapsed = time.perf_counter() - start
        assert all(r["chunks"] == tokens for r in results)
        return n * tokens / elapsed / scale  # tok/s in the card's time

    # The best of three: a stall of this machine (another process, the VM's neighbours) only
    # ever makes a run slower, and one stall read 167 tok/s for 299 once.
    one = max(run(measure(1)) for _ in range(3))
    eight = max(run(measure(8)) for _ in range(3))
    # HTTP and the client's own work (same process, same GIL) cost a few percent.
    assert one == pytest.approx(p.aggregate_tps(1), rel=0.25)
    assert eight == pytest.approx(p.aggregate_tps(8), rel=0.25)
    assert eight / one == pytest.approx(p.aggregate_tps(8) / p.aggregate_tps(1), rel=0.2)


async def poll_metrics(http, url, want: dict, timeout=3.0) -> str:
    deadline = time.perf_counter() + timeout
    while True:
        text = (await http.get(url + "/metrics")).text
        if all(metric(text, k) == v for k, v in want.items()):
            return text
        if time.perf_counter() > deadline:
            raise AssertionError(f"metrics never reached {want}:\n{text}")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(("key", "limit", "running", "waiting"), [
    ("h200", 2, "vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("m4-max-llamacpp", None, "llamacpp:requests_processing", "llamacpp:requests_deferred"),
])
def test_requests_beyond_max_concurrency_wait_and_leave_when_the_client_goes(
        engine, key, limit, running, waiting):
    url, app = engine(key, time_scale=1, max_concurrency=limit)
    slots = app.engine.max_concurrency
    assert slots == (limit or 4)

    async def scenario():
        async with httpx.AsyncClient(timeout=10) as http:
            # Long answers at real speed: they are still running when we look.
            tasks = [asyncio.create_task(timed_stream(http, url + "/v1/completions",
                                                      completion(max_tokens=10_000)))
                     for _ in range(slots + 2)]
            await poll_metrics(http, url, {running: slots, waiting: 2})
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Disconnected clients free their slots and queue places, as vLLM aborts them.
            await poll_metrics(http, url, {running: 0, waiting: 0})

    run(scenario())


def test_prefix_cache_makes_a_repeated_long_prompt_fast(engine, client):
    """Fleet report: a repeated 13,000-token prompt, 7.2 s cold -> 1.6 s with prefix caching."""
    scale = 30  # cold: 5.6 s / 30, long enough that HTTP overhead does not blur the ratio
    url, _ = engine("rtx-pro-6000", time_scale=scale)
    prompt = " ".join(f"w{i % 997}" for i in range(13_000))

    async def ttft():
        async with httpx.AsyncClient(timeout=10) as http:
            r = await timed_stream(http, url + "/v1/completions", completion(prompt, 2))
            return r["ttft"]

    cold, warm = run(ttft()), run(ttft())
    expected_cold = 13_000 / get_profile("rtx-pro-6000").prefill_tps / scale  # 5.6 s / 50
    assert cold >= 0.9 * expected_cold
    assert warm < cold / 4
    text = client.get(url + "/metrics").text
    assert metric(text, "vllm:prefix_cache_queries_total") == 26_000
    assert metric(text, "vllm:prefix_cache_hits_total") >= 13_000 - 16


def test_llamacpp_slot_cache_forgets_after_other_conversations_take_every_slot(engine, client):
    """llama-server keeps one sequence per slot: a repeated prompt is cheap until four other
    prompts have passed through the four slots."""
    url, _ = engine("m4-max-llamacpp", time_scale=100)
    prompt = " ".join(f"w{i}" for i in range(3_000))  # 20 s of prefill on the Mac, /100

    def ttft(p):
        async def go():
            async with httpx.AsyncClient(timeout=10) as http:
                return (await timed_stream(http, url + "/v1/completions", completion(p, 1)))["ttft"]
        return run(go())

    cold = ttft(prompt)
    warm = ttft(prompt)
    for i in range(4):
        client.post(url + "/v1/completions", json=completion(f"another conversation {i}", 1))
    evicted = ttft(prompt)
    assert warm < cold / 4
    assert evicted > cold / 2


def test_die_after_tokens_cuts_the_stream(engine, client):
    url, _ = engine("h200", time_scale=100, die_after_tokens=5)
    contents, done = [], False
    with pytest.raises(httpx.RemoteProtocolError):
        with client.stream("POST", url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    assert "usage" not in chunk  # a stream that dies never sends its usage
                    content = chunk["choices"][0]["delta"].get("content")
                    if content:
                        contents.append(content)
    assert len(contents) == 5 and not done
    text = client.get(url + "/metrics").text
    assert metric(text, "vllm:num_requests_running") == 0
    # Non-streamed answers are not affected.
    r = client.post(url + "/v1/completions", json=completion(max_tokens=20))
    assert r.json()["usage"]["completion_tokens"] == 20


def served_tps(url: str, n: int, tokens: int) -> float:
    """Output tok/s of n concurrent streams as the platform's load test counts it: each
    stream's decode rate from its first token to its last, summed (so connection set-up and
    time to first token, a larger share of a fast engine's time, do not blur the ratio)."""
    async def go():
        async with httpx.AsyncClient(timeout=10) as http:
            await asyncio.gather(*(http.get(url + "/health") for _ in range(n)))
            results = await asyncio.gather(*(
                timed_stream(http, url + "/v1/completions", completion(max_tokens=tokens))
                for _ in range(n)))
        assert all(r["chunks"] == tokens for r in results)
        return sum((tokens - 1) / (r["total"] - r["ttft"]) for r in results)
    return run(go())


@pytest.mark.parametrize(("liar", "honest", "share"), [
    ("2x-rtx-4090-wsl2", "2x-rtx-4090", 0.52),  # FACTS.md: WSL2 serves 48% slower
    ("liar-slow-engine", "rtx-pro-6000", 0.30),
])
def test_planted_slow_engines_serve_their_share_of_the_honest_machine(engine, liar, honest,
                                                                      share):
    """Measured over HTTP with concurrent streams, as the platform's load test does, at the
    card's own speed: a few hundred chunks a second at most, so a busy 2-core machine keeps
    up with the honest engine (lagging behind it would inflate the ratio)."""
    n, tokens = 2, 30
    honest_url, _ = engine(honest, time_scale=1)
    liar_url, _ = engine(liar, time_scale=1)
    fast, slow = served_tps(honest_url, n, tokens), served_tps(liar_url, n, tokens)
    assert fast == pytest.approx(get_profile(honest).aggregate_tps(n), rel=0.25)
    assert slow / fast == pytest.approx(share, rel=0.2)


def time_to_status(http_client, url: str, payload: dict) -> tuple[int, float]:
    """Status code of a streamed request and how long it took to arrive; the body is left
    unread, so the client goes away as the load test's context check does."""
    start = time.perf_counter()
    with http_client.stream("POST", url + "/v1/chat/completions", json=payload) as r:
        return r.status_code, time.perf_counter() - start


def test_a_long_streamed_request_gets_its_status_before_the_prefill_ends(engine, client):
    """vLLM sends status and headers when it accepts a streamed request, so a check at the
    advertised context length learns the answer without waiting out the prefill."""
    scale = 20
    url, _ = engine("rtx-4090", time_scale=scale)
    p = get_profile("rtx-4090")
    advertised = client.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    assert advertised == p.context_length
    # As the platform's load test words it: one token per "the", a template's length short.
    words = advertised - 64
    payload = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["the"] * words)}],
               "max_tokens": 8, "stream": True}
    prefill_s = words / p.prefill_tps / scale  # ~18 s on the card, ~0.9 s here
    assert prefill_s > 0.5
    status, waited = time_to_status(client, url, payload)
    assert status == 200 and waited < prefill_s / 2
    # The client left during the prefill: the engine dropped the request (vLLM aborts it).
    deadline = time.perf_counter() + 3
    while metric(client.get(url + "/metrics").text, "vllm:num_requests_running") != 0:
        assert time.perf_counter() < deadline, "the abandoned request still runs"
        time.sleep(0.01)
    # Beyond the context: refused at once, with a 400.
    payload["max_tokens"] = 200
    status, _ = time_to_status(client, url, payload)
    assert status == 400


def test_a_streamed_request_still_waiting_for_a_slot_has_its_status(engine):
    """Headers go out on acceptance even while the request queues behind the others."""
    url, _ = engine("h200", time_scale=1, max_concurrency=1)

    async def scenario():
        async with httpx.AsyncClient(timeout=10) as http:
            hog = asyncio.create_task(timed_stream(http, url + "/v1/completions",
                                                   completion(max_tokens=10_000)))
            await poll_metrics(http, url, {"vllm:num_requests_running": 1})
            start = time.perf_counter()
            async with http.stream("POST", url + "/v1/completions",
                                   json=completion(max_tokens=5) | {"stream": True}) as r:
                assert r.status_code == 200
                assert time.perf_counter() - start < 0.5
                await poll_metrics(http, url, {"vllm:num_requests_waiting": 1})
            hog.cancel()
            await asyncio.gather(hog, return_exceptions=True)

    run(scenario())


def test_llamacpp_status_comes_with_the_first_token(engine, client):
    """llama-server's stream is modelled as starting with its first result."""
    scale = 20
    url, _ = engine("m4-max-llamacpp", time_scale=scale)
    words = 600  # 4 s of prefill on the Mac, 0.2 s here
    payload = {"messages": [{"role": "user", "content": " ".join(["the"] * words)}],
               "max_tokens": 2, "stream": True}
    status, waited = time_to_status(client, url, payload)
    assert status == 200
    assert waited >= 0.8 * words / get_profile("m4-max-llamacpp").prefill_tps / scale
