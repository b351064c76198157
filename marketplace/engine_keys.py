"""Engine keys: what a node's engine takes as `--api-key`, so that it answers the platform only.

Unlike a credential, an engine key cannot be stored as an HMAC: the platform sends it with every
request it makes to the engine (routing/proxy.py, the health checks, the load tests). It is
stored sealed (Fernet: AES-128-CBC + HMAC-SHA256) under a key derived from SECRET_KEY, so that a
copy of the database alone serves nobody's engine. Changing SECRET_KEY makes the stored keys
unreadable: each node is then issued a new one at its next heartbeat (node_engine_key_sync).

A key is named by its fingerprint (the first 16 hex digits of its SHA-256): the agent reports the
fingerprint of the key its engine runs with, never the key. No ORM here.
"""

import base64
import hashlib
import secrets

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

PREFIX = "rsk_"


def issue() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def _fernet() -> Fernet:
    derived = hashlib.sha256(b"rigshare engine keys\0" + settings.SECRET_KEY.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(derived))


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
