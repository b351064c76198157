"""Per-key request and token limits per minute, counted in Redis so that every server process
sees the same counts. Fixed one-minute windows: simple and cheap; a burst at a window's edge
may pass twice the limit for a moment, which is the usual trade.

With Redis (production, tests) one Lua script checks and counts every limit atomically in one
round trip. Without it (the single-process demo) the local cache counts.
"""

import logging
import os
import threading
import time
from functools import cache as memoize

from django.conf import settings
from django.core.cache import cache

from config.redis import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

# KEYS: the counters; ARGV: ttl, then (amount, limit) per counter. Returns 0 when every counter
# had room (and counts the request in all of them), else the 1-based index of the full one.
_TAKE = """
for i, key in ipairs(KEYS) do
  local amount = tonumber(ARGV[2 * i])
  if tonumber(redis.call('GET', key) or '0') + amount > tonumber(ARGV[2 * i + 1]) then
    return i
  end
end
for i, key in ipairs(KEYS) do
  redis.call('INCRBY', key, ARGV[2 * i])
  redis.call('EXPIRE', key, ARGV[1])
end
return 0
"""


def _window(now: float) -> int:
    return int(now // 60)


def _counter(key_id: int, name: str, window: int) -> str:
    return f"rigshare:rl:{key_id}:{name}:{window}"


def used(*, key_id: int, name: str, now: float | None = None) -> int:
    """How much of a limit ("requests" or "tokens") the key has used in this minute."""
    key = _counter(key_id, name, _window(now or time.time()))
    if settings.REDIS_URL:
        return int(_script().registered_client.get(key) or 0)
    return cache.get(key) or 0


@memoize
def _script():
    return redis_client().register_script(_TAKE)


_own = threading.local()


def _run_script(keys: list[str], args: list[int]) -> int:
    """The script on a Redis connection of this thread's own, sent and read directly: going
    through redis-py's client (pool check-out and check-in, retry and telemetry layers) costs
    more CPU than the call itself, twice what is left here. A broken connection is dropped
    and the call made once more on a fresh one, as redis-py's client would (a count taken
    twice can only refuse early, never let more through)."""
    import redis

    try:
        return _send(keys, args)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        _own.conn.disconnect()
        _own.conn = None
        return _send(keys, args)


def _send(keys: list[str], args: list[int]) -> int:
    import redis

    script = _script()
    if (getattr(_own, "conn", None) is None or _own.pid != os.getpid()  # or forked since
            or _own.client is not script.registered_client):  # or Redis's client replaced
        _own.conn = script.registered_client.connection_pool.make_connection()
        _own.pid, _own.client = os.getpid(), script.registered_client
    try:
        _own.conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return _own.conn.read_response()
    except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts
        _own.conn.send_command("EVAL", _TAKE, len(keys), *keys, *args)
        return _own.conn.read_response()


def take(*, key_id: int, requests_limit: int | None, tokens_limit: int | None, tokens: int,
         now: float | None = None) -> str | None:
    """Count one request of `tokens` tokens; return which limit it breaks ("requests" or
    "tokens"), or None. A refused request uses none of the allowance."""
    window = _window(now or time.time())
    limits = [(name, limit, amount) for name, limit, amount in
              (("requests", requests_limit, 1), ("tokens", tokens_limit, tokens))
              if limit is not None]
    if not limits:
        return None
    keys = [_counter(key_id, name, window) for name, _, _ in limits]
    if settings.REDIS_URL:
        args = [120] + [x for _, limit, amount in limits for x in (amount, limit)]
        try:
            full = _run_script(keys, args)
        except REDIS_ERRORS:
            # Redis away: the request goes through uncounted. Rate limits protect engines, not
            # money: spend limits and balances are PostgreSQL's and still hold.
            _own.conn = None
            log.warning("rate limits not counted: Redis is away")
            return None
        return limits[full - 1][0] if full else None
    return _take_locally(keys, limits)


def _take_locally(keys, limits) -> str | None:
    for key, (name, limit, amount) in zip(keys, limits, strict=True):
        if (cache.get(key) or 0) + amount > limit:
            return name
    for key, (_, _, amount) in zip(keys, limits, strict=True):
        cache.add(key, 0, timeout=120)
        cache.incr(key, amount)
    return None
