"""The process's one synchronous Redis client (one connection pool) for what Django's cache API
does not offer: Lua scripts (rate limits), the pool's in-flight exchange, key-change
announcements; and the pool options every Redis client of the platform shares.

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


@cache
def redis_client():
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
        settings.REDIS_URL, **pool_options()))
