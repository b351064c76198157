"""TLS between the platform and the engine, pinned to a certificate the agent reports.

The platform calls each engine across the internet with renters' prompts and completions, the
usage it bills from and the engine key: in clear text anyone on the path could read or change
them. vLLM (`--ssl-keyfile`, `--ssl-certfile`) and llama-server (`--ssl-key-file`,
`--ssl-cert-file`) serve TLS themselves. No certificate authority can vouch for an engine at a
bare IP address, so the platform pins the certificate the agent reports instead:

- where the agent runs the engine, the platform's command carries TLS_KEY and TLS_CERT in
  place of the files; the agent makes a key and a self-signed certificate once, in its state
  directory (the key readable by its user alone), and puts their paths there;
- whatever runs the engine, the agent reads the certificate the engine presents (a TLS
  handshake on the engine's own address, from the machine itself) and reports it with every
  heartbeat; the platform then accepts that certificate and no other on its connections.

Imports `cryptography` only to make a certificate.
"""

import datetime
import os
import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

# What the platform's command carries in place of the engine's key and certificate files.
TLS_KEY = "${RIGSHARE_TLS_KEY}"
TLS_CERT = "${RIGSHARE_TLS_CERT}"
KEY_FILE, CERT_FILE = "engine-tls.key", "engine-tls.crt"
VALID_DAYS = 3650  # the certificate is pinned, not trusted for a name: its age matters little
HANDSHAKE_TIMEOUT_S = 3.0


def uses_tls(argv) -> bool:
    return any(TLS_KEY in arg or TLS_CERT in arg for arg in argv)


def argv_with_tls(argv, state_dir: Path) -> list[str]:
    """The command with the key's and certificate's paths in place of TLS_KEY and TLS_CERT,
    made first where they are not there yet."""
    if not uses_tls(argv):
        return list(argv)
    key, cert = ensure_certificate(state_dir)
    return [arg.replace(TLS_KEY, str(key)).replace(TLS_CERT, str(cert)) for arg in argv]


def cert_path(state_dir: Path) -> Path:
    return Path(state_dir) / CERT_FILE


def ensure_certificate(state_dir: Path) -> tuple[Path, Path]:
    """The engine's key and self-signed certificate in `state_dir`, made if missing: once,
    whatever asks at the same time (the agent's threads, two agents on one state directory),
    so that the key and the certificate are always a pair."""
    import fcntl  # POSIX, as the supervisor

    state_dir = Path(state_dir)
    key_path, cert_path_ = state_dir / KEY_FILE, state_dir / CERT_FILE
    if key_path.exists() and cert_path_.exists():
        return key_path, cert_path_
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(state_dir / "engine-tls.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (key_path.exists() and cert_path_.exists()):
                _make(key_path, cert_path_)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return key_path, cert_path_


def _make(key_path: Path, cert_path_: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rigshare-engine")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    _write(key_path, key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), mode=0o600)
    _write(cert_path_, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)


def _write(path: Path, data: bytes, *, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def presented_certificate(url: str, timeout: float = HANDSHAKE_TIMEOUT_S) -> str | None:
    """The certificate (PEM) the engine at an https:// `url` presents; None for plain HTTP or
    an engine that cannot be reached over TLS."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # read, not judged: the platform pins what it reads
    try:
        with socket.create_connection((parts.hostname, parts.port or 443), timeout) as raw, \
                context.wrap_socket(raw, server_hostname=parts.hostname) as tls:
            der = tls.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return None
    return ssl.DER_cert_to_PEM_cert(der) if der else None


def https(url: str) -> str:
    """`url` with https:// in place of http://."""
    return "https://" + url.split("://", 1)[1] if url.startswith("http://") else url
