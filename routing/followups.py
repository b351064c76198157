"""Where a conversation's latest turn was served, for its next turn to go there too.

The balancer sends a conversation's every turn to the same worker by its affinity key
(routing/balancer.py): that worker's prefix cache holds the history, and a follow-up costs
0.54 s there against 2.56 s elsewhere (published fleet figures). When a turn spills (its worker
busy, or failed before answering), another worker answers it and from then on holds the longer
history; the key still ranks the first worker highest, so the next turn would go back to a
cache that stops a turn short. So each server process records, in Redis, the worker that served
a turn whenever it is not the one the next turn would be sent to anyway, and a follow-up asks
for it first: every process, and every worker process of the server, sees the same record.

One key per conversation (`rigshare:followup:<affinity key>`), the deployment id, kept for
HOLD_S after the turn that last read or wrote it (an engine's prefix cache does not keep an
idle conversation much longer under load). Redis away: no record, the ranking alone decides,
as before.
"""

import asyncio
import logging

from django.conf import settings

from config.redis import REDIS_ERRORS, async_redis_client

log = logging.getLogger(__name__)

PREFIX = "rigshare:followup:"
HOLD_S = 600
LOOKUP_TIMEOUT_S = 0.05  # a slow Redis must not hold a request up: the ranking decides then

_pending: set[asyncio.Task] = set()


def _key(affinity_key: bytes) -> str:
    return PREFIX + affinity_key.hex()


async def holder(affinity_key: bytes) -> int | None:
    """The deployment that served this conversation's latest turn, if one other than the
    ranking's choice did within HOLD_S (the record's time starts again)."""
    if not settings.REDIS_URL:
        return None
    try:
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            raw = await async_redis_client().getex(_key(affinity_key), ex=HOLD_S)
    except (TimeoutError, *REDIS_ERRORS):
        return None
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def served(affinity_key: bytes, deployment_id: int) -> None:
    """Record that this deployment served the conversation's latest turn, without waiting."""
    if not settings.REDIS_URL:
        return
    task = asyncio.get_running_loop().create_task(_record(affinity_key, deployment_id))
    _pending.add(task)
    task.add_done_callback(_pending.discard)


async def _record(affinity_key: bytes, deployment_id: int) -> None:
    try:
        await async_redis_client().set(_key(affinity_key), deployment_id, ex=HOLD_S)
    except REDIS_ERRORS:
        log.debug("follow-up record not kept: Redis is away")
