"""Unannounced checks: a few requests at random times to every worker in the pool, sent the way
the proxy sends a renter's (routing/proxy.py: the same connection pool, headers, engine key and
body, with the usage chunk asked for), with prompts of the kind real traffic has, so that an
engine cannot tell them from traffic. Nobody is billed for them: they never reach metering.
Each is written to the request log as served traffic (endpoint "check", no user), so it counts
in the live figures and their drift (routing/served.py), and to the node's history of checks.

When: each deployment's next check is drawn at random after the last (exponential, mean
CHECK_EVERY), so no schedule can be learnt; `checks_due` picks those whose time has come.
"""

import asyncio
import json
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from routing import openai, proxy, requestlog, sse, upstream
from routing.models import Deployment, UnannouncedCheck
from routing.placement import Worker

CHECK_EVERY = timedelta(hours=2)  # the mean time between two checks of a deployment
REQUESTS = 3  # per check, one after another
MAX_TOKENS = (96, 256)  # each request's bound, drawn in this range
PROMPTS = (
    "Can you explain the difference between a process and a thread, with an example?",
    "Write a short email to a colleague asking to move our meeting to Thursday afternoon.",
    "Summarize the main causes of the French Revolution in a few paragraphs.",
    "What are good practices for naming variables in Python? Give examples.",
    "I have 3 apples and buy 2 bags of 6. How many apples do I have? Show your steps.",
    "Suggest a three-day itinerary for a first visit to Lisbon.",
    "How does HTTPS keep a connection private? Explain it to a beginner.",
    "Write a limerick about a cat who learns to code.",
    "What should I check before buying a used car?",
    "Translate to Spanish: The meeting has been postponed until next week.",
)


def next_at(now: datetime, rng: random.Random | None = None) -> datetime:
    rng = rng or random.SystemRandom()
    return now + timedelta(seconds=rng.expovariate(1 / CHECK_EVERY.total_seconds()))


def checks_due(*, now: datetime | None = None, limit: int = 50) -> list[int]:
    """Deployments whose check is due (a new one's first check is drawn now), each given its
    next time at once, so that two schedulers never check one twice."""
    now = now or timezone.now()
    fresh = Deployment.objects.filter(next_check_at__isnull=True, reported=True)
    for pk in fresh.values_list("pk", flat=True)[:1000]:
        Deployment.objects.filter(pk=pk, next_check_at__isnull=True).update(
            next_check_at=next_at(now))
    due = []
    for pk, at in (Deployment.objects.filter(reported=True, healthy=True,
                                              next_check_at__lte=now)
                   .values_list("pk", "next_check_at")[:limit]):
        if Deployment.objects.filter(pk=pk, next_check_at=at).update(
                next_check_at=next_at(now)):
            due.append(pk)
    return due


@dataclass
class Sent:
    status: int
    started: float  # time.perf_counter()
    ttft_s: float | None = None
    ended: float | None = None
    completion_tokens: int = 0
    stream: bool = True


async def _one(worker: Worker, prompt: str, max_tokens: int) -> Sent:
    """One request, as the proxy would send a renter's streamed chat request."""
    raw = json.dumps({"model": worker.engine_model, "stream": True, "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": prompt}]}).encode()
    request = openai.parse(raw, "chat")
    body = openai.upstream_body(request, engine_model=worker.engine_model,
                                max_tokens=max_tokens)
    sent = Sent(status=200, started=time.perf_counter())
    try:
        resp = await proxy._open_stream(worker, "/v1/chat/completions", body)
    except Exception:  # unreachable, 5xx, refused: what a renter would have met
        sent.status = 502
        return sent
    state = sse.StreamState(True, sse.model_patterns(worker.engine_model),
                            sse.model_patterns(worker.engine_model))
    reader = upstream.body_reader(resp)
    try:
        while data := await reader.read():
            if state.feed(data) and sent.ttft_s is None:
                sent.ttft_s = time.perf_counter() - sent.started
    except Exception:
        sent.status = 502
    finally:
        await resp.aclose()
    sent.ended = time.perf_counter()
    sent.completion_tokens = int((state.usage or {}).get("completion_tokens") or state.delivered)
    if sent.status == 200 and not state.done:
        sent.status = 502
    return sent


async def check(worker: Worker, *, rng: random.Random | None = None,
                requests: int = REQUESTS) -> list[Sent]:
    rng = rng or random.SystemRandom()
    out = []
    for _ in range(requests):
        out.append(await _one(worker, rng.choice(PROMPTS), rng.randint(*MAX_TOKENS)))
    return out


def check_record(*, worker: Worker, sent: list[Sent], concurrency: int,
                 now: datetime | None = None) -> UnannouncedCheck:
    """The check in the node's history, and its requests in the request log (the live
    figures count them as served traffic; no user, no charge)."""
    now = now or timezone.now()
    rows = []
    for i, s in enumerate(sent):
        latency = (s.ended or time.perf_counter()) - s.started
        rows.append(dict(
            request_id=f"check-{worker.deployment_id}-{int(now.timestamp())}-{i}",
            created_at=now - timedelta(seconds=latency), user_id=None, api_key_id=None,
            endpoint="check", model=worker.engine_model, deployment_id=worker.deployment_id,
            stream=True, status=s.status, error_code="" if s.status == 200 else "check_failed",
            attempts=1, prompt_tokens=0, completion_tokens=s.completion_tokens,
            estimated=False, ttft_ms=None if s.ttft_s is None else round(s.ttft_s * 1000, 3),
            latency_ms=round(latency * 1000, 3), concurrency=concurrency))
    timed = [s for s in sent if s.status == 200 and s.ttft_s is not None and s.ended
             and s.completion_tokens > 1 and s.ended - s.started > s.ttft_s]
    tokens = sum(s.completion_tokens - 1 for s in timed)
    seconds = sum(s.ended - s.started - s.ttft_s for s in timed)
    ttfts = sorted(s.ttft_s for s in timed)
    with transaction.atomic():
        requestlog.write(rows)
        return UnannouncedCheck.objects.create(
            deployment_id=worker.deployment_id, node_id=worker.node_id, at=now,
            model=worker.engine_model, requests=len(sent),
            errors=sum(s.status != 200 for s in sent), concurrency=concurrency,
            tokens_per_s=round(tokens / seconds, 2) if seconds > 0 else None,
            ttft_ms=round(ttfts[len(ttfts) // 2] * 1000, 1) if ttfts else None)


def checks_run(*, now: datetime | None = None) -> int:
    """Check every deployment whose time has come; returns the checks made."""
    from routing import pool

    due = checks_due(now=now)
    if not due:
        return 0
    workers = pool.workers_of(due)
    load = pool.load_seen()
    results = asyncio.run(_all(workers))
    for worker, sent in zip(workers, results, strict=True):
        check_record(worker=worker, sent=sent, concurrency=load.get(worker.deployment_id, 0) + 1)
    return len(workers)


async def _all(workers: list[Worker]) -> list[list[Sent]]:
    try:
        return await asyncio.gather(*(check(w) for w in workers))
    finally:
        client = proxy._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()


def history(node_id: int, *, limit: int = 10):
    return UnannouncedCheck.objects.filter(node_id=node_id).order_by("-at")[:limit]

