"""Billing benchmark: reserve+settle pairs per second with 32 concurrent clients, and the p50/p99
latency of reserve and of settle, on PostgreSQL. The goal is 1,000 pairs/s.

Each pair is what the inference proxy does per request: `metering.reserve` (Redis rate limit,
key spend row, ledger transfer wallet -> holds, Hold row) then `metering.settle` with the
HoldInfo reserve returned (hold locked and closed, key spend give-back, ledger transfer
holds -> wallet/provider/platform, Charge row). On PostgreSQL each is one call of a database
function (billing/migrations/0004); `--python-path` runs the statement-by-statement path
instead, for comparison. Keys carry a spend limit and per-minute limits set too high to refuse,
so every pair takes the whole path. The price is looked up once per client, as a proxy would
cache it. Each client serves its requests through its own provider.

Two ways to run 32 clients, since Python threads share one GIL: 32 threads in this process,
and 32 threads spread over several processes (fork, each thread its own connection). Two
loads: 32 clients on 32 wallets (users), and 32 clients on 1 wallet (one user, one key: every
pair contends for the same wallet, holds and key spend rows, the worst case).

Run by `make bench-billing` (and `make bench`) against PostgreSQL (DATABASE_URL); it creates
and drops its own database. `--duration`, `--warmup`, `--processes` change the run.
Figures and their analysis: docs/benchmarks.md.
"""

import argparse
import cProfile
import multiprocessing
import os
import pstats
import sys
import threading
import time
import timeit
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare_billing")
# Each client thread holds its connection for the whole run, as the proxy's metering threads
# do: the process's pool must hold them all (and the main thread's).
os.environ.setdefault("RIGSHARE_DB_POOL_SIZE", "40")

import warnings  # noqa: E402

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")  # WhiteNoise: no collectstatic here
django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection, connections  # noqa: E402
from django.test.utils import setup_databases, teardown_databases  # noqa: E402

from accounts.models import User  # noqa: E402
from bench import procfs, results  # noqa: E402
from billing import metering  # noqa: E402
from billing.keys import KeyInfo, api_key_create  # noqa: E402
from billing.metering import MeteringError, Usage, Worker  # noqa: E402
from billing.models import ModelPrice  # noqa: E402
from billing.services import credits_grant  # noqa: E402
from tests.factories import price_at  # noqa: E402

MODEL = "bench-model"
PROMPT, MAX_TOKENS, COMPLETION = 500, 500, 200
GOAL = 1_000  # pairs per second
CLIENTS = 32
FUNDS = 10**12  # no wallet runs dry during a run
MAX_INT = 2_000_000_000  # per-minute limits that never refuse


@dataclass
class Result:
    pairs: int = 0
    reserve_ms: list = field(default_factory=list)
    settle_ms: list = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)

    def add(self, other: "Result") -> None:
        self.pairs += other.pairs
        self.reserve_ms += other.reserve_ms
        self.settle_ms += other.settle_ms
        self.errors.update(other.errors)


def error_name(exc: Exception) -> str:
    if isinstance(exc, MeteringError):
        return f"{exc.status} {exc.code}"
    text = str(exc)
    if "deadlock detected" in text:
        return "deadlock"
    if isinstance(exc, ValueError) and "not found" in text:
        return "rate-limit counter gone (Redis cleared by another run?)"
    return type(exc).__name__


def one_pair(request_id: str, key: KeyInfo, worker: Worker, price: metering.Price
             ) -> tuple[float, float, float]:
    a = time.perf_counter()
    held = metering.reserve(key=key, model=MODEL, price=price,
                            max_cost=metering.max_cost_micros(price, prompt_tokens=PROMPT,
                                                              max_tokens=MAX_TOKENS),
                            request_id=request_id, tokens=PROMPT + MAX_TOKENS)
    b = time.perf_counter()
    metering.settle(hold=held, usage=Usage(PROMPT, COMPLETION), worker=worker)
    return a, b, time.perf_counter()


def client(tag: str, key: KeyInfo, worker: Worker, measure_from: float, until: float,
           out: list) -> None:
    """Pairs back to back until `until` (wall clock, shared by all processes); only pairs
    that start after the warm-up and end before `until` count."""
    result, n = Result(), 0
    try:
        price = price_at(MODEL)
        while (start := time.time()) < until:
            n += 1
            try:
                a, b, c = one_pair(f"{tag}-{n}", key, worker, price)
            except Exception as exc:  # counted and shown: a benchmark reports, never hides
                if start >= measure_from:
                    result.errors[error_name(exc)] += 1
                continue
            if start >= measure_from and time.time() <= until:
                result.pairs += 1
                result.reserve_ms.append((b - a) * 1000)
                result.settle_ms.append((c - b) * 1000)
    finally:
        connection.close()
    out.append(result)


def run_threads(clients: list[tuple[KeyInfo, Worker]], tag: str, measure_from: float,
                until: float) -> Result:
    out: list[Result] = []
    threads = [threading.Thread(target=client, args=(f"{tag}-{i}", key, worker, measure_from,
                                                     until, out))
               for i, (key, worker) in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = Result()
    for r in out:
        total.add(r)
    return total


def _process_main(clients, tag, measure_from, until, queue) -> None:
    queue.put(run_threads(clients, tag, measure_from, until))


def run_processes(clients: list[tuple[KeyInfo, Worker]], tag: str, measure_from: float,
                  until: float, processes: int) -> Result:
    # A forked child must open its own connections, never share the parent's; nor its pool,
    # whose worker threads a fork does not copy.
    connections.close_all()
    connection.close_pool()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_process_main,
                         args=(clients[p::processes], f"{tag}-p{p}", measure_from, until, queue))
             for p in range(processes)]
    for p in procs:
        p.start()
    total = Result()
    for _ in procs:
        total.add(queue.get(timeout=until - time.time() + 120))
    for p in procs:
        p.join()
    return total


# --- CPU: where the two cores went during the measured window ---

def _proc_stat(pid: int) -> tuple[int, float, int]:
    """(parent pid, CPU seconds used, start time in clock ticks since boot) of a process;
    (0, 0.0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"),
                int(fields[19]))
    except (OSError, IndexError, ValueError):
        return 0, 0.0, 0


def _proc_cpu_s(pid: int) -> float:
    return _proc_stat(pid)[1]


def _cpu_by_process(db_name: str) -> dict[int, tuple[str, float, int]]:
    """pid: (what it is, CPU seconds used, start tick) for this benchmark's PostgreSQL
    backends and autovacuum workers ("pg_ours"), every other PostgreSQL process (WAL writer,
    other databases: "pg_other"), and this benchmark's Python and its forked clients."""
    found = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parent, used, started = _proc_stat(int(entry))
        if cmd.startswith("postgres"):
            found[int(entry)] = ("pg_ours" if f" {db_name} " in cmd else "pg_other", used,
                                 started)
        elif me in (int(entry), parent):
            found[int(entry)] = ("python", used, started)
    return found


class CpuWindow:
    """Where the cores went in the measured window, sampled every 0.5 s from a side thread,
    so that a process that exits meanwhile (a client's backend, an autovacuum worker) keeps
    the CPU it had used by its last sample."""

    def __init__(self, db_name: str, measure_from: float, until: float):
        self.db_name, self.measure_from, self.until = db_name, measure_from, until
        self.usage: dict = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        time.sleep(max(0, self.measure_from - time.time()))
        with open("/proc/uptime") as f:
            start_tick = float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")
        busy_first = procfs.machine_busy_s()
        first = {pid: used for pid, (_, used, _) in _cpu_by_process(self.db_name).items()}
        last: dict[int, tuple[str, float]] = {}
        while True:
            for pid, (kind, used, started) in _cpu_by_process(self.db_name).items():
                if pid not in first and started < start_tick:
                    first[pid] = used  # an old process seen late: count from now
                last[pid] = (kind, used)
            if time.time() >= self.until:
                break
            time.sleep(min(0.5, max(0, self.until - time.time())))
        busy_last = procfs.machine_busy_s()
        span = self.until - self.measure_from
        self.usage = dict.fromkeys(("pg_ours", "pg_other", "python"), 0.0)
        for pid, (kind, used) in last.items():
            self.usage[kind] += (used - first.get(pid, 0.0)) / span
        self.usage["machine"] = (busy_last - busy_first) / span
        self.usage["other"] = max(0.0, self.usage["machine"] - sum(self.usage[n] for n in (
            "pg_ours", "pg_other", "python")))

    def result(self) -> dict:
        self._thread.join()
        return self.usage


# --- set-up ---

def make_clients(count: int, *, wallets: int) -> list[tuple[KeyInfo, Worker]]:
    tag = uuid.uuid4().hex[:8]
    keys = []
    for w in range(wallets):
        user = User.objects.create_user(f"consumer-{tag}-{w}@example.com", None)
        credits_grant(user=user, amount_micros=FUNDS, idempotency_key=f"bench:{tag}:{w}")
        row, _ = api_key_create(user=user, name="bench", spend_limit_micros=10**15,
                                spend_period="daily", requests_per_minute=MAX_INT,
                                tokens_per_minute=MAX_INT, by_operator=True)
        keys.append(KeyInfo.of(row))
    providers = [User.objects.create_user(f"provider-{tag}-{i}@example.com", None)
                 for i in range(count)]
    return [(keys[i % wallets], Worker(provider_id=providers[i].pk, reference=f"card:{i}"))
            for i in range(count)]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


# --- where a pair's time goes ---

def _redis_server_pid() -> int | None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"redis-server"):
                        return int(entry)
            except OSError:
                continue
    return None


def phases(key: KeyInfo, worker: Worker, seconds: float) -> dict:
    """One client alone for `seconds`: pairs done, and where each pair's time went: inside
    the driver's execute (a round trip and PostgreSQL's work: Django's cursors on the Python
    path, metering's own psycopg call on the SQL-function path), in commits, in the Redis
    rate limit, and the rest (Python: Django, metering, the ledger's own code). Also which SQL
    statements one pair sends, and the CPU it costs this process, its PostgreSQL backend and
    the Redis server (shared with whatever else uses it: an upper bound)."""
    price = price_at(MODEL)
    spent = Counter()
    kinds: Counter = Counter()

    def timed_sql(execute, sql, params, many, context):
        word = sql.split(None, 1)[0].upper()
        kinds["SELECT ... FOR UPDATE" if word == "SELECT" and "FOR UPDATE" in sql else word] += 1
        a = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            spent["sql"] += time.perf_counter() - a

    real_commit, real_take, real_call = (connection.commit, metering.ratelimit.take,
                                         metering._execute)

    def call(db, sql, params):
        kinds[sql.split("(", 1)[0].split()[-1] + "()"] += 1  # e.g. billing_reserve()
        a = time.perf_counter()
        try:
            return real_call(db, sql, params)
        finally:
            spent["sql"] += time.perf_counter() - a

    def commit():
        kinds["COMMIT"] += 1
        a = time.perf_counter()
        try:
            return real_commit()
        finally:
            spent["commit"] += time.perf_counter() - a

    def take(**kw):
        a = time.perf_counter()
        try:
            return real_take(**kw)
        finally:
            spent["redis"] += time.perf_counter() - a

    connection.commit, metering.ratelimit.take, metering._execute = commit, take, call
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        backend = cur.fetchone()[0]
    redis_pid = _redis_server_pid()
    pg_cpu, py_cpu = _proc_cpu_s(backend), time.process_time()
    redis_cpu = _proc_cpu_s(redis_pid) if redis_pid else 0.0
    pairs, start = 0, time.perf_counter()
    try:
        with connection.execute_wrapper(timed_sql):
            while time.perf_counter() - start < seconds:
                try:
                    one_pair(f"phase-{uuid.uuid4().hex}", key, worker, price)
                except Exception as exc:  # a lost pair is not a reason to lose the profile
                    print(f"  (a pair failed: {error_name(exc)})")
                    continue
                pairs += 1
    finally:
        del connection.commit
        metering.ratelimit.take, metering._execute = real_take, real_call
    wall = time.perf_counter() - start
    py_cpu, pg_cpu = time.process_time() - py_cpu, _proc_cpu_s(backend) - pg_cpu
    redis_cpu = (_proc_cpu_s(redis_pid) - redis_cpu) if redis_pid else 0.0
    per_pair = {name: spent[name] / pairs * 1000 for name in ("sql", "commit", "redis")}
    per_pair["python"] = wall / pairs * 1000 - sum(per_pair.values())
    return {"pairs": pairs, "wall": wall, "ms": per_pair,
            "cpu_ms": {"python": py_cpu / pairs * 1000, "pg": pg_cpu / pairs * 1000,
                       "redis": redis_cpu / pairs * 1000},
            "kinds": Counter({k: n // pairs for k, n in kinds.items()})}


def profile_top(key: KeyInfo, worker: Worker, seconds: float, lines: int = 10) -> str:
    """cProfile of one client alone: the functions with the most own time."""
    import io

    price = price_at(MODEL)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    while time.perf_counter() - start < seconds:
        try:
            one_pair(f"prof-{uuid.uuid4().hex}", key, worker, price)
        except Exception:  # noqa: S112 (shown by the rows above; the profile goes on)
            continue
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(lines)
    out = [line for line in text.getvalue().splitlines() if line.strip()]
    return "\n".join(out[next(i for i, line in enumerate(out) if "ncalls" in line):])


def sequential_pairs(key: KeyInfo, worker: Worker, seconds: float) -> Result:
    price = price_at(MODEL)
    result, start = Result(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        try:
            a, b, c = one_pair(f"seq-{uuid.uuid4().hex}", key, worker, price)
        except Exception as exc:
            result.errors[error_name(exc)] += 1
            continue
        result.pairs += 1
        result.reserve_ms.append((b - a) * 1000)
        result.settle_ms.append((c - b) * 1000)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--processes", type=int, default=8,
                        help="processes the 32 clients are spread over (default 8 x 4)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profile section")
    parser.add_argument("--python-path", action="store_true",
                        help="reserve and settle statement by statement (metering.SQL_FUNCTIONS"
                             " off), the path SQLite takes, for comparison")
    args = parser.parse_args()
    metering.SQL_FUNCTIONS = not args.python_path

    old = setup_databases(verbosity=0, interactive=False)
    db_name = settings.DATABASES["default"]["NAME"]
    try:
        ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=150_000,
                                  output_micros_per_mtok=600_000)
        print(f"billing benchmark: {CLIENTS} clients, {args.warmup:g} s warm-up, "
              f"{args.duration:g} s measured per row, {os.cpu_count()} CPUs, "
              f"PostgreSQL {connection.pg_version // 10000}, database {db_name}")
        print("path: " + ("one PostgreSQL function call per reserve and per settle "
                          "(metering.SQL_FUNCTIONS)" if metering.SQL_FUNCTIONS else
                          "statement by statement through billing.ledger (--python-path)"))
        # This machine's speed varies (a shared VM): a yardstick to compare runs by.
        yardstick = min(timeit.repeat("sum(range(1000))", number=10_000, repeat=5)) / 10_000
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
              f"CPU yardstick sum(range(1000)): {yardstick * 1e6:.1f} µs")
        print(f"{'':<22} {'':>7} {'':>8} {'reserve ms':>14} {'settle ms':>14}  "
              f"{'CPU cores used':^23}")
        print(f"{'clients as':<22} {'wallets':>7} {'pairs/s':>8} {'p50':>6} {'p99':>7} "
              f"{'p50':>6} {'p99':>7}  {'python':>6} {'pg':>5} {'other':>5} {'idle':>4}"
              f"  errors")
        rows = []
        for mode in ("threads", "processes"):
            for wallets in (CLIENTS, 1):
                clients = make_clients(CLIENTS, wallets=wallets)
                connections.close_all()
                measure_from = time.time() + args.warmup
                until = measure_from + args.duration
                cpu = CpuWindow(db_name, measure_from, until)
                tag = uuid.uuid4().hex[:8]
                if mode == "threads":
                    result = run_threads(clients, tag, measure_from, until)
                    label = f"{CLIENTS} threads, 1 process"
                else:
                    result = run_processes(clients, tag, measure_from, until, args.processes)
                    label = (f"{CLIENTS // args.processes} threads x "
                             f"{args.processes} processes")
                usage = cpu.result()
                rate = result.pairs / args.duration
                rows.append((mode, wallets, rate))
                results.record("billing", f"pairs/s, {wallets} wallet{'s' if wallets > 1 else ''}"
                               f", {mode}", rate, "pairs/s", better="higher",
                               yardstick_us=yardstick * 1e6)
                errors = ", ".join(f"{n} {name}" for name, n in result.errors.most_common())
                idle = max(0.0, (os.cpu_count() or 1) - usage.get("machine", 0))
                print(f"{label:<22} {wallets:>7} {rate:>8.0f} "
                      f"{pct(result.reserve_ms, .5):>6.1f} {pct(result.reserve_ms, .99):>7.1f} "
                      f"{pct(result.settle_ms, .5):>6.1f} {pct(result.settle_ms, .99):>7.1f}  "
                      f"{usage.get('python', 0):>6.2f} {usage.get('pg_ours', 0):>5.2f} "
                      f"{usage.get('pg_other', 0) + usage.get('other', 0):>5.2f} {idle:>4.2f}"
                      f"  {errors or '-'}", flush=True)
        best = max(rate for _, _, rate in rows)
        print(f"goal {GOAL:,} pairs/s: {'reached' if best >= GOAL else 'NOT reached'} "
              f"(best {best:,.0f}). CPU cores used in the measured window by this benchmark's "
              "Python, its PostgreSQL backends, everything else (WAL writer, other programs), "
              "and left idle.")

        if not args.no_profile:
            key, worker = make_clients(1, wallets=1)[0]
            alone = sequential_pairs(key, worker, 3.0)
            print(f"\none client alone: {alone.pairs / 3.0:,.0f} pairs/s, reserve p50 "
                  f"{pct(alone.reserve_ms, .5):.2f} ms, settle p50 "
                  f"{pct(alone.settle_ms, .5):.2f} ms")
            found = phases(key, worker, 3.0)
            ms = found["ms"]
            print(f"one pair, {sum(ms.values()):.2f} ms: SQL execute {ms['sql']:.2f}, commit "
                  f"{ms['commit']:.2f}, Redis rate limit {ms['redis']:.2f}, Python "
                  f"{ms['python']:.2f} (Django, metering, ledger)")
            cpu = found["cpu_ms"]
            total = cpu["python"] + cpu["pg"] + cpu["redis"]
            results.record("billing", "CPU ms/pair", total, "ms", better="lower",
                           yardstick_us=yardstick * 1e6)
            cores = os.cpu_count() or 1
            print(f"CPU per pair: Python {cpu['python']:.2f} ms + its PostgreSQL backend "
                  f"{cpu['pg']:.2f} ms + Redis server {cpu['redis']:.2f} ms = {total:.2f} ms, "
                  f"so {cores} cores cannot do more than {cores * 1000 / total:,.0f} pairs/s "
                  "however the clients are spread (WAL writer and kernel not counted)")
            kinds = found["kinds"]
            statements = sum(n for k, n in kinds.items() if k != "COMMIT")
            print(f"SQL per pair: {statements} statements + {kinds['COMMIT']} commits ("
                  + ", ".join(f"{n} {k}" for k, n in kinds.most_common() if k != "COMMIT")
                  + ")" + ("; each function call is its own transaction"
                           if metering.SQL_FUNCTIONS else ""))
            print("cProfile, one client alone, top functions by own time:")
            print(profile_top(key, worker, 3.0))
    finally:
        connections.close_all()
        teardown_databases(old, verbosity=0)


if __name__ == "__main__":
    main()
