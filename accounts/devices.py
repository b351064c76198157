"""Which browsers a user logs in from, so that a log-in from a new one is emailed.

A browser is known by a random id in a signed, long-lived cookie; the platform keeps only its
SHA-256 per user. The first browser an account ever uses (the one it signed up in) is recorded
without a notice; every browser after it is news to the holder once.
"""

import hashlib
import secrets

from django.core import signing

from accounts.models import LoginDevice
from config.client_ip import client_ip

COOKIE = "rs_device"
COOKIE_MAX_AGE_S = 2 * 365 * 24 * 3600
_SALT = "rigshare.login-device"


def _digest(device_id: str) -> str:
    return hashlib.sha256(device_id.encode()).hexdigest()


def device_id_of(request) -> str | None:
    raw = request.COOKIES.get(COOKIE, "")
    try:
        return signing.loads(raw, salt=_SALT) if raw else None
    except signing.BadSignature:
        return None  # a forged or foreign cookie is a browser we do not know


def signed_cookie_value(device_id: str) -> str:
    return signing.dumps(device_id, salt=_SALT)


def login_seen(request, user) -> LoginDevice | None:
    """Record the browser of a log-in; the new device row when it is news to the holder (the
    account has logged in from another browser before), else None."""
    device_id = device_id_of(request)
    if device_id is None:
        device_id = secrets.token_urlsafe(24)
        request.rigshare_new_device_id = device_id  # the middleware sets the cookie
    fields = {"user_agent": request.META.get("HTTP_USER_AGENT", "")[:300],
              "ip": client_ip(request)}
    row, created = LoginDevice.objects.update_or_create(
        user=user, digest=_digest(device_id), defaults=fields)
    if not created:
        return None
    first = not LoginDevice.objects.filter(user=user).exclude(pk=row.pk).exists()
    return None if first else row
