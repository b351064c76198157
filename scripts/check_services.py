"""Stop `make test` early, in one sentence, when PostgreSQL or Redis is not there."""

import os
import socket
import sys
from urllib.parse import urlparse

HOW = {
    "PostgreSQL": "start it with: pg_ctlcluster --skip-systemctl-redirect "
                  "$(ls /etc/postgresql) main start (or set DATABASE_URL)",
    "Redis": "start it with: redis-server --daemonize yes --bind 127.0.0.1 --port 6379 "
             "(or set REDIS_URL)",
}


def reachable(url: str, default_port: int) -> tuple[str, int, bool]:
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or default_port
    try:
        with socket.create_connection((host, port), timeout=3):
            return host, port, True
    except OSError:
        return host, port, False


def main() -> int:
    checks = [("PostgreSQL", os.environ["DATABASE_URL"], 5432),
              ("Redis", os.environ["REDIS_URL"], 6379)]
    for name, url, port in checks:
        if not url.startswith(("postgres", "redis")):
            print(f"{name} URL must be a {name} URL, got {url!r}.", file=sys.stderr)
            return 1
        host, port, ok = reachable(url, port)
        if not ok:
            print(f"{name} is not reachable at {host}:{port}; {HOW[name]}.", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
