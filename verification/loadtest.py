"""Load-test a node's OpenAI-compatible engine from the platform side (httpx, no ORM).

This is the figure routing trusts: a card can win every hardware probe and still serve slowly
(WSL2 served 48% slower than native in a published fleet report). Measured per concurrency:
the engine's output tokens/s while every stream decodes (see `throughput`), and time to first
token p50/p99; and, where the engine counts its speculative drafts (vLLM's spec_decode_*
metrics), how many tokens it got per pass over its weights. Then a long prompt sent
twice (does prefix caching work?) and a request at the advertised context length (is it
accepted? read from the response status, which vLLM sends before the prefill ends).

The side that measures must keep up with what it measures: every token is stamped when this
event loop reads it, so a loop starved of CPU (a worker running many load tests, a crowded
machine) reads any engine slow. The loop's own lateness is measured beside each level
(`LoopLag`), and a caller does not judge an engine on a level read by a starved loop. The
load tests of one process (a worker's threads) take turns through one `ReadingGate`, which
lets fewer levels read at once whenever one was read late.
"""

import asyncio
import json
import re
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from marketplace import engine_tls
from verification import fingerprint

PROMPT_WORDS = 256
OUTPUT_TOKENS = 128
PREFIX_WORDS = 4000
LEVELS = (1, 8, 32)


@dataclass
class Level:
    concurrency: int
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    completed: int
    failed: int
    # When its requests went out and when the last one ended (Unix time): the window in
    # which the GPU's power draw, read from the heartbeats, was this level's.
    started: float = 0.0
    ended: float = 0.0
    # How late this event loop woke while the level ran (ms, 90th percentile): past a few
    # tens of ms the stamps above are the reader's, not the engine's (see LoopLag).
    loop_lag_p90_ms: float = 0.0
    # Of the failed streams, those the engine cut short (see cut_short).
    cut_short: int = 0


@dataclass
class LoadTestResult:
    model: str
    levels: list[Level] = field(default_factory=list)
    prefix_cold_ms: float | None = None
    prefix_warm_ms: float | None = None
    context_length: int | None = None
    context_accepted: bool | None = None
    # Output tokens per pass over the weights while the levels ran, where the engine decodes
    # speculatively and says so (None: it does not, or does not say).
    tokens_per_pass: float | None = None
    # Its answers to the canary prompts (verification/fingerprint.py); [] when not asked.
    fingerprint: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Of the errors, those of a test the engine cut short (see cut_short).
    cut_short: list[str] = field(default_factory=list)

    def error(self, what: str, exc: BaseException) -> None:
        said = f"{what}: {exc}"
        self.errors.append(said)
        if cut_short(exc):
            self.cut_short.append(said)

    @property
    def prefix_speedup(self) -> float | None:
        if not self.prefix_cold_ms or not self.prefix_warm_ms:
            return None
        return self.prefix_cold_ms / self.prefix_warm_ms

    def tps(self) -> dict[int, float]:
        return {lv.concurrency: lv.tokens_per_s for lv in self.levels if lv.completed}

    @property
    def loop_lag_ms(self) -> float:
        """The worst level's loop lag (ms): how far the reader fell behind the engine."""
        return max((lv.loop_lag_p90_ms for lv in self.levels), default=0.0)


class LoopLag:
    """How late the event loop wakes from a short sleep, sampled all the while a load test
    runs. A loop that keeps up with its streams wakes within a millisecond or two; one
    starved of CPU or of the interpreter (other threads, other processes) wakes tens to
    hundreds of ms late, and every token it reads meanwhile is stamped that late."""

    TICK_S = 0.01
    # A level is judged with at least this much of the loop's recent past: one pause (a
    # garbage collection) in a short level is not a starved worker; a starved one is late
    # all the while.
    WINDOW_S = 1.0

    def __init__(self):
        self.samples: list[tuple[float, float]] = []  # (Unix time, lag in s)
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        while True:
            asleep = time.perf_counter()
            await asyncio.sleep(self.TICK_S)
            self.samples.append((time.time(), time.perf_counter() - asleep - self.TICK_S))

    def __enter__(self) -> "LoopLag":
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()

    def p90_ms(self, started: float, ended: float) -> float:
        since = min(started, ended - self.WINDOW_S)
        lags = [lag for at, lag in self.samples if since <= at <= ended]
        return round(_percentile(lags, 90) * 1000, 1) if lags else 0.0


# vLLM's counters of speculative decoding (v1): drafts proposed, tokens of them accepted.
_SPEC = re.compile(r"^vllm:spec_decode_num_(drafts|accepted_tokens)(?:_total)?(?:\{[^}]*\})?"
                   r"\s+([0-9.eE+-]+)\s*$", re.M)


async def _spec_counters(client, base: str) -> dict[str, float]:
    try:
        response = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    found: dict[str, float] = {}
    for name, value in _SPEC.findall(response.text):
        found[name] = found.get(name, 0.0) + float(value)
    return found


def tokens_per_pass(before: dict[str, float], after: dict[str, float]) -> float | None:
    """1 + accepted tokens per draft while the levels ran: each draft is one pass over the
    weights, and its accepted tokens come beside the one a pass always gives."""
    drafts = after.get("drafts", 0) - before.get("drafts", 0)
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    if drafts <= 0 or accepted < 0:
        return None
    return round(1 + accepted / drafts, 3)


class ReadingGate:
    """How many load-test levels this process reads at once. A level read late (its loop woke
    later than the bound) halves the number, one read in time lets one more in: the worker
    settles at what its CPU can read honestly, whatever else shares the machine."""

    def __init__(self, most: int = 16, late_ms: float = 20.0):
        self.most, self.late_ms = most, late_ms
        self.limit, self.reading = float(most), 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.reading >= max(1, int(self.limit)):
                return False
            self.reading += 1
            return True

    async def enter(self) -> None:
        while not self.try_enter():
            await asyncio.sleep(0.05)

    def leave(self, lag_ms: float) -> None:
        with self._lock:
            self.reading -= 1
            late = lag_ms > self.late_ms
            self.limit = max(1.0, self.limit / 2) if late else min(self.most, self.limit + 1)


GATE = ReadingGate()


def _words(n: int, seed: str) -> str:
    # Distinct text per request, so one request's prompt is no cache hit for the next.
    return " ".join(f"{seed}{i % 97}" for i in range(n))


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(pct / 100 * (len(ordered) - 1))))]


class EngineAnswered(RuntimeError):
    """A request the engine answered with an HTTP error."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


def cut_short(exc: BaseException) -> bool:
    """Whether a request failed because the engine was not there to answer it, rather than
    because of how it answered: the connection refused or broken, no answer in time, a model
    it no longer serves (switched under the test), an engine loading or failing (5xx). An
    engine restarting does that for a while; a model that stops at once does not."""
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, EngineAnswered) and (exc.status == 404 or exc.status >= 500)


async def _stream(client: httpx.AsyncClient, base: str, model: str, prompt: str,
                  max_tokens: int) -> tuple[float, list[float]]:
    """(start, the time of each token) of one streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise EngineAnswered(response.status_code, await response.aread())
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("the stream carried no tokens")
    return start, stamps


async def _level(client, base, model, concurrency: int) -> Level:
    started = time.time()
    results = await asyncio.gather(*[
        _stream(client, base, model, _words(PROMPT_WORDS, f"c{concurrency}r{i}x"),
                OUTPUT_TOKENS) for i in range(concurrency)], return_exceptions=True)
    ended = time.time()
    done = [r for r in results if not isinstance(r, BaseException)]
    ttfts = [(stamps[0] - start) * 1000 for start, stamps in done]
    return Level(concurrency, throughput([stamps for _, stamps in done]),
                 statistics.median(ttfts) if ttfts else 0.0,
                 _percentile(ttfts, 99) if ttfts else 0.0, len(done),
                 len(results) - len(done), started, ended,
                 cut_short=sum(1 for r in results if isinstance(r, BaseException)
                               and cut_short(r)))


def throughput(streams: list[list[float]]) -> float:
    """Output tokens/s of the engine with all these streams decoding at once: tokens counted
    in the window where every stream is between its first and last token, so prefill and the
    ramp at either end do not blur it. An engine that queues (fewer slots than streams) never
    has them all at once: then tokens over the whole span, which is what it delivers."""
    streams = [s for s in streams if len(s) > 1]
    if not streams:
        return 0.0
    lo, hi = max(s[0] for s in streams), min(s[-1] for s in streams)
    if hi - lo > 0.2 * (max(s[-1] for s in streams) - min(s[0] for s in streams)):
        inside = sum(1 for s in streams for t in s if lo < t <= hi)
        return inside / (hi - lo)
    span = max(s[-1] for s in streams) - min(s[0] for s in streams)
    return sum(len(s) for s in streams) / span if span > 0 else 0.0


async def _fingerprint(client, base: str, model: str) -> list[dict]:
    """The engine's answers to the canaries, asked one at a time, greedily; an engine that
    refuses log-probabilities is asked again without them (its text alone is compared)."""
    answers = []
    for prompt in fingerprint.CANARIES:
        body = fingerprint.request_body(model, prompt)
        response = await _post_once_more(client, f"{base}/v1/chat/completions", body)
        if response.status_code == 400:
            body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
            response = await _post_once_more(client, f"{base}/v1/chat/completions", body)
        if response.status_code == 200:
            answers.append(fingerprint.answer_from(prompt, response.json()))
    return answers


async def _post_once_more(client, url: str, body: dict) -> httpx.Response:
    """A POST sent again once on a new connection where the kept-alive one was closed under it
    (llama-cpp-python's server closes a connection after some streams)."""
    try:
        return await client.post(url, json=body)
    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
        return await client.post(url, json=body)


async def _context_accepted(client, base, model, context_length: int) -> bool:
    # "the" is one token in every common tokenizer; stay a chat template's length under the
    # limit, so the request is at the context length, not beyond it.
    prompt = " ".join(["the"] * max(1, context_length - 64))
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8, "stream": True}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        return response.status_code == 200  # decided before the prefill; don't wait for it


async def run_load_test(base_url: str, *, model: str | None = None, levels=LEVELS,
                        max_concurrency: int | None = None, timeout_s: float = 300,
                        progress: Callable[[str, int], None] | None = None,
                        engine_key: str = "", caches: bool = True,
                        lag_bound_ms: float | None = None,
                        tls_certificate: str = "") -> LoadTestResult:
    """`engine_key`: the node's engine key, sent as the proxy sends it ("": none yet), over
    TLS pinned to `tls_certificate` where the engine serves https:// (engine_tls.py).
    `caches`: also ask the canary prompts (the answers' fingerprint) and test the prefix cache
    and the advertised context (the provider's engine; the platform's yardstick is measured
    for its speed alone). `lag_bound_ms`: stop after a level this loop read later than this
    (the result is the caller's to discard: the rest would be read as late)."""
    base = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    headers = {"authorization": f"Bearer {engine_key}"} if engine_key else None
    verify = engine_tls.verify_for(base, tls_certificate)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers,
                                 verify=verify) as client:
        listed = (await client.get(f"{base}/v1/models")).json().get("data") or []
        if not listed:
            raise RuntimeError("the engine lists no model")
        entry = next((m for m in listed if m.get("id") == model), listed[0])
        result = LoadTestResult(model=entry["id"], context_length=entry.get("max_model_len"))
        levels = sorted(set(levels) | ({max_concurrency} if max_concurrency else set()))
        steps = len(levels) + (2 if caches else 0)
        before = await _spec_counters(client, base)
        with LoopLag() as lag:
            for i, concurrency in enumerate(levels):
                if progress:
                    progress(f"{concurrency} concurrent requests", int(100 * i / steps))
                await GATE.enter()
                late_ms = 0.0
                try:
                    level = await _level(client, base, result.model, concurrency)
                    await asyncio.sleep(LoopLag.TICK_S * 2)  # the level's last tick is in
                    level.loop_lag_p90_ms = late_ms = lag.p90_ms(level.started, level.ended)
                finally:
                    GATE.leave(late_ms)
                result.levels.append(level)
                if lag_bound_ms is not None and level.loop_lag_p90_ms > lag_bound_ms:
                    return result
        result.tokens_per_pass = tokens_per_pass(before, await _spec_counters(client, base))
        if not caches:
            return result
        try:
            result.fingerprint = await _fingerprint(client, base, result.model)
        except (httpx.HTTPError, ValueError) as exc:
            result.error(f"canary prompts: {type(exc).__name__}", exc)
        if progress:
            progress("prefix cache", int(100 * len(levels) / steps))
        prefix = _words(PREFIX_WORDS, "prefix")
        try:
            start, stamps = await _stream(client, base, result.model, prefix, 4)
            result.prefix_cold_ms = (stamps[0] - start) * 1000
            start, stamps = await _stream(client, base, result.model, prefix, 4)
            result.prefix_warm_ms = (stamps[0] - start) * 1000
        except (httpx.HTTPError, RuntimeError) as exc:
            result.error("prefix test", exc)
        if result.context_length:
            if progress:
                progress("context length", int(100 * (len(levels) + 1) / steps))
            try:
                result.context_accepted = await _context_accepted(client, base, result.model,
                                                                  result.context_length)
            except httpx.HTTPError as exc:
                result.error("context test", exc)
    return result
