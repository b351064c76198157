"""Catalog benchmark: page and API latency and query count at 10, 1,000 and 10,000 listings.

Run by `make bench` against PostgreSQL (DATABASE_URL); it creates and drops its own database.
"""

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare")

import warnings  # noqa: E402

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")  # WhiteNoise: no collectstatic here
django.setup()

from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_databases, teardown_databases  # noqa: E402

from accounts.models import User  # noqa: E402
from marketplace.models import Card, Listing, Node  # noqa: E402

GPUS = [("NVIDIA GeForce RTX 4090", 24564), ("NVIDIA H200", 143771),
        ("NVIDIA RTX PRO 6000 Blackwell", 98304), ("NVIDIA GeForce RTX 5090", 32768)]
REQUESTS = 40


def grow_to(owner, total: int) -> None:
    have = Card.objects.count()
    new = total - have
    nodes = Node.objects.bulk_create([
        Node(owner=owner, name=f"bench-{have + i}", region=("eu-central", "us-east")[i % 2],
             credential_prefix=f"b{have + i:011d}", credential_digest="0",
             status=Node.Status.ONLINE, reliability_pct=90 + (i % 10))
        for i in range(new // 2)])
    cards = Card.objects.bulk_create([
        Card(node=nodes[i // 2], index=i % 2, uuid=f"GPU-bench-{have + i}",
             name=GPUS[(have + i) % 4][0], memory_total_mib=GPUS[(have + i) % 4][1])
        for i in range(new)])
    Listing.objects.bulk_create([
        Listing(card=c, is_listed=True, price_per_hour_micros=200_000 + (i % 5000) * 1000)
        for i, c in enumerate(cards)])
    connection.cursor().execute("ANALYZE")


def measure(client, path, params) -> tuple[float, float, int]:
    queries = []
    with connection.execute_wrapper(lambda execute, sql, *a: queries.append(sql) or execute(
            sql, *a)):
        assert client.get(path, params).status_code == 200
    times = []
    for _ in range(REQUESTS):
        start = time.perf_counter()
        client.get(path, params)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95) - 1], len(queries)


def main() -> None:
    old = setup_databases(verbosity=0, interactive=False)
    try:
        owner = User.objects.create_user("bench@example.com", "x")
        client = Client()
        cases = [("page, default sort", "/", {}),
                 ("page, 4 filters + sort", "/", {"min_vram_gb": 24, "max_price": "3",
                                                  "region": "eu-central",
                                                  "sort": "-reliability"}),
                 ("api, default", "/api/cards/", {})]
        print(f"{'listings':>9}  {'case':<24} {'p50 ms':>7} {'p95 ms':>7} {'queries':>7}")
        for total in (10, 1_000, 10_000):
            grow_to(owner, total)
            for name, path, params in cases:
                p50, p95, n = measure(client, path, params)
                print(f"{total:>9,}  {name:<24} {p50:>7.1f} {p95:>7.1f} {n:>7}")
    finally:
        teardown_databases(old, verbosity=0)


if __name__ == "__main__":
    main()
