"""Heartbeat benchmark: agent heartbeats per second through uvicorn with 2 workers, on the fast
path (a repeated report, answered at the ASGI front from Redis) and on the full path (a changed
report: Django, ~20 queries), with p50/p99 latency and errors. Goal: 1,000 heartbeats/s on this
2-core machine, what 10,000 agents at the default 10 s interval send.

Rigshare runs as in production (`uvicorn config.asgi:application --workers 2`, DEBUG off) on a
PostgreSQL database of this benchmark's own and a Redis database of its own. Setup enrols
`--nodes` nodes through the services the enrol API calls, each reporting one GPU (a UUID of
its own) and no engine; each node's first heartbeat queues its verification probes, which are
answered (failed) so that, as on a live fleet, no job is pending. Then `--processes` client
processes, each running `--clients` asyncio tasks (a bare HTTP/1.1 client, one kept-alive
connection per task), send heartbeats back to back. Every task owns
its own nodes and walks them in turn, so a node never has two heartbeats in flight, as an
agent does not. A flusher in this process moves the fast path's counts into PostgreSQL every
5 s, as beat's `heartbeats-flush` does.

Three loads, `--duration` seconds each after `--warmup`:
- fast: every heartbeat repeats its node's previous report: the fast path.
- full: every heartbeat differs from its node's previous one (the hostname alternates): the
  full path, for comparison.
- fleet: per node, one changed report in `--full-every` (default 60): what a fleet at the 10 s
  interval costs, whose nodes send their report in full at least every ten minutes
  (heartbeat_fast.FULL_EVERY_S) even when nothing changed.
The CPU the server, PostgreSQL and Redis spent per heartbeat on the fast and full loads gives
what a fleet of 10,000 agents would cost for a few bounds on the full report's age.

Every answer must be a 200 with no jobs, and the uptime counts in PostgreSQL must add up to the
heartbeats answered (each counted once, fast or full). Run by `make bench-heartbeat` (and
`make bench`) against PostgreSQL (DATABASE_URL) and Redis (REDIS_URL). Figures:
docs/benchmarks.md.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import timeit
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse, urlunparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare_heartbeat")


def _bench_redis_url(db: int) -> str:
    """REDIS_URL's server, another database: the tests clear theirs (FLUSHDB)."""
    parsed = urlparse(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/1")
    return urlunparse(parsed._replace(path=f"/{db}"))


REDIS_DB = 13
os.environ["REDIS_URL"] = _bench_redis_url(REDIS_DB)  # this process's flush reads it too

import warnings  # noqa: E402

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")  # WhiteNoise: no collectstatic here
django.setup()

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.db.models import Sum  # noqa: E402
from django.test.utils import setup_databases, teardown_databases  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import User  # noqa: E402
from bench import procfs, results  # noqa: E402
from config.redis import redis_client  # noqa: E402
from marketplace import heartbeat_fast, services  # noqa: E402
from marketplace.models import NodeUptimeHour  # noqa: E402
from verification import services as verification  # noqa: E402
from verification.models import VerificationRun  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PATH = "/api/agent/heartbeat/"
GOAL = 1_000
FLUSH_EVERY_S = 5.0
# A node reporting every interval sends its report in full once its entry is FULL_EVERY_S old.
FLEET_FULL_EVERY = heartbeat_fast.FULL_EVERY_S // settings.RIGSHARE_HEARTBEAT_INTERVAL_S
LOADS = {"fast": "every report repeated", "full": "every report changed",
         "fleet": "1 in {n} changed"}


def report(gpu_uuid: str, hostname: str) -> bytes:
    """A node's heartbeat, as the agent sends it."""
    return json.dumps({
        "agent_version": "0.1.0", "hostname": hostname, "os": "Linux 6.8.0-45-generic",
        "simulated": False, "nvidia": True, "driver_version": "560.35.03", "cuda_version": "12.6",
        "gpus": [{"index": 0, "name": "NVIDIA H200", "uuid": gpu_uuid,
                  "memory_total_mib": 143771, "compute_capability": "9.0",
                  "pcie_gen_current": 5, "pcie_gen_max": 5, "pcie_width_current": 16,
                  "pcie_width_max": 16, "power_limit_w": 700}],
        "engine": {"url": "", "reachable": False, "models": [], "error": "no engine"},
    }).encode()


@dataclass
class Node:
    credential: str
    reports: tuple[bytes, bytes]  # the same facts under two hostnames


def variants(i: int) -> tuple[bytes, bytes]:
    gpu = f"GPU-{uuid.uuid4()}"
    return report(gpu, f"gpu-box-{i}"), report(gpu, f"gpu-box-{i}-b")


# --- the clients (forked processes: no Django used there) ---

def request_bytes(host: str, credential: str, body: bytes) -> bytes:
    return (f"POST {PATH} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {credential}\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode() + body


async def exchange(reader, writer, request: bytes) -> tuple[int, bytes]:
    """One request on a kept-alive connection: (status, body). The answers here always carry
    a Content-Length (Django's and the fast path's alike)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:")
    if at < 0:
        raise ValueError(f"no content-length in {head[:200]!r}")
    length = int(lower[at + 17:lower.index(b"\r\n", at + 2)])
    return status, await reader.readexactly(length)


def client_process(url: str, nodes: list[Node], load: str, tasks: int, full_every: int,
                   start_at: float, until: float, out) -> None:
    """`tasks` asyncio tasks, each with one kept-alive connection, sending its nodes'
    heartbeats back to back from `start_at` to `until`. A bare HTTP/1.1 client: with httpx
    (even over routing.upstream's lean transport) the clients took more of the two cores than
    the server's fast path, and measured themselves."""
    host_port = url.removeprefix("http://")
    host, port = host_port.rsplit(":", 1)

    async def main():
        samples = []  # (sent at, latency s, ok)
        errors: dict[str, int] = {}

        async def task(mine: list[Node]):
            requests = [tuple(request_bytes(host_port, n.credential, r) for r in n.reports)
                        for n in mine]
            current = [0] * len(mine)  # which report each node sent last
            reader = writer = None
            sent = 0
            while True:
                for k in range(len(mine)):
                    now = time.time()
                    if now >= until:
                        if writer is not None:
                            writer.close()
                        return
                    if load == "full" or (load == "fleet"
                                          and sent % full_every == full_every - 1):
                        current[k] ^= 1
                    t0 = time.perf_counter()
                    try:
                        if writer is None:
                            reader, writer = await asyncio.open_connection(host, int(port))
                        status, body = await exchange(reader, writer, requests[k][current[k]])
                        ok = status == 200 and b'"jobs":[]' in body
                        if not ok:
                            why = f"HTTP {status} {body[:80]!r}"
                            errors[why] = errors.get(why, 0) + 1
                    except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
                        ok, reader, writer = False, None, None
                        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    samples.append((now, time.perf_counter() - t0, ok))
                sent += 1

        await asyncio.sleep(max(0.0, start_at - time.time()))
        await asyncio.gather(*(task(nodes[t::tasks]) for t in range(tasks)))
        return samples, errors

    out.send(asyncio.run(main()))
    out.close()


def run_load(url: str, nodes: list[Node], load: str, args, start_at: float,
             quiet: threading.Lock) -> tuple[list, dict]:
    """(every heartbeat's (sent at, latency s, ok), errors by kind) of one load: the client
    processes start sending at `start_at` and stop at the end of the measured window."""
    ctx = multiprocessing.get_context("fork")
    until = start_at + args.warmup + args.duration
    procs, pipes = [], []
    connection.close()  # not shared with the forks
    with quiet:  # no flush in progress while forking
        for p in range(args.processes):
            mine, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=client_process, args=(
                url, nodes[p::args.processes], load, args.clients, args.full_every, start_at,
                until, theirs))
            proc.start()
            procs.append(proc)
            pipes.append(mine)
    samples, errors = [], {}
    for pipe, proc in zip(pipes, procs, strict=True):
        got, errs = pipe.recv()
        proc.join()
        samples += got
        for why, n in errs.items():
            errors[why] = errors.get(why, 0) + n
    return samples, errors


# --- CPU: which process used the cores ---

def cpu_sample(server_pid: int, db_name: str) -> dict:
    """CPU seconds so far of the server (uvicorn's workers), the benchmark database's
    PostgreSQL backends, redis-server, and the whole machine (clients: the rest of ours)."""
    workers = procfs.children(server_pid)
    return {"server": {p: procfs.cpu_s(p) for p in [server_pid, *workers]},
            "pg": {p: procfs.cpu_s(p)
                   for p in procfs.pids_of(b"postgres", f" {db_name} ".encode())},
            "redis": {p: procfs.cpu_s(p) for p in procfs.pids_of(b"redis-server")},
            "machine": procfs.machine_busy_s()}


def cpu_spent(before: dict, after: dict) -> dict:
    spent = {k: sum(v - before[k].get(p, 0.0) for p, v in after[k].items())
             for k in ("server", "pg", "redis")}
    spent["machine"] = after["machine"] - before["machine"]
    spent["other"] = max(0.0, spent["machine"] - spent["server"] - spent["pg"] - spent["redis"])
    return spent


# --- set-up ---

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def enrol(count: int) -> list[Node]:
    provider = User.objects.create_user("provider@bench.test", None)
    nodes = []
    for i in range(count):
        _, token = services.enrolment_token_create(owner=provider)
        enrolment = services.node_enroll(token=token, hostname=f"gpu-box-{i}",
                                         agent_version="0.1.0")
        nodes.append(Node(enrolment.credential, variants(i)))
    return nodes


def first_heartbeats(url: str, nodes: list[Node]) -> int:
    """Each node's first heartbeat (its cards appear, its probes are queued), the probes
    answered, then one more: its fast-path entry. Returns the heartbeats sent."""
    sent = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        for rounds in range(2):
            for node in nodes:
                r = client.post(PATH, content=node.reports[0], headers={
                    "content-type": "application/json",
                    "authorization": f"Bearer {node.credential}"})
                assert r.status_code == 200, r.content
                sent += 1
                for job in r.json()["jobs"] if rounds == 0 else []:
                    verification.job_result_record(node_id=r.json()["node_id"],
                                                   job_id=job["id"], status="failed",
                                                   result=None, error="benchmark")
            if rounds == 0:
                # A fleet's steady state: each machine verified, no run measuring it (a run
                # asks for the GPUs' power in every heartbeat, which no fast path repeats).
                VerificationRun.objects.filter(status__in=VerificationRun.ACTIVE).update(
                    status=VerificationRun.Status.DONE, finished_at=timezone.now())
                services.node_heartbeat_forget(
                    node_ids=VerificationRun.objects.values_list("node_id", flat=True))
    return sent


class Flusher(threading.Thread):
    """beat's `heartbeats-flush`, every FLUSH_EVERY_S, in this process."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stopping = threading.Event()
        self.quiet = threading.Lock()  # held while flushing
        self.spent_s = 0.0
        self.runs = 0

    def run(self):
        while not self.stopping.wait(FLUSH_EVERY_S):
            self.flush()
        connection.close()

    def flush(self):
        with self.quiet:
            started = time.perf_counter()
            services.heartbeats_flush()
            self.spent_s += time.perf_counter() - started
            self.runs += 1


class CpuWindow:
    """CPU samples taken at the measured window's start and end, by a thread of its own."""

    def __init__(self, server_pid: int, db_name: str, start: float, end: float):
        self.samples: dict = {}

        def sample():
            for key, at in (("before", start), ("after", end)):
                time.sleep(max(0.0, at - time.time()))
                self.samples[key] = cpu_sample(server_pid, db_name)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()

    def spent(self) -> dict:
        self.thread.join()
        return cpu_spent(self.samples["before"], self.samples["after"])


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--processes", type=int, default=2, help="client processes (2)")
    parser.add_argument("--clients", type=int, default=16,
                        help="concurrent heartbeats per client process (16)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured (10)")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--loads", default="fast,full,fleet")
    parser.add_argument("--full-every", type=int, default=FLEET_FULL_EVERY,
                        help="fleet load: one changed report in this many per node (default "
                             f"{FLEET_FULL_EVERY}: a full report every "
                             f"{heartbeat_fast.FULL_EVERY_S} s at the heartbeat interval)")
    args = parser.parse_args()
    loads = [name for name in args.loads.split(",") if name]
    cores = os.cpu_count() or 1

    old = setup_databases(verbosity=0, interactive=False)
    db_name = settings.DATABASES["default"]["NAME"]
    redis_client().flushdb()
    server = None
    workdir = Path(tempfile.mkdtemp(prefix="bench-heartbeat-"))
    ok = True
    try:
        nodes = enrol(args.nodes)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        db_url = urlunparse(urlparse(os.environ.get("DATABASE_URL", ""))._replace(
            path="/" + db_name))
        env = {**os.environ, "DATABASE_URL": db_url, "DEBUG": "0", "LOG_LEVEL": "WARNING",
               "PYTHONWARNINGS": "ignore:No directory at"}
        log = workdir / "server.log"
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
             "--port", str(port), "--workers", "2", "--log-level", "warning",
             "--no-access-log"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
            stderr=log.open("wb"), start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"uvicorn did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        answered = first_heartbeats(url, nodes)
        yardstick = min(timeit.repeat("sum(range(1000))", number=10_000, repeat=5)) / 10_000
        print(f"heartbeat benchmark: uvicorn config.asgi:application --workers 2 (DEBUG off), "
              f"{cores} CPUs, PostgreSQL {connection.pg_version // 10000} database {db_name}, "
              f"Redis {settings.REDIS_URL}; {args.nodes} nodes (1 GPU each); "
              f"{args.processes} client processes x {args.clients} concurrent heartbeats "
              f"(bare HTTP/1.1, kept alive); {args.warmup:g} s warm-up, {args.duration:g} s "
              f"measured per load; flush every {FLUSH_EVERY_S:g} s")
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
              f"CPU yardstick sum(range(1000)): {yardstick * 1e6:.1f} µs", flush=True)
        print(f"{'load':<6} {'report':<22} {'hb/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'errors':>6}  {'CPU cores: server':>17} {'pg':>5} {'redis':>5} "
              f"{'other':>5} {'idle':>5}  {'CPU ms/hb':>9}")
        flusher = Flusher()
        flusher.start()
        rates, cost = {}, {}
        for load in loads:
            start_at = time.time() + 0.5
            window = (start_at + args.warmup, start_at + args.warmup + args.duration)
            cpu = CpuWindow(server.pid, db_name, *window)
            samples, errors = run_load(url, nodes, load, args, start_at, flusher.quiet)
            spent = cpu.spent()
            answered += sum(1 for _, _, good in samples if good)
            measured = [s for s in samples if window[0] <= s[0] < window[1]]
            rate = rates[load] = len(measured) / args.duration
            latencies = [s[1] * 1000 for s in measured]
            failed = sum(1 for s in samples if not s[2])
            ok &= failed == 0
            per = {k: spent[k] / args.duration for k in ("server", "pg", "redis", "other")}
            idle = max(0.0, cores - spent["machine"] / args.duration)
            cost[load] = (per["server"] + per["pg"] + per["redis"]) / max(rate, 1e-9)
            print(f"{load:<6} {LOADS[load].format(n=args.full_every):<22} {rate:>7,.0f} "
                  f"{pct(latencies, .5):>7.1f} {pct(latencies, .99):>7.1f} {failed:>6}  "
                  f"{per['server']:>17.2f} {per['pg']:>5.2f} {per['redis']:>5.2f} "
                  f"{per['other']:>5.2f} {idle:>5.2f}  {cost[load] * 1000:>9.2f}", flush=True)
            if errors:
                print(f"  errors: {dict(sorted(errors.items(), key=lambda e: -e[1])[:5])}")
        flusher.stopping.set()
        flusher.join()
        flusher.flush()
        counted = NodeUptimeHour.objects.aggregate(n=Sum("heartbeats"))["n"] or 0
        count_ok = counted == answered
        ok &= count_ok
        print(f"uptime counts in PostgreSQL after the last flush: {counted:,} for {answered:,} "
              f"heartbeats answered 200" + ("" if count_ok else "  <- WRONG"))
        print(f"flush: {flusher.runs} runs, {flusher.spent_s / max(1, flusher.runs) * 1000:.1f}"
              f" ms each on average (this process)")
        verdicts = []
        if "fast" in rates:
            verdicts.append(f"fast path {rates['fast']:,.0f}/s: "
                            f"{'met' if rates['fast'] >= GOAL else 'MISSED'}")
        if "fleet" in rates:
            verdicts.append(f"fleet mix {rates['fleet']:,.0f}/s: "
                            f"{'met' if rates['fleet'] >= GOAL else 'MISSED'}")
        print(f"goal {GOAL:,} heartbeats/s: {'; '.join(verdicts)}")
        for load in rates:
            results.record("heartbeat", f"{load} hb/s", rates[load], "hb/s", better="higher",
                           yardstick_us=yardstick * 1e6)
            results.record("heartbeat", f"{load} CPU ms/hb", cost[load] * 1000, "ms",
                           better="lower", yardstick_us=yardstick * 1e6)
        if "fast" in cost and "full" in cost:
            interval = settings.RIGSHARE_HEARTBEAT_INTERVAL_S
            fleet = 10_000
            projected = []
            for bound in sorted({60, 300, heartbeat_fast.FULL_EVERY_S}):
                full_rate = fleet / max(bound, interval)
                need = (fleet / interval - full_rate) * cost["fast"] + full_rate * cost["full"]
                projected.append(f"a full report every {bound} s: {need:.2f} cores")
            print(f"{fleet:,} agents at {interval} s, from the CPU per heartbeat above (server, "
                  f"PostgreSQL, Redis; not the clients): " + "; ".join(projected))
        print("hb/s: heartbeats answered in the measured window per second; latency: from "
              "sending to the whole answer read, at the client. CPU: cores used in the window "
              f"by uvicorn (master and 2 workers), the benchmark database's PostgreSQL "
              f"backends, redis-server, and everything else (the clients, this process's "
              f"flusher, other programs on the machine); {cores} cores in all.")
        text = log.read_text(errors="replace").strip()
        if text:
            print("the server wrote to stderr:\n" + "\n".join(text.splitlines()[-20:]))
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        redis_client().flushdb()
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()")
        connection.close()
        teardown_databases(old, verbosity=0)
    return 0 if ok else 1


if __name__ == "__main__":
    assert heartbeat_fast.enabled(), "the fast path needs REDIS_URL and PostgreSQL"
    sys.exit(main())
