"""Routing benchmark: the balancer (routing/balancer.py) against driving the same workers
directly, through two Rigshare server processes behind a random splitter (each request goes to
one of them at random; they never talk to each other about placement).

Workers: two fleetsim engines (`python -m fleetsim serve`), an RTX PRO 6000 and a 2x RTX 4090
(vLLM profiles, prefix cache on, usage with `prompt_tokens_details`), at `--time-scale`.
Sections:
1. Capacity: closed-loop streams of unique prompts (no affinity to find) at 32 and 64 streams,
   tokens counted as they arrive after a warm-up.
   Rigshare against the best static split of the same streams driven straight at the two
   engines (the PRO 6000's share tried over a range). Goals: the fleet delivers at least 95%
   of that direct limit; the PRO 6000 gets at least 2.5x the tokens of the 4090 pair.
2. Affinity: conversations that share one system prompt, each with a long first user turn of
   its own, 4 turns, 16 at a time. A follow-up is a hit when the engine's usage says its whole
   history (the previous turn's prompt, to a 16-token block) came from its prefix cache: the
   engines' word, not the router's headers. Against each conversation pinned to one engine
   (always the same worker, three conversations in four on the PRO 6000). Goals: at least
   97% of follow-ups hit; follow-up TTFT p50 within 1.2x of pinned.
3. Context: prompts that both workers hold, that only the PRO 6000 holds, and that none does
   (a 400 `context_length_exceeded`).
4. Hot spot: 24 session keys (X-Session-ID) with one closed-loop stream of 4-turn
   conversations each, and one hot key with ten streams (10x each other key's traffic), its
   own worker (its ranking's first) the 4090 pair, the lighter one: 34 streams, under the
   fleet's 64 verified slots. Then the same with `--conversations` keys, past the slots,
   where the balancer puts a free slot before the load bound: reported, not judged. Every
   150 ms, each engine's in-flight requests as its own /metrics says (running + waiting),
   against its weight (routing.balancer.weight on the pool snapshot's worker). Goal: no
   worker's load per weight exceeds LOAD_FACTOR (c = 1.25) times the fleet's at any sample,
   LOAD_SLACK (2) requests allowed over it as the balancer allows them: in flight - 2 <=
   1.25 x its weight's share of the fleet's in flight. Reported: that ratio's p99 and max,
   the raw one's (no slack), the hot key's requests per worker (its spill) and the
   X-Rigshare-Affinity verdicts.
5. Churn. (a) A 2x RTX 5090 joins under a steady closed-loop load of multi-turn
   conversations: its engine starts idle, its verified rows (in traffic since now) are
   written mid-run, and it enters through the cold-start ramp, shortened for the benchmark
   (`--ramp-step-s`, default 10 s, passed to the servers as RIGSHARE_RAMP_STEP_S, which
   routing/balancer.py reads; 60 s in production). TTFT p50/p99 and its share of tokens per
   half-step window, before and after. Goals: its share rises with every ramp step; no
   window after it joined has a TTFT p99 above 1.5x the p99 of all requests before.
   (b) It leaves: `--churn-keys` session keys, one one-token follow-up each, one at a time
   (no load to spill for), record who serves each; its node then misses its heartbeats and
   marketplace.services.nodes_mark_offline marks it offline (the product's path for a
   machine that goes away); once the pools refreshed, the same keys again. Goals: every key
   it served moves; none moves between the workers that stayed, beyond load-bound spills
   (the X-Rigshare-Affinity verdict `spill` in either pass).
6. Peers: the same two engines through vllm-router (cache_aware and round_robin, one and two
   independent replicas) and LiteLLM's proxy (least-busy, one and two), each installed in a
   virtualenv of its own from pinned files (bench/peers.py), and through Rigshare in the same
   section: 64 closed-loop streams (tokens/s, TTFT p50/p99) and the multi-turn conversations
   (follow-ups that hit, follow-up TTFT p50), each router with conversations of its own.
   Reported as each peer's figure over Rigshare's. Goal: ahead of every peer on every figure.
`--sections 4,5` runs only those (default all). Run by `make bench-routing`; figures in
docs/benchmarks.md.
"""

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare_routing")

import warnings  # noqa: E402

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")  # WhiteNoise: no collectstatic here
django.setup()

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.test.utils import override_settings, setup_databases, teardown_databases  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import User  # noqa: E402
from bench import peers  # noqa: E402
from bench.proxy import (  # noqa: E402
    bench_database_url,
    bench_redis_url,
    free_port,
    pct,
    start,
    stop,
    verified_deployment,
    wait_http,
)
from bench.results import record  # noqa: E402
from billing.keys import api_key_create  # noqa: E402
from billing.models import ModelPrice  # noqa: E402
from billing.services import credits_grant  # noqa: E402
from config.redis import redis_client  # noqa: E402
from fleetsim.profiles import get_profile  # noqa: E402
from marketplace.models import Node  # noqa: E402
from marketplace.services import nodes_mark_offline  # noqa: E402
from routing import balancer  # noqa: E402
from routing.models import Deployment, EngineModel, Model  # noqa: E402
from routing.placement import Worker  # noqa: E402
from routing.pool import REFRESH_S, build  # noqa: E402

MODEL = "qwen3-27b"
PROFILES = ("rtx-pro-6000", "2x-rtx-4090")
ADDED = "2x-rtx-5090"  # the worker that joins (and leaves) in section 5
HOT_STREAMS = 10  # section 4's hot key: ten times the streams of every other key
HOT_SESSIONS = 24  # section 4's other keys, judged: with the hot key's, under the fleet's slots
BLOCK = 16  # the engines' prefix cache block (fleetsim.engine.BLOCK_SIZE, vLLM's default)
WARMUP_S = 4.0  # before a capacity run is measured: the closed loops settle in
SYSTEM = ("You are a careful assistant for people who buy and rent GPUs. " * 40).strip()


@dataclass
class Result:
    worker: str
    ttft_s: float
    tokens: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ok: bool = True
    affinity: str = ""  # X-Rigshare-Affinity: hit, spill or new


@dataclass
class Target:
    """Where requests go: Rigshare's processes (split at random) or the engines directly."""

    name: str
    urls: list[str]
    model: str
    headers: dict = field(default_factory=dict)


def make_rows(engines: dict[str, str]) -> str:
    model = Model.objects.create(name=MODEL, context_length=262_144)
    ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=200_000,
                              output_micros_per_mtok=800_000,
                              effective_at=timezone.now() - timedelta(days=1))
    provider = User.objects.create_user("provider@bench.test", None)
    for key, url in engines.items():
        profile = get_profile(key)
        EngineModel.objects.get_or_create(engine_model_id=profile.model,
                                          defaults={"model": model})
        # In traffic for an hour: past the cold-start ramp.
        verified_deployment(provider, key, url, since=timezone.now() - timedelta(hours=1))
    consumer = User.objects.create_user("consumer@bench.test", None)
    credits_grant(user=consumer, amount_micros=10**13, idempotency_key="bench-routing:grant")
    _, token = api_key_create(user=consumer, name="bench", by_operator=True)
    return token


async def stream(client: httpx.AsyncClient, url: str, model: str, messages: list,
                 max_tokens: int, headers: dict,
                 window: tuple[float, float] = (0.0, float("inf"))) -> Result:
    """One streamed chat completion; `tokens` counts the content chunks that arrived within
    `window` (perf_counter times)."""
    started = time.perf_counter()
    ttft, tokens, usage, worker, verdict = None, 0, {}, url, ""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Result(url, 0.0, 0, ok=False)
            worker = resp.headers.get("x-rigshare-worker", url)
            verdict = resp.headers.get("x-rigshare-affinity", "")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        tokens += window[0] <= now <= window[1]
                        if ttft is None:
                            ttft = now - started
    except httpx.HTTPError:
        return Result(url, 0.0, 0, ok=False)
    details = usage.get("prompt_tokens_details") or {}
    return Result(worker, ttft or 0.0, tokens, usage.get("prompt_tokens", 0),
                  details.get("cached_tokens", 0), affinity=verdict)


# --- 1. capacity ---

async def capacity_run(target: Target, streams: int, seconds: float, max_tokens: int,
                       pro_streams: int | None = None,
                       ttfts: list | None = None) -> tuple[float, Counter]:
    """Tokens/s of `streams` closed-loop clients, counted as they arrive over `seconds` after
    a warm-up in which every client's first streams settle in; tokens per worker. Direct:
    `pro_streams` of the clients drive the PRO 6000, the rest the pair. `ttfts` gets the TTFT
    of every request started in the measured window."""
    rng = random.Random(streams)
    per_worker: Counter = Counter()
    begin = time.perf_counter() + WARMUP_S
    end = begin + seconds
    limits = httpx.Limits(max_connections=streams * 2, max_keepalive_connections=streams * 2)

    async def client_loop(c: int, http: httpx.AsyncClient):
        while time.perf_counter() < end:
            if pro_streams is None:
                url = rng.choice(target.urls)
            else:
                url = target.urls[0] if c < pro_streams else target.urls[1]
            messages = [{"role": "user", "content": f"Unique request {uuid.uuid4()}: "
                         "say something about GPUs."}]
            started = time.perf_counter()
            r = await stream(http, url, target.model, messages, max_tokens, target.headers,
                             (begin, end))
            per_worker[r.worker] += r.tokens
            if ttfts is not None and r.ok and begin <= started <= end:
                ttfts.append(r.ttft_s)

    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client_loop(c, http) for c in range(streams)))
    return sum(per_worker.values()) / seconds, per_worker


# --- 2. affinity ---

def conversation_turns(n: int, turns: int, seed: int = 42) -> list[list[str]]:
    rng = random.Random(seed)
    words = "card memory bandwidth tensor prefill decode cache latency serving price".split()
    return [[" ".join(rng.choice(words) for _ in range(1500 if t == 0 else 40))
             for t in range(turns)] for _ in range(n)]


async def affinity_run(target: Target, conversations: list[list[str]], concurrency: int,
                       max_tokens: int, pinned: bool) -> list[tuple[Result, int]]:
    """Every conversation's turns in order, `concurrency` conversations at a time. Returns
    (follow-up result, the previous turn's prompt tokens)."""
    rng = random.Random(7)
    follow_ups: list[tuple[Result, int]] = []
    queue = list(enumerate(conversations))

    async def one(http: httpx.AsyncClient, i: int, turns: list[str]):
        messages = [{"role": "system", "content": SYSTEM}]
        previous = 0
        for t, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            # Pinned: three conversations in four on the PRO 6000, near the capacity split.
            url = target.urls[0 if i % 4 != 3 else 1] if pinned else rng.choice(target.urls)
            r = await stream(http, url, target.model, messages, max_tokens, target.headers)
            if t:
                follow_ups.append((r, previous))
            previous = r.prompt_tokens
            messages.append({"role": "assistant", "content": "Noted. " * max_tokens})

    async def worker(http):
        while queue:
            i, turns = queue.pop(0)
            await one(http, i, turns)

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return follow_ups


async def context_run(target: Target, words: int, n: int) -> list[str]:
    """Who answered each of `n` prompts of `words` words: a worker ref, or the error."""
    prompt = " ".join(["card"] * words)

    async def one(http):
        resp = await http.post(f"{target.urls[0]}/v1/chat/completions", headers=target.headers,
                               json={"model": target.model, "max_tokens": 1,
                                     "messages": [{"role": "user", "content": prompt}]})
        if resp.status_code == 200:
            return resp.headers.get("x-rigshare-worker", "?")
        return f"{resp.status_code} {resp.json()['error'].get('code')}"

    async with httpx.AsyncClient(timeout=300) as http:
        return list(await asyncio.gather(*(one(http) for _ in range(n))))


def hit(result: Result, previous_prompt: int) -> bool:
    return result.ok and result.cached_tokens >= previous_prompt - BLOCK


# --- 4. hot spot ---

def fleet_workers() -> tuple[Worker, ...]:
    """The model's workers as a pool snapshot built now holds them (weights, ramps). Built in
    this process with no load exchange: only the rows matter here."""
    with override_settings(REDIS_URL=""):
        return build().workers.get(MODEL, ())


def session_home(workers, session: str) -> str:
    """The worker ref a session key's ranking puts first (its own worker, load aside)."""
    key = balancer.affinity({"messages": []}, "chat", session=session).key
    return balancer.rank(workers, key)[0].ref


async def engine_in_flight(http: httpx.AsyncClient, url: str) -> int:
    """Running + waiting requests, as the engine's own /metrics says (vLLM's gauges)."""
    resp = await http.get(f"{url}/metrics")
    total = 0
    for line in resp.text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def conversation_loop(rng: random.Random, first_words: int = 120, turn_words: int = 20):
    """Endless conversations of 4 turns: yields each turn's messages, history included."""
    words = "card memory bandwidth tensor prefill decode cache latency serving price".split()
    while True:
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(4):
            n = first_words if t == 0 else turn_words
            messages.append({"role": "user",
                             "content": " ".join(rng.choice(words) for _ in range(n))})
            yield list(messages)
            messages.append({"role": "assistant", "content": "Noted. " * 8})


@dataclass
class HotSpot:
    samples: list[dict[str, int]] = field(default_factory=list)  # engine URL -> in flight
    hot: Counter = field(default_factory=Counter)  # the hot key's requests per worker ref
    verdicts: dict[str, Counter] = field(default_factory=lambda: {"hot": Counter(),
                                                                  "other": Counter()})
    failed: int = 0


async def hotspot_run(target: Target, engine_urls: list[str], sessions: int, hot_key: str,
                      hot_streams: int, seconds: float, max_tokens: int,
                      sample_s: float = 0.15) -> HotSpot:
    """`sessions` keys with one closed-loop stream each and `hot_key` with `hot_streams`, every
    stream a run of 4-turn conversations under its X-Session-ID; after a warm-up, for `seconds`:
    each engine's in-flight requests every `sample_s`, and every request's worker and verdict."""
    out = HotSpot()
    begin = time.perf_counter() + WARMUP_S
    end = begin + seconds
    streams = sessions + hot_streams
    limits = httpx.Limits(max_connections=streams * 2, max_keepalive_connections=streams * 2)

    async def client_loop(c: int, http: httpx.AsyncClient):
        rng = random.Random(1000 + c)
        hot = c < hot_streams
        headers = {**target.headers,
                   "X-Session-ID": hot_key if hot else f"session-{c - hot_streams}"}
        turns = conversation_loop(rng)
        while time.perf_counter() < end:
            started = time.perf_counter()
            r = await stream(http, rng.choice(target.urls), target.model, next(turns),
                             max_tokens, headers)
            if not begin <= started <= end:
                continue
            if not r.ok:
                out.failed += 1
                continue
            out.verdicts["hot" if hot else "other"][r.affinity] += 1
            if hot:
                out.hot[r.worker] += 1

    async def sampler():
        async with httpx.AsyncClient(timeout=5) as http:
            while (now := time.perf_counter()) < end:
                if now >= begin:
                    loads = await asyncio.gather(*(engine_in_flight(http, u)
                                                   for u in engine_urls))
                    out.samples.append(dict(zip(engine_urls, loads, strict=True)))
                await asyncio.sleep(sample_s)

    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(sampler(), *(client_loop(c, http) for c in range(streams)))
    return out


def load_ratios(samples: list[dict[str, int]], weights: dict[str, float]
                ) -> tuple[list[float], list[float]]:
    """Per sample, the highest (worker's in flight / its weight) / (fleet's in flight / fleet's
    weight): raw, and with LOAD_SLACK requests taken off each worker's count first (the
    balancer's bound: in flight <= LOAD_FACTOR x its weight's share of the fleet's + slack, so
    `with slack` <= LOAD_FACTOR is the bound held). Samples with nothing in flight are skipped."""
    total_w = sum(weights.values())
    raw, slack = [], []
    for sample in samples:
        fleet = sum(sample.values())
        if not fleet:
            continue
        fair = {u: fleet * w / total_w for u, w in weights.items()}
        raw.append(max(sample[u] / fair[u] for u in weights))
        slack.append(max(max(0, sample[u] - balancer.LOAD_SLACK) / fair[u] for u in weights))
    return raw, slack


# --- 5. churn ---

async def churn_add_run(target: Target, streams: int, before_s: float, after_s: float,
                        max_tokens: int, add) -> tuple[list[tuple[float, Result]], float]:
    """`streams` closed-loop clients, each a run of 4-turn conversations (keyed by their start,
    no session); after a warm-up and `before_s`, `add()` (in a thread: database rows) brings a
    worker in, and the load goes on for `after_s`. Returns (start time relative to the
    addition, result) for every request that started after the warm-up, and the addition's
    perf_counter time."""
    begin = time.perf_counter() + WARMUP_S
    added = begin + before_s  # replaced by the moment the rows are written
    stop_at = [added + after_s]
    started_at: list[tuple[float, Result]] = []
    limits = httpx.Limits(max_connections=streams * 2, max_keepalive_connections=streams * 2)

    async def client_loop(c: int, http: httpx.AsyncClient):
        rng = random.Random(2000 + c)
        turns = conversation_loop(rng, first_words=300)
        while time.perf_counter() < stop_at[0]:
            started = time.perf_counter()
            r = await stream(http, rng.choice(target.urls), target.model, next(turns),
                             max_tokens, target.headers)
            if started >= begin and started < stop_at[0]:
                started_at.append((started, r))

    async def adder():
        nonlocal added
        await asyncio.sleep(max(0.0, added - time.perf_counter()))
        await asyncio.to_thread(add)
        added = time.perf_counter()
        stop_at[0] = added + after_s

    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(adder(), *(client_loop(c, http) for c in range(streams)))
    return [(t - added, r) for t, r in started_at], added


async def key_owners(target: Target, keys: list[str]) -> dict[str, Result]:
    """Each key's one request (a one-token follow-up under its X-Session-ID), one at a time
    through the splitter: which worker served it and the balancer's verdict."""
    messages = [{"role": "user", "content": "Which card?"},
                {"role": "assistant", "content": "A 4090."},
                {"role": "user", "content": "And the price?"}]
    rng = random.Random(3)
    owners = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for key in keys:
            owners[key] = await stream(http, rng.choice(target.urls), target.model, messages,
                                       1, {**target.headers, "X-Session-ID": key})
    return owners


def node_misses_heartbeats(node_id: int, redis_url: str) -> list[int]:
    """The product's path for a machine that goes away: its agent stops heartbeating (the
    others' go on) and marketplace.services.nodes_mark_offline marks it offline. Redis (the
    heartbeat fast path) is the servers' database, not the one this process was started with."""
    now = timezone.now()
    Node.objects.exclude(pk=node_id).update(last_heartbeat_at=now)
    Node.objects.filter(pk=node_id).update(last_heartbeat_at=now - timedelta(hours=1))
    redis_client.cache_clear()
    try:
        with override_settings(REDIS_URL=redis_url):
            return nodes_mark_offline(now=now)
    finally:
        redis_client.cache_clear()


@dataclass
class Bench:
    """What every section works with."""

    args: argparse.Namespace
    env: dict  # the servers' and engines' environment
    workdir: Path  # their logs
    procs: list
    engines: dict[str, str]  # profile key -> engine URL
    rigshare: Target
    direct: Target
    refs: dict[str, str]  # worker ref -> profile key


def section_capacity(b: Bench) -> None:
    args, rigshare, direct, refs = b.args, b.rigshare, b.direct, b.refs
    print("\n1. capacity (closed-loop streams of unique prompts, "
          f"{args.max_tokens} tokens each, {args.seconds:g} s measured)")
    for streams in (32, 64):
        best, best_split = 0.0, 0
        for share in (0.6, 0.7, 0.75, 0.8, 0.85):
            pro = round(streams * share)
            tps, _ = asyncio.run(capacity_run(direct, streams, args.seconds,
                                              args.max_tokens, pro))
            if tps > best:
                best, best_split = tps, pro
        tps, per_worker = asyncio.run(capacity_run(rigshare, streams, args.seconds,
                                                   args.max_tokens))
        by_profile = {refs.get(ref, ref): n for ref, n in per_worker.items()}
        ratio = (by_profile.get(PROFILES[0], 0) / by_profile[PROFILES[1]]
                 if by_profile.get(PROFILES[1]) else float("inf"))
        print(f"  {streams} streams: Rigshare {tps:,.0f} tok/s, direct best {best:,.0f} "
              f"(PRO 6000 {best_split}/{streams}): {tps / best:.1%} of direct "
              f"(goal 95%: {'met' if tps >= 0.95 * best else 'MISSED'}); PRO 6000 "
              f"{ratio:.2f}x the pair's tokens (goal 2.5x: "
              f"{'met' if ratio >= 2.5 else 'MISSED'})")
        # Measured against the direct run of the same moment: neither moves with the CPU.
        record("routing", f"capacity, {streams} streams, share of direct",
                       round(tps / best, 4), "ratio", better="higher", scales=False)
        record("routing", f"PRO 6000 tokens / 4090 pair's, {streams} streams",
                       round(ratio, 3), "ratio", better="higher", scales=False)


def section_affinity(b: Bench) -> None:
    args, rigshare, direct = b.args, b.rigshare, b.direct
    print(f"\n2. affinity ({args.conversations} conversations, a shared ~{len(SYSTEM)//4}"
          f"-token system prompt, a ~1,500-word first turn each, 4 turns, {args.at_once} at a "
          "time)")
    conversations = conversation_turns(args.conversations, 4)
    pinned = asyncio.run(affinity_run(direct, conversations, args.at_once, args.max_tokens,
                                      True))
    routed = asyncio.run(affinity_run(rigshare, conversations[::-1], args.at_once,
                                      args.max_tokens, False))
    for name, results in (("pinned (direct)", pinned), ("Rigshare", routed)):
        ok = [(r, p) for r, p in results if r.ok]
        hits = sum(hit(r, p) for r, p in ok)
        ttfts = [r.ttft_s for r, _ in ok]
        print(f"  {name}: {len(results)} follow-ups, {hits / max(len(ok), 1):.1%} found "
              f"their whole history cached; TTFT p50 {pct(ttfts, 0.5) * 1000:.0f} ms, p99 "
              f"{pct(ttfts, 0.99) * 1000:.0f} ms")
    misses = Counter(r.affinity if r.ok else "failed" for r, p in routed if not hit(r, p))
    print(f"  Rigshare's misses by X-Rigshare-Affinity: {dict(misses.most_common()) or 'none'} "
          "(spill: its worker was over its load bound; hit: on its worker, the history no "
          "longer cached)")
    hit_rate = sum(hit(r, p) for r, p in routed) / max(len(routed), 1)
    ttft_ratio = (pct([r.ttft_s for r, _ in routed if r.ok], 0.5)
                  / pct([r.ttft_s for r, _ in pinned if r.ok], 0.5))
    record("routing", "affinity, follow-ups that hit", round(hit_rate, 4), "ratio",
                   better="higher", scales=False)
    record("routing", "affinity, follow-up TTFT p50 / pinned's", round(ttft_ratio, 3),
                   "ratio", better="lower", scales=False)
    print(f"  goal 97% of follow-ups hit: {hit_rate:.1%}: "
          f"{'met' if hit_rate >= 0.97 else 'MISSED'}; goal follow-up TTFT p50 within "
          f"1.2x of pinned: {ttft_ratio:.2f}x: {'met' if ttft_ratio <= 1.2 else 'MISSED'}")


def section_context(b: Bench) -> None:
    print("\n3. context (one word a token; max_tokens 1)")
    pair_context = get_profile(PROFILES[1]).context_length
    for words, expect in ((40_000, "any"), (pair_context + 20_000, PROFILES[0]),
                          (300_000, "400")):
        answers = asyncio.run(context_run(b.rigshare, words, 3))
        seen = Counter(b.refs.get(a, a) for a in answers)
        if expect == "400":
            good = set(seen) == {"400 context_length_exceeded"}
        elif expect == "any":
            good = all(k in PROFILES for k in seen)
        else:
            good = set(seen) == {expect}
        print(f"  ~{words:,}-token prompt: {dict(seen)} (should reach "
              f"{'every worker that holds it' if expect == 'any' else expect}: "
              f"{'met' if good else 'MISSED'})")


def section_hotspot(b: Bench) -> None:
    workers = fleet_workers()
    slots = sum(w.slots for w in workers)
    print(f"\n4. hot spot (sessions with one closed-loop stream each and one with {HOT_STREAMS} "
          f"(10x each other key's traffic), 4-turn conversations under X-Session-ID, "
          f"{b.args.max_tokens} tokens each, {b.args.seconds:g} s measured; in flight = "
          "running + waiting on each engine's /metrics, every 150 ms)")
    print(f"  (a) {HOT_SESSIONS} sessions + the hot one: the fleet under its {slots} verified "
          "slots (the concurrency each worker's capacity was verified at)")
    hotspot(b, workers, HOT_SESSIONS, judged=True)
    print(f"  (b) {b.args.conversations} sessions + the hot one: past the fleet's slots, where "
          "a free slot anywhere comes before the load bound (a full worker queues): reported, "
          "not judged")
    hotspot(b, workers, b.args.conversations, judged=False)


def hotspot(b: Bench, workers, sessions: int, judged: bool) -> None:
    args = b.args
    c, slack = balancer.LOAD_FACTOR, balancer.LOAD_SLACK
    weights = {b.engines[b.refs[w.ref]]: balancer.weight(w) for w in workers}  # by URL
    names = {url: key for key, url in b.engines.items()}
    # The harder case: a hot key whose own worker is the lighter one.
    hot_key = next(k for k in (f"hot-{i}" for i in range(1000))
                   if b.refs[session_home(workers, k)] == PROFILES[1])
    home = session_home(workers, hot_key)
    res = asyncio.run(hotspot_run(b.rigshare, list(weights), sessions, hot_key,
                                  HOT_STREAMS, args.seconds, args.max_tokens))
    raw, with_slack = load_ratios(res.samples, weights)
    total_w = sum(weights.values())
    fleet = [sum(s.values()) for s in res.samples]
    print(f"  {len(res.samples)} samples, fleet in flight p50 {pct(fleet, 0.5):.0f}, max "
          f"{max(fleet, default=0)}; per worker (weight, share of the fleet's weight, mean and "
          "max in flight): " + "; ".join(
              f"{names[u]} {w:,.0f} ({w / total_w:.0%}), "
              f"{sum(s[u] for s in res.samples) / max(len(res.samples), 1):.1f}, "
              f"{max((s[u] for s in res.samples), default=0)}" for u, w in weights.items()))
    print(f"  highest worker's (in flight / weight) / (fleet in flight / fleet weight): "
          f"p99 {pct(raw, 0.99):.2f}, max {max(raw, default=float('nan')):.2f}; with "
          f"LOAD_SLACK ({slack}) taken off each worker's in flight: p99 "
          f"{pct(with_slack, 0.99):.2f}, max {max(with_slack, default=float('nan')):.2f} "
          f"(bound c = {c:g})")
    hot_total = sum(res.hot.values())
    print(f"  hot key {hot_key!r} (its own worker {PROFILES[1]}): {hot_total} requests, "
          + ", ".join(f"{b.refs.get(ref, ref)} {n / max(hot_total, 1):.0%}"
                      for ref, n in res.hot.most_common())
          + f" ({1 - res.hot[home] / max(hot_total, 1):.0%} spilled off its own worker)")
    print(f"  X-Rigshare-Affinity: hot key {dict(res.verdicts['hot'].most_common())}, other "
          f"keys {dict(res.verdicts['other'].most_common())}; failed requests {res.failed}")
    worst = max(with_slack, default=float("inf"))
    over = sum(r > c for r in with_slack)
    print(f"  {'goal' if judged else 'for the record'}: no worker's load per weight exceeds c "
          f"times the fleet's (at every sample, in flight - {slack} <= {c:g} x its weight's "
          f"share of the fleet's in flight): max {worst:.2f}, {over} of {len(with_slack)} "
          "samples over" + (f": {'met' if worst <= c and res.samples else 'MISSED'}"
                            if judged else ""))


def section_churn(b: Bench) -> None:
    args = b.args
    step = args.ramp_step_s
    window = step / 2
    before_s, after_s = 2 * window, balancer.RAMP_STEPS * step
    print(f"\n5. churn (a) a {ADDED} joins: {args.conversations} closed-loop streams of 4-turn "
          f"conversations (a ~300-word first turn each), {args.max_tokens} tokens each; the "
          f"worker's engine starts idle and its verified rows are written {before_s:g} s "
          f"into the measured run (in traffic since then: the cold-start ramp, "
          f"{balancer.RAMP_STEPS} steps of {step:g} s, RIGSHARE_RAMP_STEP_S), then "
          f"{after_s:g} s more; windows of {window:g} s by request start")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start([sys.executable, "-m", "fleetsim", "serve", "--profile", ADDED, "--port",
                  str(port), "--time-scale", str(args.time_scale),
                  "--enable-prompt-tokens-details"], b.env, b.workdir / f"{ADDED}.log")
    b.procs.append(proc)
    wait_http(url + "/health", proc, ADDED)
    b.engines[ADDED] = url
    provider = User.objects.get(email="provider@bench.test")
    connection.close()
    added_ref = []

    def add():
        deployment = verified_deployment(provider, ADDED, url)  # in traffic from now
        b.refs[deployment.worker_ref] = ADDED
        added_ref.append(deployment.worker_ref)
        connection.close()

    results, added_at = asyncio.run(churn_add_run(b.rigshare, args.conversations, before_s,
                                                  after_s, args.max_tokens, add))
    workers = fleet_workers()
    full = {b.refs[w.ref]: balancer.weight(replace(w, ramp=1.0)) for w in workers}
    old_w = sum(w for k, w in full.items() if k != ADDED)
    pre = [r.ttft_s for t, r in results if t < 0 and r.ok]
    pre_p99 = pct(pre, 0.99)
    failed = sum(not r.ok for _, r in results)
    print(f"  {'window s':>13} {'requests':>8} {'TTFT p50':>9} {'p99 ms':>7} "
          f"{ADDED + ' tokens':>20} {'its weight share':>17}")
    by_window: dict[int, list[Result]] = {}
    for t, r in results:
        by_window.setdefault(int(t // window), []).append(r)
    worst, worst_at = 0.0, ""
    steps: dict[int, list[int]] = {}  # ramp step -> [its tokens, all tokens]
    for n in sorted(by_window):
        rs = [r for r in by_window[n] if r.ok]
        ttfts = [r.ttft_s for r in rs]
        tokens = sum(r.tokens for r in rs)
        mine = sum(r.tokens for r in rs if r.worker in added_ref)
        lo = n * window
        if n >= 0:
            ramp = min(1.0, ((lo + window / 2) // step + 1) / balancer.RAMP_STEPS)
            expect = f"{full[ADDED] * ramp / (old_w + full[ADDED] * ramp):.0%}"
            p99 = pct(ttfts, 0.99)
            if p99 > worst:
                worst, worst_at = p99, f"{lo:g}..{lo + window:g} s"
            acc = steps.setdefault(min(int(lo // step), balancer.RAMP_STEPS - 1), [0, 0])
            acc[0] += mine
            acc[1] += tokens
        else:
            expect = "-"
        print(f"  {lo:>6g}..{lo + window:<5g} {len(rs):>8} {pct(ttfts, 0.5) * 1000:>9.0f} "
              f"{pct(ttfts, 0.99) * 1000:>7.0f} {mine / max(tokens, 1):>20.0%} {expect:>17}")
    shares = [mine / max(total, 1) for _, (mine, total) in sorted(steps.items())]
    rising = len(shares) == balancer.RAMP_STEPS and all(
        a < b_ for a, b_ in zip(shares, shares[1:], strict=False))
    print(f"  {ADDED}'s share of tokens per ramp step: "
          + " -> ".join(f"{s:.0%}" for s in shares) + f"; failed requests {failed}")
    print(f"  goal: its share rises with every ramp step (never flooded, never idle): "
          f"{'met' if rising else 'MISSED'}")
    print(f"  goal: no window after the addition has a TTFT p99 above 1.5x the p99 of all "
          f"requests before it ({pre_p99 * 1000:.0f} ms): worst {worst * 1000:.0f} ms "
          f"({worst_at}, {worst / pre_p99:.2f}x): "
          f"{'met' if worst <= 1.5 * pre_p99 and not failed else 'MISSED'}")

    keys = [f"key-{i}" for i in range(args.churn_keys)]
    print(f"\n5. churn (b) a worker leaves: {len(keys):,} session keys, one one-token "
          f"follow-up each, sent one at a time through the splitter; then the {ADDED}'s node "
          "misses its heartbeats and is marked offline (marketplace.services."
          "nodes_mark_offline), the pools refresh, and the same keys are sent again")
    # Every weight settled (the ramp over): a weight that moves would move keys by itself.
    # And (a)'s in-flight counts, as the processes last exchanged them, gone.
    settle = max(added_at + (balancer.RAMP_STEPS - 1) * step, time.perf_counter())
    time.sleep(max(0.0, settle + 2 * REFRESH_S + 0.5 - time.perf_counter()))
    first = asyncio.run(key_owners(b.rigshare, keys))
    removed = added_ref[0]
    node_id = Deployment.objects.get(pk=int(removed.split(":")[1])).node_id
    marked = node_misses_heartbeats(node_id, b.env["REDIS_URL"])
    connection.close()
    time.sleep(2 * REFRESH_S + 0.5)  # both processes' pools have refreshed
    second = asyncio.run(key_owners(b.rigshare, keys))
    failed = sum(not r.ok for r in (*first.values(), *second.values()))
    before = Counter(b.refs.get(first[k].worker, first[k].worker) for k in keys)
    on_removed = [k for k in keys if first[k].ok and first[k].worker == removed]
    went = Counter(b.refs.get(second[k].worker, second[k].worker) for k in on_removed)
    moved_off = sum(second[k].ok and second[k].worker != removed for k in on_removed)
    stayed = [k for k in keys if first[k].ok and second[k].ok and first[k].worker != removed]
    moved = [k for k in stayed if second[k].worker != first[k].worker]
    spilled = [k for k in moved if balancer.SPILL in (first[k].affinity, second[k].affinity)]
    verdicts = (Counter(r.affinity for r in first.values()),
                Counter(r.affinity for r in second.values()))
    print(f"  node marked offline: {marked == [node_id]}; before: {dict(before.most_common())}"
          f"; X-Rigshare-Affinity before {dict(verdicts[0])}, after {dict(verdicts[1])}; "
          f"failed requests {failed}")
    print(f"  the {ADDED}'s {len(on_removed)} keys went to {dict(went.most_common())} "
          f"(weights: " + ", ".join(f"{k} {w:,.0f}" for k, w in full.items() if k != ADDED)
          + ")")
    print(f"  goal: every key of the worker that left moves: {moved_off}/{len(on_removed)}: "
          f"{'met' if on_removed and moved_off == len(on_removed) else 'MISSED'}")
    print(f"  goal: no key moves between the workers that stayed, beyond load-bound spills: "
          f"{len(moved)} of {len(stayed)} moved, {len(spilled)} of them spills: "
          f"{'met' if len(moved) == len(spilled) and not failed else 'MISSED'}")


def peer_row(target: Target, args, seed: int) -> dict:
    """One router's figures on the same loads: section 1's 64 streams (tokens/s, TTFT p50 and
    p99) and section 2's conversations (follow-ups that hit, follow-up TTFT p50), with
    conversations of its own (`seed`): another router's would find the engines' caches warm."""
    ttfts: list[float] = []
    tps, _ = asyncio.run(capacity_run(target, 64, args.seconds, args.max_tokens, ttfts=ttfts))
    follow_ups = asyncio.run(affinity_run(target, conversation_turns(
        args.conversations, 4, seed), 16, args.max_tokens, False))
    ok = [(r, p) for r, p in follow_ups if r.ok]
    return {"tok/s": tps, "TTFT p50": pct(ttfts, 0.5), "TTFT p99": pct(ttfts, 0.99),
            "hits": sum(hit(r, p) for r, p in ok) / max(len(follow_ups), 1),
            "follow-up TTFT p50": pct([r.ttft_s for r, _ in ok], 0.5),
            "failed": sum(not r.ok for r, _ in follow_ups)}


# For each figure: is more better?
PEER_FIGURES = {"tok/s": True, "TTFT p50": False, "TTFT p99": False, "hits": True,
                "follow-up TTFT p50": False}


def section_peers(b: Bench) -> None:
    args = b.args
    print(f"\n6. peers (the same two engines through each router: 64 closed-loop streams of "
          f"unique prompts, {args.seconds:g} s measured, and {args.conversations} 4-turn "
          "conversations 16 at a time, each router with conversations of its own; ratios are "
          "the peer's figure over Rigshare's)")
    engines = [b.engines[k] for k in PROFILES]
    model = get_profile(PROFILES[0]).model
    rows = {"Rigshare x2": peer_row(b.rigshare, args, 1000)}
    for i, (peer, policy, replicas) in enumerate(peers.CONFIGS):
        name = peers.label(peer, policy, replicas)
        try:
            with peers.running(peer, policy, replicas, engines, model, b.workdir) as urls:
                rows[name] = peer_row(Target(name, urls, model, peers.HEADERS), args,
                                      1001 + i)
        except peers.PeerUnavailable as exc:
            rows[name] = {"unavailable": exc.reason}
    ours = rows["Rigshare x2"]
    print(f"  {'router':<28} {'tok/s':>8} {'TTFT p50':>9} {'p99 ms':>7} {'hits':>6} "
          f"{'follow-up p50':>14}   ratios to Rigshare (tok/s, p50, p99, hits, follow-up)")
    behind = []
    for name, row in rows.items():
        if "unavailable" in row:
            print(f"  {name:<28} could not run: {row['unavailable']}")
            continue
        ratios = [row[f] / ours[f] if ours[f] else float("nan") for f in PEER_FIGURES]
        print(f"  {name:<28} {row['tok/s']:>8,.0f} {row['TTFT p50'] * 1000:>9.0f} "
              f"{row['TTFT p99'] * 1000:>7.0f} {row['hits']:>6.1%} "
              f"{row['follow-up TTFT p50'] * 1000:>11.0f} ms   "
              + ", ".join(f"{r:.2f}" for r in ratios)
              + (f"; {row['failed']} failed" if row["failed"] else ""))
        if name != "Rigshare x2":
            behind += [f"{name}: {f}" for f, more in PEER_FIGURES.items()
                       if (row[f] > ours[f] if more else row[f] < ours[f])]
    ran = [n for n, r in rows.items() if "unavailable" not in r and n != "Rigshare x2"]
    print(f"  goal: ahead of every peer on every figure ({len(ran)} peers ran): "
          + ("met" if ran and not behind else "MISSED" + (
              f" (behind on {'; '.join(behind)})" if behind else " (no peer ran)")))


SECTIONS = {1: section_capacity, 2: section_affinity, 3: section_context, 4: section_hotspot,
            5: section_churn, 6: section_peers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # At 1 the engines run at the cards' own speed; faster, this 2-core machine's CPU (two
    # engines, two Rigshare processes and the clients) becomes what is measured.
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="per capacity run, and the hot spot's")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=48,
                        help="section 2's conversations; sections 4 and 5's streams")
    parser.add_argument("--ramp-step-s", type=int, default=10,
                        help="the servers' cold-start ramp step (RIGSHARE_RAMP_STEP_S)")
    parser.add_argument("--churn-keys", type=int, default=2000)
    parser.add_argument("--at-once", type=int, default=32,
                        help="section 2's conversations in flight at once (32: past the "
                             "workers' load bounds, so turns spill)")
    parser.add_argument("--sections", default="1,2,3,4,5,6",
                        type=lambda v: sorted({int(n) for n in v.split(",")}),
                        help="which to run, e.g. 4,5")
    parser.add_argument("--redis-db", type=int, default=14)
    args = parser.parse_args()

    old = setup_databases(verbosity=0, interactive=False)
    db_name = settings.DATABASES["default"]["NAME"]
    procs = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    try:
        env = {**os.environ, "DATABASE_URL": bench_database_url(db_name),
               "REDIS_URL": bench_redis_url(args.redis_db), "DEBUG": "0",
               "LOG_LEVEL": "WARNING", "PYTHONWARNINGS": "ignore:No directory at",
               "RIGSHARE_RAMP_STEP_S": str(args.ramp_step_s)}
        engines = {}
        for key in PROFILES:
            port = free_port()
            engines[key] = f"http://127.0.0.1:{port}"
            procs.append(start([sys.executable, "-m", "fleetsim", "serve", "--profile", key,
                                "--port", str(port), "--time-scale", str(args.time_scale),
                                "--enable-prompt-tokens-details"], env,
                               workdir / f"{key}.log"))
        token = make_rows(engines)
        servers = []
        for i in range(2):
            port = free_port()
            servers.append(f"http://127.0.0.1:{port}")
            procs.append(start([sys.executable, "-m", "uvicorn", "config.asgi:application",
                                "--host", "127.0.0.1", "--port", str(port), "--log-level",
                                "warning", "--no-access-log"], env, workdir / f"rigshare{i}.log"))
        for key, url in engines.items():
            wait_http(url + "/health", procs[PROFILES.index(key)], key)
        for i, url in enumerate(servers):
            wait_http(url + "/healthz", procs[2 + i], f"Rigshare process {i}")
        connection.close()
        time.sleep(2.5)  # both processes' pools see the workers

        models = {key: get_profile(key).model for key in PROFILES}
        rigshare = Target("rigshare", servers, MODEL, {"Authorization": f"Bearer {token}"})
        direct = Target("direct", [engines[k] for k in PROFILES], models[PROFILES[0]])
        refs = {f"deployment:{d.pk}": d.node.name.removesuffix("-bench")
                for d in Deployment.objects.select_related("node")}
        print(f"routing benchmark: fleetsim {' + '.join(PROFILES)} at time scale "
              f"{args.time_scale:g}, two Rigshare processes (uvicorn, 1 worker each) behind a "
              f"random splitter, {os.cpu_count()} CPUs, PostgreSQL database {db_name}")
        bench = Bench(args, env, workdir, procs, engines, rigshare, direct, refs)
        for n in args.sections:
            if n in SECTIONS:
                SECTIONS[n](bench)
        # Section 5 leaves the fleet as sections 1-4 have it (the worker it added is offline
        # again; its engine runs on, idle), so section 6 drives the same two engines.
    finally:
        for proc in procs:
            stop(proc)
        connection.close()
        teardown_databases(old, verbosity=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
