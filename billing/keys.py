"""API keys: `rs_<public id>_<secret>`, stored as prefix + HMAC, looked up by prefix, checked in
constant time, and cached briefly as plain values so the request path skips the database.

Two caches: Redis (Django's cache, shared by every process, 30 s), and on the event loop a
near cache of what was read from Redis, kept only while the process listens on a Redis channel
where every change of a key is announced. A change drops the key from the near cache of every
listening process as the announcement arrives (a fraction of a millisecond after the change;
at once in the process that made it), and a process that stops listening (Redis restarted, the
connection lost) empties its near cache and reads Redis again until it listens once more."""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache
from django.core.cache.backends.redis import RedisSerializer
from django.db import transaction
from django.utils import timezone

from accounts.secrets import secret_digest, secret_issue, secret_matches, secret_prefix
from billing.models import ApiKey

log = logging.getLogger(__name__)

KIND = "rs"
CACHE_S = 30
CHANNEL = "rigshare:apikey-changed"  # a changed key's digest is published here
LISTENER_NAME = "rigshare-apikey-listener"  # its Redis connection's name, as CLIENT LIST shows
NEAR_MAX = 100_000  # entries in a process's near cache before it starts over
# Written over a key's cache entry when the key changes. Lookups never overwrite it (they use
# cache.add), so a lookup that read the row just before the change cannot cache what it read.
_CHANGED = "changed"


@dataclass(frozen=True)
class KeyInfo:
    key_id: int
    user_id: int
    name: str
    allowed_models: tuple[str, ...]
    spend_limit_micros: int | None
    spend_period: str
    requests_per_minute: int | None
    tokens_per_minute: int | None

    @classmethod
    def of(cls, row: ApiKey) -> "KeyInfo":
        return cls(row.pk, row.user_id, row.name, tuple(row.allowed_models or ()),
                   row.spend_limit_micros, row.spend_period, row.requests_per_minute,
                   row.tokens_per_minute)


def _cache_key(digest: str) -> str:
    return f"apikey:{digest}"


def api_key_create(*, user, name: str, **limits) -> tuple[ApiKey, str]:
    issued = secret_issue(KIND)
    row = ApiKey.objects.create(user=user, name=name, prefix=issued.prefix,
                                digest=issued.digest, **limits)
    return row, issued.token


def api_key_update(*, user, key_id: int, **fields) -> ApiKey:
    with transaction.atomic():
        row = ApiKey.objects.select_for_update().get(pk=key_id, user=user)
        for name, value in fields.items():
            setattr(row, name, value)
        row.save()
    _changed(row.digest)
    return row


def api_key_revoke(*, user, key_id: int) -> bool:
    row = ApiKey.objects.filter(pk=key_id, user=user, revoked_at__isnull=True).first()
    if row is None:
        return False
    ApiKey.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
    _changed(row.digest)
    return True


def _changed(digest: str) -> None:
    """Every cached copy of the key goes: Redis's, this process's, and (announced) every other
    process's near cache."""
    cache.set(_cache_key(digest), _CHANGED, CACHE_S)
    _NEAR.drop(digest)
    if settings.REDIS_URL:
        _sync_redis().publish(CHANNEL, digest)


def api_key_authenticate(token: str) -> KeyInfo | None:
    """The key's limits as plain values, or None for an unknown, forged or revoked key."""
    prefix = secret_prefix(token, KIND)
    if prefix is None:
        return None
    digest = secret_digest(token)
    cached = cache.get(_cache_key(digest))
    if cached is not None and cached != _CHANGED:
        return cached or None
    row = ApiKey.objects.filter(prefix=prefix).first()
    ok = row is not None and row.revoked_at is None and secret_matches(token, row.digest)
    info = KeyInfo.of(row) if ok else None
    cache.add(_cache_key(digest), info or False, CACHE_S)
    if ok:
        ApiKey.objects.filter(pk=row.pk).update(last_used_at=timezone.now())
    return info


_clients: dict = {}


def _sync_redis():
    import redis

    client = _clients.get("sync")
    if client is None:
        client = _clients["sync"] = redis.Redis.from_url(settings.REDIS_URL)
    return client


def _async_redis():
    """One asyncio Redis client per event loop (its connections belong to that loop)."""
    import redis.asyncio

    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = redis.asyncio.Redis.from_url(settings.REDIS_URL)
    return client


async def api_key_cached(token: str) -> tuple[bool, KeyInfo | None]:
    """(True, what api_key_authenticate would answer) when the answer is cached: in this
    process's near cache, or in Redis, read on the event loop (one async Redis GET) instead of
    from a thread; (False, None) when the caller must ask api_key_authenticate. The Redis entry
    is the one api_key_authenticate writes through Django's cache, read with Django's own key
    and serializer."""
    if secret_prefix(token, KIND) is None:
        return True, None
    if not settings.REDIS_URL:
        return False, None
    digest = secret_digest(token)
    near = _NEAR.usable()
    if near:
        hit = _NEAR.entries.get(digest)
        if hit is not None and hit[0] > time.monotonic():
            return True, hit[1]
    generation = _NEAR.generation
    raw = await _async_redis().get(cache.make_key(_cache_key(digest)))
    if raw is None:
        return False, None
    cached = RedisSerializer().loads(raw)
    if cached == _CHANGED:
        return False, None
    info = cached or None
    if near and _NEAR.generation == generation and _NEAR.usable():
        # Nothing was announced while Redis answered: what it said still holds.
        if len(_NEAR.entries) >= NEAR_MAX:
            _NEAR.entries.clear()
        _NEAR.entries[digest] = (time.monotonic() + CACHE_S, info)
    return True, info


class _NearCache:
    def __init__(self):
        self.entries: dict[str, tuple[float, KeyInfo | None]] = {}
        self.generation = 0  # announcements received; a read that spans one is not kept
        self.listening = False  # subscribed, and the announcements are being read
        self.loop = None  # the event loop the listener runs on
        self.task = None
        self.next_try = 0.0

    def usable(self) -> bool:
        """True when entries may be used (the listener is live); otherwise starts one, at most
        once a second, on the running loop."""
        if self.listening and self.loop.is_running():
            return True
        if self.task is None or self.task.done() or self.loop.is_closed():
            now = time.monotonic()
            if now >= self.next_try:
                self.next_try = now + 1.0
                self.loop = asyncio.get_running_loop()
                self.task = self.loop.create_task(self._listen())
        return False

    def drop(self, digest: str) -> None:
        self.generation += 1
        self.entries.pop(digest, None)

    def clear(self) -> None:
        self.generation += 1
        self.entries.clear()

    async def _listen(self) -> None:
        import redis.asyncio

        # A ping every 10 s while listening: a connection that died silently is noticed.
        client = redis.asyncio.Redis.from_url(settings.REDIS_URL, health_check_interval=10,
                                              client_name=LISTENER_NAME)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(CHANNEL)
            async for message in pubsub.listen():
                if message["type"] == "subscribe":
                    self.clear()  # anything announced before now was missed
                    self.listening = True
                elif message["type"] == "message":
                    self.drop(message["data"].decode())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis away: read it directly until listening again
            log.warning("API key announcements lost (%s): near cache off", exc)
        finally:
            self.listening = False
            self.clear()
            with contextlib.suppress(Exception):  # the connection is gone either way
                await pubsub.aclose()
                await client.aclose()


_NEAR = _NearCache()


def near_cache_clear() -> None:
    """Empty this process's near cache (tests that empty Redis empty it too)."""
    _NEAR.clear()
