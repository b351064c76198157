"""The process's one synchronous Redis client (one connection pool) for what Django's cache API
does not offer: Lua scripts (rate limits), the pool's in-flight exchange, key-change
announcements; one asyncio client per event loop for what the ASGI front and /v1 read on the
loop (heartbeat entries, API keys, where a conversation was served); and the pool options
every Redis client of the platform shares.

Every pool blocks for a free connection (up to POOL_TIMEOUT_S) instead of failing when a burst
wants more than it holds, checks an idle connection before using it again (a Redis restart
leaves every pooled connection dead), and retries a command once on a fresh connection.
Redis holds nothing the platform cannot do without: callers fall back when it is away (API
keys are checked in PostgreSQL, rate limits let requests through, each process counts its own
in-flight requests)."""

from functools import cache

import redis
from django.conf import settings

# What a Redis that is away raises: callers catch these and fall back.
REDIS_ERRORS = (redis.exceptions.RedisError, OSError)

MAX_CONNECTIONS = 256  # per process and pool: above /v1's concurrency per worker process
POOL_TIMEOUT_S = 2.0


def pool_options() -> dict:
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return {"max_connections": MAX_CONNECTIONS, "timeout": POOL_TIMEOUT_S,
            "health_check_interval": 10, "socket_connect_timeout": 1.0, "socket_timeout": 2.0,
            "retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), 1)}


_async_clients: dict = {}


def async_redis_client():
    """This event loop's asyncio Redis client (a client's connections belong to the loop that
    made them), on REDIS_URL as it is now."""
    import asyncio

    import redis.asyncio

    loop = asyncio.get_running_loop()
    found = _async_clients.get(loop)
    if found is None or found[0] != settings.REDIS_URL:
        pool = redis.asyncio.BlockingConnectionPool.from_url(settings.REDIS_URL,
                                                             **_async_pool_options())
        found = _async_clients[loop] = (settings.REDIS_URL,
                                        redis.asyncio.Redis(connection_pool=pool))
    return found[1]


def _async_pool_options() -> dict:
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    return pool_options() | {"retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), 1)}


@cache
def redis_client():
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
        settings.REDIS_URL, **pool_options()))
