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
   (always the same worker, three conversations in four on the PRO 6000). Goals: at least 97% of follow-ups hit; follow-up TTFT p50 within
   1.2x of pinned.
3. Context: prompts that both workers hold, that only the PRO 6000 holds, and that none does
   (a 400 `context_length_exceeded`).
Run by `make bench-routing`; figures in docs/benchmarks.md.
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
from dataclasses import dataclass, field
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
from django.test.utils import setup_databases, teardown_databases  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import User  # noqa: E402
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
from billing.keys import api_key_create  # noqa: E402
from billing.models import ModelPrice  # noqa: E402
from billing.services import credits_grant  # noqa: E402
from fleetsim.profiles import get_profile  # noqa: E402
from routing.models import Deployment, EngineModel, Model  # noqa: E402

MODEL = "qwen3-27b"
PROFILES = ("rtx-pro-6000", "2x-rtx-4090")
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
    _, token = api_key_create(user=consumer, name="bench")
    return token


async def stream(client: httpx.AsyncClient, url: str, model: str, messages: list,
                 max_tokens: int, headers: dict,
                 window: tuple[float, float] = (0.0, float("inf"))) -> Result:
    """One streamed chat completion; `tokens` counts the content chunks that arrived within
    `window` (perf_counter times)."""
    started = time.perf_counter()
    ttft, tokens, usage, worker = None, 0, {}, url
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Result(url, 0.0, 0, ok=False)
            worker = resp.headers.get("x-rigshare-worker", url)
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
                  details.get("cached_tokens", 0))


# --- 1. capacity ---

async def capacity_run(target: Target, streams: int, seconds: float, max_tokens: int,
                       pro_streams: int | None = None) -> tuple[float, Counter]:
    """Tokens/s of `streams` closed-loop clients, counted as they arrive over `seconds` after
    a warm-up in which every client's first streams settle in; tokens per worker. Direct:
    `pro_streams` of the clients drive the PRO 6000, the rest the pair."""
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
            r = await stream(http, url, target.model, messages, max_tokens, target.headers,
                             (begin, end))
            per_worker[r.worker] += r.tokens

    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client_loop(c, http) for c in range(streams)))
    return sum(per_worker.values()) / seconds, per_worker


# --- 2. affinity ---

def conversation_turns(n: int, turns: int) -> list[list[str]]:
    rng = random.Random(42)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # At 1 the engines run at the cards' own speed; faster, this 2-core machine's CPU (two
    # engines, two Rigshare processes and the clients) becomes what is measured.
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=8.0, help="per capacity run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--redis-db", type=int, default=14)
    args = parser.parse_args()

    old = setup_databases(verbosity=0, interactive=False)
    db_name = settings.DATABASES["default"]["NAME"]
    procs = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    try:
        env = {**os.environ, "DATABASE_URL": bench_database_url(db_name),
               "REDIS_URL": bench_redis_url(args.redis_db), "DEBUG": "0",
               "LOG_LEVEL": "WARNING", "PYTHONWARNINGS": "ignore:No directory at"}
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

        print(f"\n2. affinity ({args.conversations} conversations, a shared ~{len(SYSTEM)//4}"
              f"-token system prompt, a ~1,500-word first turn each, 4 turns, 16 at a time)")
        conversations = conversation_turns(args.conversations, 4)
        pinned = asyncio.run(affinity_run(direct, conversations, 16, args.max_tokens, True))
        routed = asyncio.run(affinity_run(rigshare, conversations[::-1], 16, args.max_tokens,
                                          False))
        for name, results in (("pinned (direct)", pinned), ("Rigshare", routed)):
            ok = [(r, p) for r, p in results if r.ok]
            hits = sum(hit(r, p) for r, p in ok)
            ttfts = [r.ttft_s for r, _ in ok]
            print(f"  {name}: {len(results)} follow-ups, {hits / max(len(ok), 1):.1%} found "
                  f"their whole history cached; TTFT p50 {pct(ttfts, 0.5) * 1000:.0f} ms, p99 "
                  f"{pct(ttfts, 0.99) * 1000:.0f} ms")
        hit_rate = sum(hit(r, p) for r, p in routed) / max(len(routed), 1)
        ttft_ratio = (pct([r.ttft_s for r, _ in routed if r.ok], 0.5)
                      / pct([r.ttft_s for r, _ in pinned if r.ok], 0.5))
        print(f"  goal 97% of follow-ups hit: {hit_rate:.1%}: "
              f"{'met' if hit_rate >= 0.97 else 'MISSED'}; goal follow-up TTFT p50 within "
              f"1.2x of pinned: {ttft_ratio:.2f}x: {'met' if ttft_ratio <= 1.2 else 'MISSED'}")
        print("\n3. context (one word a token; max_tokens 1)")
        pair_context = get_profile(PROFILES[1]).context_length
        for words, expect in ((40_000, "any"), (pair_context + 20_000, PROFILES[0]),
                              (300_000, "400")):
            answers = asyncio.run(context_run(rigshare, words, 3))
            seen = Counter(refs.get(a, a) for a in answers)
            if expect == "400":
                good = set(seen) == {"400 context_length_exceeded"}
            elif expect == "any":
                good = all(k in PROFILES for k in seen)
            else:
                good = set(seen) == {expect}
            print(f"  ~{words:,}-token prompt: {dict(seen)} (should reach "
                  f"{'every worker that holds it' if expect == 'any' else expect}: "
                  f"{'met' if good else 'MISSED'})")
        print("\nsections 4-6 (hot spot, churn, peers) are not measured yet")
    finally:
        for proc in procs:
            stop(proc)
        connection.close()
        teardown_databases(old, verbosity=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
