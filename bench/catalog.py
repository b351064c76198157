"""Catalog benchmark: page and API latency and query count at 10, 1,000, 10,000 and 100,000
listings, and the plans PostgreSQL runs at the largest size (`--explain`).

Run by `make bench` (or `make bench-catalog`) against PostgreSQL (DATABASE_URL); it creates and
drops its own database. `--sizes 10,100000` picks the sizes.
"""

import argparse
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

from django.core.cache import cache  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_databases, teardown_databases  # noqa: E402

from accounts.models import User  # noqa: E402
from bench import results  # noqa: E402
from marketplace import costs, keyset, selectors  # noqa: E402
from marketplace.filters import SORTS, CatalogFilterForm  # noqa: E402
from marketplace.models import Card, Listing, Node  # noqa: E402

GPUS = [("NVIDIA GeForce RTX 4090", 24564), ("NVIDIA H200", 143771),
        ("NVIDIA RTX PRO 6000 Blackwell", 98304), ("NVIDIA GeForce RTX 5090", 32768)]
# Machine names as providers pick them: a word and a number.
WORDS = ["atlas", "birch", "cobalt", "delta", "ember", "fjord", "granite", "harbor", "iris",
         "juniper", "kestrel", "lumen", "maple", "nimbus", "onyx", "pine", "quartz", "raven",
         "sable", "tundra"]
MODELS = ["Qwen/Qwen3-27B", "meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-Small-24B"]
REQUESTS = 40


def grow_to(owner, total: int) -> None:
    have = Card.objects.count()
    new = total - have
    if new <= 0:
        return
    # Host facts and verification results as a fleet has them: most verified, a few nodes
    # without host facts (older agents); region and reliability independent of each other.
    nodes = Node.objects.bulk_create([
        Node(owner=owner, name=f"{WORDS[(have + i) % len(WORDS)]}-{have + i}",
             region=("eu-central", "us-east")[i % 2],
             credential_prefix=f"b{have + i:011d}", credential_digest="0",
             status=Node.Status.ONLINE, reliability_pct=90 + (i // 2) % 10,
             engine_models=[MODELS[i % 3]], cpu_model="AMD EPYC 9354 32-Core Processor",
             cpu_cores=64 if i % 7 else None, ram_mib=512 * 1024, disk_free_gb=1000 + i % 900,
             net_link_mbps=25_000 if i % 5 else None)
        for i in range(new // 2)])
    cards = Card.objects.bulk_create([
        Card(node=nodes[i // 2], index=i % 2, uuid=f"GPU-bench-{have + i}",
             name=GPUS[(have + i) % 4][0], memory_total_mib=GPUS[(have + i) % 4][1],
             verification_status="verified" if i % 4 else "unverified",
             verified_tokens_per_s=(400 + (have + i) % 1200) if i % 4 else None,
             verified_model=MODELS[(i // 2) % 3] if i % 4 else "",
             verified_concurrency=32 if i % 4 else None)
        for i in range(new)])
    Listing.objects.bulk_create([
        Listing(card=c, is_listed=True, price_per_hour_micros=200_000 + (i % 5000) * 1000,
                cost_per_mtok_micros=costs.per_mtok_micros(200_000 + (i % 5000) * 1000,
                                                           c.verified_tokens_per_s))
        for i, c in enumerate(cards)])
    connection.cursor().execute("ANALYZE")


def measure(client, path, params) -> tuple[float, float, float, int]:
    """p50 and p95 of REQUESTS requests, the p50 of the time each spent waiting on PostgreSQL,
    and the queries of one made with the cache empty (the page's drop-down choices, cached
    for a minute, add two then)."""
    cache.clear()
    queries = []
    with connection.execute_wrapper(lambda execute, sql, *a: queries.append(sql) or execute(
            sql, *a)):
        assert client.get(path, params).status_code == 200
    waited = 0.0

    def timed(execute, *args):
        nonlocal waited
        start = time.perf_counter()
        try:
            return execute(*args)
        finally:
            waited += time.perf_counter() - start

    times, sql_times = [], []
    with connection.execute_wrapper(timed):
        for _ in range(REQUESTS):
            waited = 0.0
            start = time.perf_counter()
            client.get(path, params)
            times.append((time.perf_counter() - start) * 1000)
            sql_times.append(waited * 1000)
    times.sort()
    return (statistics.median(times), times[int(len(times) * 0.95) - 1],
            statistics.median(sql_times), len(queries))


FOUR_FILTERS = {"min_vram_gb": 24, "max_price": "3", "region": "eu-central",
                "sort": "-reliability"}


def halfway_cursor(sort: str) -> str:
    """The cursor of the page half-way through the catalog in this order (one OFFSET query
    here, to find where to start: the pages themselves never count rows)."""
    order = SORTS[sort]
    total = Card.objects.count()
    row = (selectors.cards_for_catalog({}).annotate(**order.aliases())
           .order_by(*order.ordering())[total // 2])
    return keyset.encode(sort, False, order.values_of(row))


def cases() -> list[tuple[str, str, dict]]:
    return [("page, default sort", "/", {}),
            ("page, 4 filters + sort", "/", FOUR_FILTERS),
            ("page, search machine", "/", {"q": "cobalt-4242"}),
            ("page, search model", "/", {"q": "llama-3.1"}),
            ("page, half-way", "/", {"cursor": halfway_cursor("price")}),
            ("page, -capacity", "/", {"sort": "-capacity"}),
            ("page, cost", "/", {"sort": "cost"}),
            ("api, default", "/api/cards/", {}),
            ("api, 4 filters + sort", "/api/cards/", FOUR_FILTERS)]


def explain(params: dict) -> None:
    """EXPLAIN ANALYZE of the page's query and of the count's, for these parameters."""
    form = CatalogFilterForm(params)
    assert form.is_valid(), form.errors
    order = SORTS[form.sort_name()]
    cards = selectors.cards_for_catalog(form.filters()).annotate(**order.aliases())
    if form.page_cursor():
        cards = cards.filter(*order.after(form.page_cursor()[1]))
    page = cards.order_by(*order.ordering())[:26]
    count = selectors._catalog_matches(form.filters()).order_by().values("pk")[:1001]
    for what, qs in (("page", page), ("count (bounded)", count)):
        sql, sql_params = qs.query.sql_with_params()
        if what.startswith("count"):
            sql = f"SELECT COUNT(*) FROM ({sql}) bounded"
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) {sql}",
                           sql_params)
            plan = "\n".join(f"    {line}" for (line,) in cursor.fetchall())
        print(f"  {what}:\n{plan}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10,1000,10000,100000")
    parser.add_argument("--explain", action="store_true",
                        help="print the plans (EXPLAIN ANALYZE) at the largest size")
    parser.add_argument("--keepdb", action="store_true",
                        help="keep the database (and its listings) for the next run")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    old = setup_databases(verbosity=0, interactive=False, keepdb=args.keepdb)
    try:
        owner, _ = User.objects.get_or_create(email="bench@example.com")
        client = Client()
        print(f"{'listings':>9}  {'case':<24} {'p50 ms':>7} {'p95 ms':>7} {'sql ms':>7} "
              f"{'queries':>7}")
        for total in sizes:
            grow_to(owner, total)
            yardstick = results.cpu_yardstick_us()
            for name, path, params in cases():
                p50, p95, sql, n = measure(client, path, params)
                print(f"{total:>9,}  {name:<24} {p50:>7.1f} {p95:>7.1f} {sql:>7.1f} {n:>7}")
                results.record("catalog", f"{name} p50 ms at {total:,}", round(p50, 2), "ms",
                               better="lower", yardstick_us=yardstick)
                results.record("catalog", f"{name} queries at {total:,}", n, "queries",
                               better="lower", scales=False)
        if args.explain:
            for name, _, params in cases():
                print(f"\n{name}, {sizes[-1]:,} listings")
                explain(params)
    finally:
        teardown_databases(old, verbosity=0, keepdb=args.keepdb)


if __name__ == "__main__":
    main()
