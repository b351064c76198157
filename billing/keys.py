"""API keys: `rs_<public id>_<secret>`, stored as prefix + HMAC, looked up by prefix, checked in
constant time, and cached briefly as plain values so the request path skips the database.

Two caches: Redis (Django's cache, shared by every process, 30 s), and on the event loop a
near cache of what was read from Redis, kept only while the process listens on a Redis channel
where every change of a key is announced. A change drops the key from the near cache of every
listening process as the announcement arrives (a fraction of a millisecond after the change;
at once in the process that made it), and a process that stops listening (Redis restarted, the
connection lost) empties its near cache and reads Redis again until it listens once more."""

import asyncio
import logging
import time
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache
from django.core.cache.backends.redis import RedisSerializer
from django.db import transaction
from django.utils import timezone

from accounts import security
from accounts.secrets import secret_check, secret_digest, secret_issue, secret_prefix
from billing.models import ApiKey
from billing.pricing import format_usd
from config.redis import REDIS_ERRORS, async_redis_client, redis_client

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


UNLIMITED_ACTION = "create an API key with no spend limit"
# A period's limit as what it may spend in a month (31 days, at most 5 weeks in one).
PERIODS_A_MONTH = {"daily": 31, "weekly": 5, "monthly": 1}


def spend_a_month(limit_micros: int | None, period: str) -> int | None:
    """What a key with this limit may spend in a month at most; None: its whole balance."""
    return None if limit_micros is None else limit_micros * PERIODS_A_MONTH[period]


def large_spend_action(limit_micros: int | None, period: str) -> str | None:
    """The phrase for what needs a verified email and two-factor, when a key with this limit
    may spend more than RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS a month; None when it may not."""
    monthly = spend_a_month(limit_micros, period)
    if monthly is None:
        return UNLIMITED_ACTION
    if monthly > settings.RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS:
        return (f"use an API key that may spend more than "
                f"{format_usd(settings.RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS)} a month")
    return None


def api_key_create(*, user, name: str, by_operator: bool = False,
                   **limits) -> tuple[ApiKey, str]:
    """A new key, its secret returned this once. A key that may spend the whole balance, or
    more than RIGSHARE_KEY_SPEND_WITHOUT_2FA_MICROS a month, needs a verified email and
    two-factor (security.NeedsStrongerAccount otherwise), unless an operator makes it on their
    own authority (`manage.py create_api_key`, the demo's set-up, the benchmarks); the holder
    is emailed of every new key."""
    action = large_spend_action(limits.get("spend_limit_micros"),
                                limits.get("spend_period", ApiKey.Period.MONTHLY))
    if action is not None and not by_operator:
        security.require_strong_account(user, action)
    issued = secret_issue(KIND)
    with transaction.atomic():
        row = ApiKey.objects.create(user=user, name=name, prefix=issued.prefix,
                                    digest=issued.digest, **limits)
        security.security_email_on_commit(
            user, "new_api_key", {"key_name": row.name, "key_prefix": f"rs_{row.prefix}_",
                                  "spend_limit": None if row.spend_limit_micros is None
                                  else format_usd(row.spend_limit_micros)})
    return row, issued.token


def api_key_update(*, user, key_id: int, **fields) -> ApiKey:
    with transaction.atomic():
        row = ApiKey.objects.select_for_update().get(pk=key_id, user=user)
        before = spend_a_month(row.spend_limit_micros, row.spend_period)
        for name, value in fields.items():
            setattr(row, name, value)
        after = spend_a_month(row.spend_limit_micros, row.spend_period)
        raised = after is None and before is not None or (
            after is not None and before is not None and after > before)
        action = large_spend_action(row.spend_limit_micros, row.spend_period)
        if raised and action is not None:
            security.require_strong_account(
                user, "remove a key's spend limit" if after is None else action)
        row.save()
    _changed(row.digest)
    return row


def api_keys_revoke_all(*, user) -> int:
    """Revoke every active key of the user (a password reset after a suspected takeover):
    each is refused from now on, in every process. Returns how many."""
    rows = list(ApiKey.objects.filter(user=user, revoked_at__isnull=True)
                .values_list("pk", "digest"))
    ApiKey.objects.filter(pk__in=[pk for pk, _ in rows]).update(revoked_at=timezone.now())
    for _, digest in rows:
        _changed(digest)
    return len(rows)


def api_keys_active(user) -> list[str]:
    """The user's active keys as a security email names them: name and public prefix."""
    return [f"{name} (rs_{prefix}_…)" for name, prefix in ApiKey.objects.filter(
        user=user, revoked_at__isnull=True).order_by("created_at").values_list("name",
                                                                            "prefix")]


def api_key_revoke(*, user, key_id: int) -> bool:
    row = ApiKey.objects.filter(pk=key_id, user=user, revoked_at__isnull=True).first()
    if row is None:
        return False
    ApiKey.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
    _changed(row.digest)
    return True


def _changed(digest: str) -> None:
    """Every cached copy of the key goes: Redis's, this process's, and (announced) every other
    process's near cache. With Redis away the database has the change already; each process
    empties its near cache when its listener loses Redis, and Redis's copy expires."""
    _NEAR.drop(digest)
    try:
        cache.set(_cache_key(digest), _CHANGED, CACHE_S)
        if settings.REDIS_URL:
            redis_client().publish(CHANNEL, digest)
    except REDIS_ERRORS:
        log.warning("API key change not announced: Redis is away")


def api_key_authenticate(token: str) -> KeyInfo | None:
    """The key's limits as plain values, or None for an unknown, forged or revoked key."""
    prefix = secret_prefix(token, KIND)
    if prefix is None:
        return None
    digest = secret_digest(token)
    try:
        cached = cache.get(_cache_key(digest))
    except REDIS_ERRORS:  # Redis away: the database answers
        cached = None
    if cached is not None and cached != _CHANGED:
        return cached or None
    row = ApiKey.objects.filter(prefix=prefix).first()
    kept = secret_check(token, row.digest) if row is not None else None
    ok = kept is not None and row.revoked_at is None
    info = KeyInfo.of(row) if ok else None
    try:
        cache.add(_cache_key(digest), info or False, CACHE_S)
    except REDIS_ERRORS:
        pass
    if ok:
        # A digest made under a SECRET_KEY since replaced is re-hashed on this use: the key's
        # cached copies are named by its digest under SECRET_KEY (`digest`), as its row now is.
        ApiKey.objects.filter(pk=row.pk).update(last_used_at=timezone.now(), digest=kept)
    return info


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
    try:
        raw = await async_redis_client().get(cache.make_key(_cache_key(digest)))
    except REDIS_ERRORS:  # Redis away: the caller checks the key in the database
        return False, None
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
        """SUBSCRIBE on a plain asyncio connection, speaking RESP itself: redis-py's pubsub
        reader was seen to swallow the cancellation of its task (asyncio.run then never
        returns), and this needs three commands."""
        writer = None
        try:
            reader, writer = await _redis_connect(settings.REDIS_URL)
            writer.write(_command("CLIENT", "SETNAME", LISTENER_NAME)
                         + _command("SUBSCRIBE", CHANNEL))
            if await _reply(reader) != "OK":
                raise ConnectionError("CLIENT SETNAME refused")
            quiet = 0
            while True:
                try:
                    async with asyncio.timeout(10.0):
                        message = await _reply(reader)
                except TimeoutError:
                    # Nothing for 10 s: ask. No answer for another 10: the connection is dead.
                    quiet += 1
                    if quiet > 1:
                        raise ConnectionError("Redis did not answer a PING") from None
                    writer.write(_command("PING"))
                    continue
                quiet = 0
                kind = message[0] if isinstance(message, list) and message else None
                if kind == b"subscribe":
                    self.clear()  # anything announced before now was missed
                    self.listening = True
                elif kind == b"message":
                    self.drop(message[2].decode())
        except (OSError, ConnectionError, EOFError, ValueError) as exc:
            # Redis away: read it directly until listening again.
            log.warning("API key announcements lost (%s): near cache off", exc)
        finally:
            self.listening = False
            self.clear()
            if writer is not None:
                writer.close()


async def _redis_connect(url: str):
    from redis.connection import parse_url

    options = parse_url(url)
    if "path" in options:
        reader, writer = await asyncio.open_unix_connection(options["path"])
    else:
        reader, writer = await asyncio.open_connection(
            options.get("host", "localhost"), options.get("port", 6379),
            ssl=True if url.startswith("rediss://") else None)
    if options.get("password"):
        auth = [options["username"]] if options.get("username") else []
        writer.write(_command("AUTH", *auth, options["password"]))
        if await _reply(reader) != "OK":
            raise ConnectionError("Redis refused the password")
    return reader, writer


def _command(*parts: str) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


async def _reply(reader: asyncio.StreamReader):
    """One RESP2 reply: "OK"-style strings as str, bulk strings as bytes, arrays as lists."""
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        raise ConnectionError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        return None if size < 0 else (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        return [await _reply(reader) for _ in range(int(rest))]
    raise ValueError(f"unexpected Redis reply {line[:40]!r}")


_NEAR = _NearCache()


def near_cache_clear() -> None:
    """Empty this process's near cache (tests that empty Redis empty it too)."""
    _NEAR.clear()
