"""Static files on the wire: what a browser downloads to open /api/docs/.

Serves Rigshare as in production (`uvicorn config.asgi:application`, DEBUG off, the files that
`collectstatic` wrote) on a loopback port and fetches each page with every stylesheet, script
and icon it links, asking for compression as a browser does. Prints, per page, the bytes sent
and the bytes the files hold uncompressed, and the Cache-Control each file came with.

Run by `make bench-static` (which runs collectstatic first). The page is fetched anonymously:
no database is read (an empty SQLite file answers the server's health check).
"""

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urljoin

import httpx

REPO = Path(__file__).resolve().parent.parent
PAGES = ["/api/docs/"]
ACCEPT_ENCODING = "br, gzip"  # what Chromium sends
ASSET = re.compile(r"""<(?:script|link)\b[^>]*?(?:src|href)="([^"]+)\"""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fetch(client: httpx.Client, url: str) -> tuple[int, int, str, str]:
    """(bytes on the wire, bytes uncompressed, Content-Encoding, Cache-Control) of one GET."""
    with client.stream("GET", url, headers={"Accept-Encoding": ACCEPT_ENCODING}) as response:
        response.raise_for_status()
        body = response.read()
        wire = response.num_bytes_downloaded
    return (wire, len(body), response.headers.get("content-encoding", "identity"),
            response.headers.get("cache-control", "-"))


def main() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DEBUG": "0", "LOG_LEVEL": "WARNING",
               "DATABASE_URL": f"sqlite:///{tmp}/bench.sqlite3"}
        env.pop("REDIS_URL", None)
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", "config.asgi:application",
                                   "--host", "127.0.0.1", "--port", str(port),
                                   "--log-level", "warning"], cwd=REPO, env=env)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(f"{base}/healthz", timeout=1)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise SystemExit("the server did not start") from None
                    time.sleep(0.2)
            with httpx.Client(timeout=30) as client:
                for page in PAGES:
                    measure_page(client, base, page)
        finally:
            server.terminate()
            server.wait(timeout=10)


def measure_page(client: httpx.Client, base: str, page: str) -> None:
    wire, raw, _, _ = fetch(client, base + page)
    html = client.get(base + page).text
    total_wire, total_raw = wire, raw
    print(f"\n{page}")
    print(f"  {'file':<70} {'sent':>10} {'size':>10}  encoding  cache-control")
    print(f"  {'(the page)':<70} {wire:>10,} {raw:>10,}")
    for href in dict.fromkeys(ASSET.findall(html)):
        wire, raw, encoding, cache = fetch(client, urljoin(base + page, href))
        total_wire += wire
        total_raw += raw
        print(f"  {href:<70} {wire:>10,} {raw:>10,}  {encoding:<8}  {cache}")
    print(f"  {'total':<70} {total_wire:>10,} {total_raw:>10,}")


if __name__ == "__main__":
    main()
