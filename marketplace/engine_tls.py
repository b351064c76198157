"""The platform's side of TLS to engines (the agent's: agent/engine_tls.py).

An engine at a bare IP address has no certificate a public authority vouches for, so the
platform pins the one the node's agent reports, read on the machine itself: a connection to the
engine is made with that certificate as its only trust anchor (no host name to check), so the
TLS handshake fails unless the engine holds that certificate's key. Everything the platform
sends an engine goes that way (the /v1 proxy, health checks, unannounced checks, verification
load tests and canary prompts): prompts, completions, the usage billed from and the engine key
are neither readable nor changeable on the path.

A node is *encrypted* when the address the platform calls is https:// and its agent reported
the certificate; production sends shared /v1 traffic to encrypted nodes only
(RIGSHARE_ENGINE_TLS_REQUIRED), and the machine page says "not encrypted" of the others.
"""

import functools
import hashlib
import ssl

MAX_PEM_CHARS = 8192
# The request extension that carries an https:// engine's certificate to routing/upstream.py.
PIN = "rigshare.tls_pin"


class BadCertificate(ValueError):
    pass


def parsed(pem: str) -> str:
    """`pem` as one X.509 certificate in PEM, normalised, or BadCertificate."""
    from cryptography import x509

    try:
        der = ssl.PEM_cert_to_DER_cert(pem.strip())
        x509.load_der_x509_certificate(der)
    except (ValueError, TypeError) as exc:
        raise BadCertificate(f"not an X.509 certificate in PEM ({exc})") from None
    return ssl.DER_cert_to_PEM_cert(der)


def fingerprint(pem: str) -> str:
    """SHA-256 of the certificate's DER bytes, hex: what pages show and logs name."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def encrypted(connect_url: str, certificate: str) -> bool:
    return connect_url.startswith("https://") and bool(certificate)


@functools.lru_cache(maxsize=4096)
def context(pem: str) -> ssl.SSLContext:
    """A client context that trusts this certificate alone (one per certificate, kept)."""
    ctx = ssl.create_default_context(cadata=pem)
    ctx.check_hostname = False  # an address, not a name: the certificate itself is the check
    return ctx


def verify_for(connect_url: str, certificate: str):
    """What httpx's `verify` takes for a call to this engine: the pinned context over TLS
    (never a public CA's say), True (unused) over plain HTTP. An https:// engine without a
    certificate is not called over TLS unchecked: a context that trusts nothing."""
    if not connect_url.startswith("https://"):
        return True
    if not certificate:
        return _trusts_nothing()
    return context(certificate)


@functools.cache
def _trusts_nothing() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    return ctx  # CERT_REQUIRED with no trust anchor: every handshake fails


def extensions(certificate: str) -> dict:
    """What a request through routing/upstream.py carries to be pinned to `certificate`."""
    return {PIN: certificate} if certificate else {}
