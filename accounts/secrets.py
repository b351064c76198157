"""Secrets shown once and stored as a public prefix plus an HMAC of the whole secret.

Format: `<kind>_<prefix>_<secret>`, e.g. `rse_3f9a0c1d2b4e_...`. The prefix finds the row with an
index; the HMAC (keyed by SECRET_KEY) proves the rest, compared in constant time. The database
never holds a usable secret. Kinds: rse (enrolment token), rsn (node credential), rst (REST API
token); billing adds rs (API keys).

SECRET_KEY can rotate: a digest made under one of SECRET_KEY_FALLBACKS still matches, and its
owner re-hashes it under SECRET_KEY on that use (secret_check gives the digest to keep), so a
credential in use never notices. docs/operations.md says how to rotate.
"""

import hmac
import secrets
from dataclasses import dataclass

from django.conf import settings
from django.utils.crypto import salted_hmac

_SALT = "rigshare.secrets"


@dataclass(frozen=True)
class IssuedSecret:
    token: str  # shown to its owner once, never stored
    prefix: str
    digest: str


def secret_digest(token: str, key: str | None = None) -> str:
    """The token's digest under `key` (SECRET_KEY unless given)."""
    return salted_hmac(_SALT, token, secret=key, algorithm="sha256").hexdigest()


def secret_issue(kind: str) -> IssuedSecret:
    prefix = secrets.token_hex(6)
    token = f"{kind}_{prefix}_{secrets.token_urlsafe(32)}"
    return IssuedSecret(token=token, prefix=prefix, digest=secret_digest(token))


def secret_prefix(token: str, kind: str) -> str | None:
    """The public prefix of a well-formed secret of this kind, else None."""
    if not isinstance(token, str) or len(token) > 200:
        return None
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != kind or len(parts[1]) != 12 or not parts[2]:
        return None
    return parts[1]


def secret_check(token: str, digest: str) -> str | None:
    """None when the token does not match `digest` under SECRET_KEY or any of its fallbacks;
    else the digest to keep: `digest` itself when SECRET_KEY made it, the token's digest under
    SECRET_KEY when a fallback did (the caller stores it: re-hashed on use)."""
    if hmac.compare_digest(secret_digest(token), digest):
        return digest
    for key in settings.SECRET_KEY_FALLBACKS:
        if hmac.compare_digest(secret_digest(token, key), digest):
            return secret_digest(token)
    return None


def secret_matches(token: str, digest: str) -> bool:
    return secret_check(token, digest) is not None
