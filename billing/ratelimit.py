"""Per-key request and token limits per minute, counted in the shared cache (Redis), so every
server process sees the same counts. Fixed one-minute windows: simple and cheap; a burst at a
window's edge may pass twice the limit for a moment, which is the usual trade."""

import time

from django.core.cache import cache


def _window(now: float) -> int:
    return int(now // 60)


def take(*, key_id: int, requests_limit: int | None, tokens_limit: int | None, tokens: int,
         now: float | None = None) -> str | None:
    """Count one request of `tokens` tokens; return which limit it breaks, or None."""
    window = _window(now or time.time())
    taken = []
    for name, limit, amount in (("requests", requests_limit, 1),
                                ("tokens", tokens_limit, tokens)):
        if limit is None:
            continue
        counter = f"rl:{key_id}:{name}:{window}"
        cache.add(counter, 0, timeout=120)
        taken.append((counter, amount))
        if cache.incr(counter, amount) > limit:
            for done, done_amount in taken:  # a refused request uses none of the allowance
                cache.decr(done, done_amount)
            return name
    return None
