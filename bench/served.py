"""Live-figures benchmark: what the figures from served traffic cost as the fleet grows, with
N deployments (N = 1,000 and 10,000; a node and two verified, listed cards each) that all served
traffic over the last day, in three concurrency bands.

- Write: `requestlog.write` of 500-row batches of requests that just ended, spread over the
  fleet: the request-log rows and their buckets in one transaction, against the rows alone
  (what a router process's log writer does every second, off the request path).
- Refresh: `served.served_figures_refresh()`, what beat runs every minute: every deployment's
  hour and day figures from its buckets, published onto its cards and the models' summary.
  Goal at 10,000: under 20 s (a third of its minute).
- Pages: the catalog sorted by served speed, a rent page and /api/cards/: queries and time per
  request. Goal: the same number of queries at 1,000 and 10,000.

Run by `make bench-served` (and `make bench`) against PostgreSQL (DATABASE_URL) and Redis
(REDIS_URL); it creates and drops its own database. Figures: docs/benchmarks.md.
"""

import argparse
import os
import random
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare_served")

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")
django.setup()

from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import (  # noqa: E402
    CaptureQueriesContext,
    setup_databases,
    teardown_databases,
)
from django.utils import timezone  # noqa: E402

from accounts.models import User  # noqa: E402
from bench.pool import ENGINE_MODEL, MODEL, make_fleet  # noqa: E402
from billing.models import ModelPrice  # noqa: E402
from marketplace.models import Card, Listing  # noqa: E402
from routing import requestlog, served  # noqa: E402
from routing.models import Deployment, EngineModel, Model, RequestLog  # noqa: E402

BATCH = 500
ROWS_PER_DEPLOYMENT = 48  # over the day: each lands in an hour bucket, a quarter in the hour


def rows_for(deployment_ids: list[int], rng: random.Random) -> list[dict]:
    now = timezone.now()
    rows = []
    for d in deployment_ids:
        for i in range(ROWS_PER_DEPLOYMENT):
            ago = timedelta(minutes=rng.uniform(0, 60)) if i % 4 == 0 else \
                timedelta(hours=rng.uniform(1, 23.9))
            ttft = rng.uniform(80, 900)
            rows.append(dict(
                request_id=f"b{d}-{i}", created_at=now - ago, endpoint="chat", model=MODEL,
                deployment_id=d, stream=True, status=200, attempts=1, prompt_tokens=800,
                completion_tokens=rng.randint(40, 400), ttft_ms=ttft,
                latency_ms=ttft + rng.uniform(500, 8000),
                concurrency=rng.choice((1, 4, 8, 20, 32))))
    return rows


def write_rate(rows: list[dict], with_buckets: bool) -> float:
    """Rows/s written in BATCH-row batches."""
    started = time.perf_counter()
    for i in range(0, len(rows), BATCH):
        if with_buckets:
            requestlog.write(rows[i:i + BATCH])
        else:
            RequestLog.objects.bulk_create([RequestLog(**r) for r in rows[i:i + BATCH]])
    return len(rows) / (time.perf_counter() - started)


def page(client: Client, url: str, params: dict | None = None, repeats: int = 5):
    took = []
    for _ in range(repeats):
        with CaptureQueriesContext(connection) as queries:
            started = time.perf_counter()
            response = client.get(url, params or {})
            took.append(time.perf_counter() - started)
        assert response.status_code == 200, (url, response.status_code)
    return len(queries), statistics.median(took)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000")
    args = parser.parse_args()
    old = setup_databases(verbosity=0, interactive=False)
    try:
        provider = User.objects.create_user("provider@bench.test", None)
        model = Model.objects.create(name=MODEL, context_length=131_072)
        EngineModel.objects.create(engine_model_id=ENGINE_MODEL, model=model)
        ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=200_000,
                                  output_micros_per_mtok=800_000,
                                  effective_at=timezone.now() - timedelta(days=1))
        rng = random.Random(7)
        client = Client()
        print(f"live-figures benchmark: N deployments with a day of traffic "
              f"({ROWS_PER_DEPLOYMENT} requests each, 3 bands), {os.cpu_count()} CPUs")
        print(f"{'N':>7} | {'log rows/s alone':>16} | {'with buckets':>12} | "
              f"{'refresh':>8} | {'catalog -served':>17} | {'rent page':>15} | "
              f"{'/api/cards/':>15}")
        node_ids: list[int] = []
        pages = {}
        refresh_at = {}
        for size in (int(s) for s in args.sizes.split(",")):
            added = make_fleet(provider, size - len(node_ids), len(node_ids))
            node_ids += added
            new = list(Deployment.objects.filter(node_id__in=added).values_list("pk", flat=True))
            Listing.objects.bulk_create(
                [Listing(card=c, is_listed=True, price_per_hour_micros=400_000)
                 for c in Card.objects.filter(node_id__in=node_ids, listing__isnull=True)],
                batch_size=4000)
            history = rows_for(new, rng)  # a day of it, written before the clock starts
            for i in range(0, len(history), BATCH):
                requestlog.write(history[i:i + BATCH])
            now = timezone.now()
            fresh = [r | {"request_id": f"now-{size}-{i}", "created_at": now,
                          "deployment_id": rng.choice(new)}
                     for i, r in enumerate(history[:20 * BATCH])]
            alone = write_rate(fresh[:10 * BATCH], with_buckets=False)
            with_buckets = write_rate(fresh[10 * BATCH:], with_buckets=True)
            connection.cursor().execute("ANALYZE")
            runs = []
            for _ in range(3):
                started = time.perf_counter()
                result = served.served_figures_refresh()
                runs.append(time.perf_counter() - started)
            assert result["deployments"] == size, result
            refresh_at[size] = statistics.median(runs)
            card = Card.objects.filter(node_id=node_ids[0]).first()
            pages[size] = {"catalog": page(client, "/", {"sort": "-served"}),
                           "rent": page(client, f"/cards/{card.pk}/"),
                           "api": page(client, "/api/cards/", {"sort": "-served"})}
            p = pages[size]
            print(f"{size:>7,} | {alone:>16,.0f} | {with_buckets:>12,.0f} | "
                  f"{refresh_at[size]:>6.2f} s | "
                  f"{p['catalog'][0]:>3} q {p['catalog'][1] * 1e3:>7.1f} ms | "
                  f"{p['rent'][0]:>2} q {p['rent'][1] * 1e3:>6.1f} ms | "
                  f"{p['api'][0]:>2} q {p['api'][1] * 1e3:>6.1f} ms")
        sizes = sorted(pages)
        if 10_000 in refresh_at:
            print(f"goal at 10,000: refresh under 20 s: "
                  f"{'met' if refresh_at[10_000] < 20 else 'MISSED'}")
        same = all(pages[sizes[0]][k][0] == pages[sizes[-1]][k][0] for k in pages[sizes[0]])
        print(f"goal: the same queries per page at {sizes[0]:,} and {sizes[-1]:,}: "
              f"{'met' if same else 'MISSED'}")
    finally:
        connection.close()
        teardown_databases(old, verbosity=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
