"""API keys: `rs_<public id>_<secret>`, stored as prefix + HMAC, looked up by prefix, checked in
constant time, and cached briefly as plain values so the request path skips the database."""

from dataclasses import dataclass

from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from accounts.secrets import secret_digest, secret_issue, secret_matches, secret_prefix
from billing.models import ApiKey

KIND = "rs"
CACHE_S = 30
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
    cache.set(_cache_key(row.digest), _CHANGED, CACHE_S)
    return row


def api_key_revoke(*, user, key_id: int) -> bool:
    row = ApiKey.objects.filter(pk=key_id, user=user, revoked_at__isnull=True).first()
    if row is None:
        return False
    ApiKey.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
    cache.set(_cache_key(row.digest), _CHANGED, CACHE_S)
    return True


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
