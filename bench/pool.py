"""Pool benchmark: what the routers' snapshot and placement cost as the fleet grows, in one
process, with one model served by N deployments (N = 10, 1,000, 10,000; a node each, two
verified cards each, a verified capacity per card).

- Full read: `routing.pool.build()`, what a process does once at start (and every
  FULL_EVERY_S as a backstop).
- Refresh, nothing changed: `routing.pool.refreshed(previous)`, what every server process does
  every second: one query on the change feed and the load exchange through Redis.
  Goal at 10,000: under 5 ms.
- Refresh after a change of 1, 10 and 100 nodes (a verified capacity re-measured): the
  nodes the feed names are read again and patched into the arrays. Goal: in proportion to
  the change, not to the fleet.
- Placement, per request: `placement.eligible` + `balancer.place` on the snapshot's fleet for
  random affinity keys, p50 and p99. Goal at 10,000: p99 under 1 ms.
- Memory: what one snapshot holds (tracemalloc: allocated while it is built and kept).

Run by `make bench-pool` (and `make bench`) against PostgreSQL (DATABASE_URL) and Redis
(REDIS_URL); it creates and drops its own database. Figures: docs/benchmarks.md.
"""

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
import uuid
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare_pool")

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")
django.setup()

from django.db import connection  # noqa: E402
from django.test.utils import setup_databases, teardown_databases  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import User  # noqa: E402
from bench import results  # noqa: E402
from marketplace.models import Card, Node  # noqa: E402
from routing import balancer, placement, pool  # noqa: E402
from routing.models import Deployment, EngineModel, Model  # noqa: E402
from verification.models import VerificationRun, VerifiedCapacity  # noqa: E402

MODEL, ENGINE_MODEL = "qwen3-27b", "Qwen/Qwen3-27B"


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def make_fleet(provider: User, n: int, start: int) -> list[int]:
    """`n` online nodes, each with two verified cards and a deployment of the model."""
    now = timezone.now() - timezone.timedelta(hours=1)
    nodes = Node.objects.bulk_create([
        Node(owner=provider, name=f"node-{start + i}", credential_prefix=uuid.uuid4().hex[:12],
             credential_digest="0" * 64, status=Node.Status.ONLINE, status_changed_at=now,
             last_heartbeat_at=now, engine_url=f"http://10.0.{i // 250}.{i % 250}:8000",
             engine_connect_url=f"http://10.0.{i // 250}.{i % 250}:8000",
             engine_reachable=True) for i in range(n)], batch_size=2000)
    runs = VerificationRun.objects.bulk_create([
        VerificationRun(node=node, trigger="enrolment", status="done", model=ENGINE_MODEL)
        for node in nodes], batch_size=2000)
    cards = Card.objects.bulk_create([
        Card(node=node, index=k, uuid=f"GPU-{uuid.uuid4()}", name="NVIDIA GeForce RTX 4090",
             memory_total_mib=24_564, verification_status=Card.Verification.VERIFIED)
        for node in nodes for k in range(2)], batch_size=4000)
    rng = random.Random(start)
    VerifiedCapacity.objects.bulk_create([
        VerifiedCapacity(card=card, model=ENGINE_MODEL, run=runs[i // 2],
                         tokens_per_s=rng.uniform(150, 700), routed_since=now)
        for i, card in enumerate(cards)], batch_size=4000)
    Deployment.objects.bulk_create([
        Deployment(node=node, engine_model_id=ENGINE_MODEL, engine="vllm", max_context=65_536,
                   quantization="fp8", first_seen_at=now) for node in nodes], batch_size=2000)
    return [node.pk for node in nodes]


def timed(fn, *args) -> tuple[float, object]:
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def measure(total: int, node_ids: list[int], args) -> dict:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    snap = pool.build()
    memory = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert snap.size == total, (snap.size, total)
    full = min(timed(pool.build)[0] for _ in range(args.full_repeats))

    idle = []
    for _ in range(args.refreshes):
        took, snap = timed(pool.refreshed, snap)
        idle.append(took)

    changed = {}
    rng = random.Random(total)
    for k in (1, 10, 100):
        if k > total:
            continue
        runs = []
        for _ in range(5):
            picked = rng.sample(node_ids, k)
            VerifiedCapacity.objects.filter(card__node_id__in=picked).update(
                routing_tps=rng.uniform(150, 700))
            took, snap = timed(pool.refreshed, snap)
            runs.append(took)
        changed[k] = statistics_median(runs)
    assert snap.version == pool.build().version  # the patched snapshot is the full read's

    fleet = snap.workers[MODEL]
    context = snap.models[MODEL].context_length
    keys = [balancer.Affinity(rng.randbytes(16), True) for _ in range(args.placements)]
    placing = []
    for key in keys:
        started = time.perf_counter()
        found = placement.eligible(fleet, user_id=1, context_needed=2_000,
                                   model_context=context)
        balancer.place(found, key, snap.sent_since())
        placing.append(time.perf_counter() - started)
    return {"full": full, "idle": idle, "changed": changed, "placing": placing,
            "memory": memory}


def statistics_median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,1000,10000")
    parser.add_argument("--refreshes", type=int, default=200)
    parser.add_argument("--placements", type=int, default=5000)
    parser.add_argument("--full-repeats", type=int, default=3)
    args = parser.parse_args()
    old = setup_databases(verbosity=0, interactive=False)
    try:
        provider = User.objects.create_user("provider@bench.test", None)
        model = Model.objects.create(name=MODEL, context_length=131_072)
        EngineModel.objects.create(engine_model_id=ENGINE_MODEL, model=model)
        from billing.models import ModelPrice
        ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=200_000,
                                  output_micros_per_mtok=800_000,
                                  effective_at=timezone.now() - timezone.timedelta(days=1))
        print(f"pool benchmark: one model, N deployments (a node, two verified cards each), "
              f"one process, {os.cpu_count()} CPUs")
        print(f"{'N':>7} | {'full read':>9} | {'refresh, nothing changed p50/p99':>33} | "
              f"{'after 1 / 10 / 100 nodes changed':>33} | {'placement p50/p99':>17} | "
              f"{'snapshot':>8}")
        node_ids: list[int] = []
        goals = []
        for size in (int(s) for s in args.sizes.split(",")):
            node_ids += make_fleet(provider, size - len(node_ids), len(node_ids))
            connection.cursor().execute("ANALYZE")
            r = measure(size, node_ids, args)
            idle50, idle99 = pct(r["idle"], 0.5) * 1e3, pct(r["idle"], 0.99) * 1e3
            p50, p99 = pct(r["placing"], 0.5) * 1e6, pct(r["placing"], 0.99) * 1e6
            changed = " / ".join(f"{r['changed'][k] * 1e3:.1f}" if k in r["changed"] else "-"
                                 for k in (1, 10, 100))
            print(f"{size:>7,} | {r['full'] * 1e3:>6.0f} ms | {idle50:>14.2f} / {idle99:.2f} ms "
                  f"{'':>7}| {changed:>27} ms | {p50:>5.0f} / {p99:>4.0f} µs | "
                  f"{r['memory'] / 2**20:>5.1f} MiB")
            yardstick = results.cpu_yardstick_us()
            for figure, value, unit in ((f"full read ms at {size:,}", r["full"] * 1e3, "ms"),
                                        (f"refresh p99 ms at {size:,}", idle99, "ms"),
                                        (f"placement p99 µs at {size:,}", p99, "µs")):
                results.record("pool", figure, round(value, 3), unit, better="lower",
                               yardstick_us=yardstick)
            if size == 10_000:
                goals = [("refresh with nothing changed under 5 ms (p99)", idle99 < 5),
                         ("placement p99 under 1 ms", p99 < 1000)]
        for goal, met in goals:
            print(f"goal at 10,000: {goal}: {'met' if met else 'MISSED'}")
    finally:
        connection.close()
        teardown_databases(old, verbosity=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
