"""The process's one synchronous Redis client (one connection pool) for what Django's cache API
does not offer: Lua scripts (rate limits), the pool's in-flight exchange, key-change
announcements."""

from functools import cache

from django.conf import settings


@cache
def redis_client():
    import redis

    return redis.Redis.from_url(settings.REDIS_URL)
