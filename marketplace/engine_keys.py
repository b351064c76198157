"""Engine keys: what a node's engine takes as `--api-key`, so that it answers the platform only.

Unlike a credential, an engine key cannot be stored as an HMAC: the platform sends it with every
request it makes to the engine (routing/proxy.py, the health checks, the load tests). It is
stored sealed (Fernet: AES-128-CBC + HMAC-SHA256) under a key derived from SECRET_KEY, so that a
copy of the database alone serves nobody's engine. When SECRET_KEY rotates, keys sealed under one
of SECRET_KEY_FALLBACKS still open (MultiFernet), and `reseal` seals them again under the new one
(`manage.py secrets_reseal`). A key sealed under a secret that is gone entirely is unreadable:
its node is then issued a new one at its next heartbeat (node_engine_key_sync).

A key is named by its fingerprint (the first 16 hex digits of its SHA-256): the agent reports the
fingerprint of the key its engine runs with, never the key. No ORM here.
"""

import base64
import hashlib
import secrets

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings

PREFIX = "rsk_"


def issue() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def _one(secret: str) -> Fernet:
    derived = hashlib.sha256(b"rigshare engine keys\0" + secret.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(derived))


def _fernet() -> MultiFernet:
    """Seals under SECRET_KEY; opens under it or any of SECRET_KEY_FALLBACKS."""
    return MultiFernet([_one(settings.SECRET_KEY)]
                       + [_one(secret) for secret in settings.SECRET_KEY_FALLBACKS])


def seal(key: str) -> str:
    return _fernet().encrypt(key.encode()).decode() if key else ""


def unseal(sealed: str) -> str:
    """The key, or "" when there is none or it was sealed under another SECRET_KEY."""
    if not sealed:
        return ""
    try:
        return _fernet().decrypt(sealed.encode()).decode()
    except (InvalidToken, ValueError):
        return ""


def reseal(sealed: str) -> str | None:
    """The key sealed again under SECRET_KEY when a fallback sealed it; None when SECRET_KEY
    did, or when nothing opens it (node_engine_key_sync issues a new key then)."""
    if not sealed:
        return None
    try:
        _one(settings.SECRET_KEY).decrypt(sealed.encode())
        return None
    except (InvalidToken, ValueError):
        pass
    try:
        return _fernet().rotate(sealed.encode()).decode()
    except (InvalidToken, ValueError):
        return None
