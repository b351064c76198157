"""Inference proxy benchmark: one fleetsim engine called directly and through Rigshare, at 1
and 64 concurrent streams. Goal: the proxy adds at most 3 ms to the p50 time to first token
and keeps at least 95% of the direct streams' output tokens/s.

Three processes: the engine (`python -m fleetsim serve`, the H200 vLLM profile at time scale 1,
so a stream runs at a real card's rate: 170 tok/s alone, ~2,900 tok/s over 64 streams), Rigshare
(`uvicorn config.asgi:application`, one worker, DEBUG off, on a PostgreSQL database of this
benchmark's own and Redis) and this one, the client (asyncio + httpx, streaming chat
completions). The client asks both paths for the same streams (`stream_options.include_usage`,
the same max_tokens); the proxy is reached with a funded consumer's API key (no limits), the
engine is a verified deployment with capacity, so the pool routes every request to it.

Direct and proxied phases alternate, their order flipping every round, so the VM's speed drift
hits both alike. TTFT is the time from sending the request to the first chunk with content;
tokens/s is the content chunks of every stream of a phase over the phase's wall time. Every
proxied stream must deliver all its tokens and [DONE], every proxied request must leave a
Charge, and the ledger must balance (`billing.selectors.ledger_problems()`).

Run by `make bench-proxy` (and `make bench`) against PostgreSQL (DATABASE_URL) and Redis
(REDIS_URL); it creates and drops its own database. `--rounds`, `--max-tokens`, `--time-scale`
change the run; `--profile` runs the proxy under cProfile instead and prints where its CPU goes
per request. Figures and their analysis: docs/benchmarks.md.
"""

import argparse
import asyncio
import json
import os
import pstats
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse, urlunparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TEST_DATABASE_NAME", "bench_rigshare_proxy")

import django  # noqa: E402

warnings.filterwarnings("ignore", "No directory at")  # WhiteNoise: no collectstatic here
django.setup()

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.test.utils import setup_databases, teardown_databases  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import User  # noqa: E402
from billing.keys import api_key_create  # noqa: E402
from billing.models import Charge, ModelPrice  # noqa: E402
from billing.selectors import ledger_problems  # noqa: E402
from billing.services import credits_grant  # noqa: E402
from fleetsim.profiles import get_profile  # noqa: E402
from marketplace.models import Card, Node  # noqa: E402
from routing.models import Deployment, EngineModel, Model  # noqa: E402
from verification.models import VerificationRun, VerifiedCapacity  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROFILE = "h200"
MODEL = "qwen3-27b"  # the public name; the engine knows it by the profile's model id
CONCURRENCY = (1, 64)
GOAL_TTFT_MS = 3.0
GOAL_RATIO = 0.95
# A content chunk: a delta with text in it (vLLM's role chunk has "content":"").
_CONTENT = re.compile(rb'"content":"(?!")')
_EVENT_END = b"\n\n"

# uvicorn with cProfile on its event loop thread from SIGUSR1 to SIGUSR2, which writes the
# stats to the path given.
_PROFILED = """
import cProfile, signal, sys, uvicorn
profile = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
def dump(*_):
    profile.disable()
    profile.dump_stats(sys.argv[2])
signal.signal(signal.SIGUSR2, dump)
uvicorn.run("config.asgi:application", host="127.0.0.1", port=int(sys.argv[1]),
            log_level="warning", access_log=False)
"""


# --- one stream ---

@dataclass
class Stream:
    ttft_s: float | None = None
    tokens: int = 0  # content chunks received
    usage_tokens: int | None = None  # completion_tokens of the usage chunk
    done: bool = False
    error: str = ""


async def stream_once(client: httpx.AsyncClient, url: str, body: bytes, headers: dict
                      ) -> Stream:
    out = Stream()
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            buf = b""
            async for data in resp.aiter_raw():
                buf += data
                cut = buf.rfind(_EVENT_END)
                if cut < 0:
                    continue
                events, buf = buf[:cut], buf[cut + 2:]
                found = len(_CONTENT.findall(events))
                if found and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - start
                out.tokens += found
                if b'"usage":{' in events:
                    for event in events.split(_EVENT_END):
                        if b'"choices":[]' in event:
                            usage = json.loads(event[event.index(b"{"):])["usage"]
                            out.usage_tokens = usage["completion_tokens"]
                if b"data: [DONE]" in events:
                    out.done = True
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__
    return out


class Route:
    """One way to the engine: its URL, body and headers."""

    def __init__(self, name: str, base: str, model: str, max_tokens: int, token: str = ""):
        self.name, self.url, self.model, self.max_tokens = name, base + "/v1/chat/completions", \
            model, max_tokens
        self.headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if token:
            self.headers["authorization"] = f"Bearer {token}"

    def body(self) -> bytes:
        # A prompt of its own per request (~40 tokens): a real prefill, no prefix-cache hit.
        text = (f"Request {uuid.uuid4().hex}. Write a short story about a GPU that rents "
                "itself out by the second, and what it learns from its renters.")
        return json.dumps({"model": self.model, "stream": True, "max_tokens": self.max_tokens,
                           "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": text}]}).encode()


@dataclass
class Phase:
    streams: list = field(default_factory=list)
    wall_s: float = 0.0
    cpu: dict = field(default_factory=dict)  # process kind -> CPU seconds used

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


async def run_phase(client: httpx.AsyncClient, path: Route, concurrency: int, per_stream: int,
                    watch: "CpuWatch | None" = None) -> Phase:
    """`concurrency` clients, each sending `per_stream` requests one after another."""
    phase = Phase()

    async def one_client():
        for _ in range(per_stream):
            phase.streams.append(await stream_once(client, path.url, path.body(),
                                                   path.headers))

    before = watch.sample() if watch else None
    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    phase.wall_s = time.perf_counter() - start
    if watch:
        phase.cpu = watch.since(before)
    return phase


# --- CPU: which process used the cores during a phase ---

def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system), from /proc/<pid>/stat; 0 once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (not idle, not waiting on I/O) since boot."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return (sum(cpu[:8]) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK")


def _pids_of(prefix: bytes, needle: bytes = b"") -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ")
            except OSError:
                continue
            if cmd.startswith(prefix) and needle in cmd:
                found.append(int(entry))
    return found


class CpuWatch:
    """CPU seconds of this client, the engine, the proxy, the PostgreSQL backends of this
    benchmark's database, the Redis server, and the whole machine, between two samples."""

    def __init__(self, engine_pid: int, proxy_pid: int, db_name: str):
        self.pids = {"client": [os.getpid()], "engine": [engine_pid], "proxy": [proxy_pid],
                     "redis": _pids_of(b"redis-server")}
        self.db_name = db_name.encode()

    def sample(self) -> dict:
        pg = _pids_of(b"postgres", b" " + self.db_name + b" ")
        used = {kind: sum(_cpu_s(p) for p in pids) for kind, pids in self.pids.items()}
        used["pg"] = {p: _cpu_s(p) for p in pg}
        used["machine"] = _machine_busy_s()
        return used

    def since(self, before: dict) -> dict:
        now = self.sample()
        spent = {kind: now[kind] - before[kind] for kind in (*self.pids, "machine")}
        # A backend that started during the phase counts from 0; one that ended is lost.
        spent["pg"] = sum(used - before["pg"].get(p, 0.0) for p, used in now["pg"].items())
        spent["other"] = max(0.0, spent["machine"] - sum(
            spent[k] for k in ("client", "engine", "proxy", "redis", "pg")))
        return spent


# --- set-up ---

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not answer {url} within {timeout:g} s")


def bench_database_url(db_name: str) -> str:
    parsed = urlparse(os.environ.get("DATABASE_URL", ""))
    return urlunparse(parsed._replace(path="/" + db_name))


def bench_redis_url(db: int) -> str:
    """REDIS_URL's server, another database: every test run clears its cache (FLUSHDB on the
    tests' database), which would empty the proxy's key cache in the middle of a phase."""
    parsed = urlparse(os.environ.get("REDIS_URL") or settings.REDIS_URL
                      or "redis://127.0.0.1:6379/1")
    return urlunparse(parsed._replace(path=f"/{db}"))


def make_rows(engine_url: str) -> str:
    """The model, its price and mapping, a provider's verified node serving it, and a funded
    consumer; returns the consumer's API key."""
    profile = get_profile(PROFILE)
    model = Model.objects.create(name=MODEL, context_length=32_768)
    ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=200_000,
                              output_micros_per_mtok=800_000,
                              effective_at=timezone.now() - timedelta(days=1))
    EngineModel.objects.create(engine_model_id=profile.model, model=model)
    provider = User.objects.create_user("provider@bench.test", None)
    node = Node.objects.create(owner=provider, name=f"{PROFILE}-bench", credential_prefix=uuid
                               .uuid4().hex[:12], credential_digest="0" * 64,
                               status=Node.Status.ONLINE, last_heartbeat_at=timezone.now(),
                               engine_url=engine_url, engine_reachable=True, simulated=True)
    run = VerificationRun.objects.create(node=node, trigger="enrolment", status="done",
                                         model=profile.model)
    for i in range(profile.gpu_count):
        card = Card.objects.create(node=node, index=i, uuid=f"GPU-{uuid.uuid4()}",
                                   name=profile.gpu_name,
                                   memory_total_mib=profile.memory_total_mib,
                                   verification_status=Card.Verification.VERIFIED)
        VerifiedCapacity.objects.create(card=card, model=profile.model, run=run,
                                        tokens_per_s=dict(profile.throughput)[128]
                                        / profile.gpu_count)
    Deployment.objects.create(node=node, engine_model_id=profile.model, engine=profile.engine,
                              max_context=profile.context_length,
                              quantization=profile.quantization)
    consumer = User.objects.create_user("consumer@bench.test", None)
    credits_grant(user=consumer, amount_micros=10**12, idempotency_key="bench-proxy:grant")
    _, token = api_key_create(user=consumer, name="bench")  # no spend or rate limits
    return token


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("wb"), start_new_session=True)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly (the profile is written)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# --- figures ---

def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def ttfts_ms(phases: list[Phase]) -> list[float]:
    return [s.ttft_s * 1000 for ph in phases for s in ph.streams if s.ttft_s is not None]


def problems_of(phases: list[Phase], max_tokens: int) -> list[str]:
    bad = []
    for ph in phases:
        for s in ph.streams:
            if s.error or not s.done or s.tokens != max_tokens or s.usage_tokens != max_tokens:
                bad.append(s.error or f"{s.tokens} tokens, usage {s.usage_tokens}, "
                                      f"done {s.done}")
    return bad


def report(results: dict, args, cores: int) -> bool:
    """results[(concurrency, path)] = [Phase per round]. Prints the table; True if the goal
    is reached at every concurrency."""
    kinds = ("client", "engine", "proxy", "pg", "redis", "other")
    print(f"{'':<16} {'TTFT ms':^15} {'tok/s':>7}  {'CPU cores used, measured phases':^46}")
    print(f"{'streams path':<16} {'p50':>7} {'p99':>7} {'median':>7}  "
          + " ".join(f"{k:>6}" for k in kinds) + f" {'idle':>5}")
    reached = True
    for conc in CONCURRENCY:
        rows = {}
        for name in ("direct", "proxied"):
            phases = results[(conc, name)]
            ttft = ttfts_ms(phases)
            wall = sum(ph.wall_s for ph in phases)
            cpu = {k: sum(ph.cpu.get(k, 0.0) for ph in phases) / wall for k in kinds}
            busy = sum(ph.cpu.get("machine", 0.0) for ph in phases) / wall
            rows[name] = (pct(ttft, .5), pct(ttft, .99),
                          statistics.median(ph.tps for ph in phases))
            print(f"{conc:>7} {name:<8} {rows[name][0]:>7.1f} {rows[name][1]:>7.1f} "
                  f"{rows[name][2]:>7.0f}  " + " ".join(f"{cpu[k]:>6.2f}" for k in kinds)
                  + f" {max(0.0, cores - busy):>5.2f}")
        ratios = [p.tps / d.tps for d, p in zip(results[(conc, "direct")],
                                                 results[(conc, "proxied")], strict=True)]
        added50 = rows["proxied"][0] - rows["direct"][0]
        added99 = rows["proxied"][1] - rows["direct"][1]
        ratio = statistics.median(ratios)
        ok = added50 <= GOAL_TTFT_MS and ratio >= GOAL_RATIO
        reached &= ok
        n = sum(len(ph.streams) for ph in results[(conc, "proxied")])
        proxy_cpu = sum(ph.cpu.get("proxy", 0.0) for ph in results[(conc, "proxied")])
        tokens = sum(ph.tokens for ph in results[(conc, "proxied")])
        print(f"{conc:>7} added    {added50:>+7.1f} {added99:>+7.1f}   x{ratio:.3f} tok/s "
              f"(rounds: {' '.join(f'{r:.3f}' for r in ratios)}); proxy CPU "
              f"{proxy_cpu / n * 1000:.1f} ms per request, {proxy_cpu / tokens * 1e6:.0f} µs "
              f"per token; {'goal met' if ok else 'goal MISSED'}")
    print(f"TTFT percentiles over every measured stream of {args.rounds} rounds "
          f"({len(ttfts_ms(results[(1, 'proxied')]))} per path at 1 stream, "
          f"{len(ttfts_ms(results[(CONCURRENCY[-1], 'proxied')]))} at "
          f"{CONCURRENCY[-1]}); tok/s: the phase's output tokens over its wall time, median of "
          "rounds; x: proxied over direct, median of the rounds' ratios.")
    print(f"CPU: cores used while the phases ran, by this client, the engine, the proxy "
          f"(uvicorn, 1 worker), the PostgreSQL backends of {settings.DATABASES['default']['NAME']}, "
          f"the Redis server and everything else; this machine has {cores} cores for all of "
          "them, so at 64 streams the client and the engine compete with the proxy for CPU.")
    print(f"goal (added TTFT p50 <= {GOAL_TTFT_MS:g} ms and >= {GOAL_RATIO:.0%} of direct "
          f"tok/s, at 1 and {CONCURRENCY[-1]} streams): "
          + ("reached" if reached else "NOT reached"))
    return reached


# --- the run ---

def new_client() -> httpx.AsyncClient:
    # One client per path: httpcore's pool scans every connection of every origin on each
    # request (quadratic in the pool's size), so a shared one would tax both paths with both
    # pools' connections.
    return httpx.AsyncClient(timeout=120, limits=httpx.Limits(
        max_connections=256, max_keepalive_connections=256))


async def measure(args, direct: Route, proxied: Route, watch: CpuWatch) -> dict:
    results: dict = {(c, n): [] for c in CONCURRENCY for n in ("direct", "proxied")}
    async with new_client() as to_engine, new_client() as to_proxy:
        client = {"direct": to_engine, "proxied": to_proxy}
        # Warm-up: connections on both paths (and the proxy's to the engine), the proxy's
        # pool snapshot, key cache and database threads.
        for path in (direct, proxied):
            await run_phase(client[path.name], path, CONCURRENCY[-1], 1)
            await run_phase(client[path.name], path, 1, 3)
        for r in range(args.rounds):
            for conc in CONCURRENCY:
                per_stream = args.requests_alone if conc == 1 else args.requests_each
                order = (direct, proxied) if r % 2 == 0 else (proxied, direct)
                for path in order:
                    results[(conc, path.name)].append(
                        await run_phase(client[path.name], path, conc, per_stream, watch))
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return results


async def profile_load(args, proxied: Route, proxy_pid: int, stats_path: Path) -> int:
    """The proxied load only, with the proxy's profiler on (SIGUSR1) after the warm-up and
    off (SIGUSR2: the stats are written) after the load; returns the requests profiled."""
    async with new_client() as client:
        await run_phase(client, proxied, CONCURRENCY[-1], 1)
        await run_phase(client, proxied, 1, 3)
        os.kill(proxy_pid, signal.SIGUSR1)
        await asyncio.sleep(0.2)
        n = 0
        for conc in CONCURRENCY:
            per_stream = args.requests_alone if conc == 1 else args.requests_each
            phase = await run_phase(client, proxied, conc, per_stream)
            n += len(phase.streams)
            print(f"  profiled {len(phase.streams)} streams at {conc}: {phase.tps:,.0f} tok/s",
                  flush=True)
        await asyncio.sleep(1.5)  # the last settles and the request log's flush
        os.kill(proxy_pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while not stats_path.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return n


def _group(func: tuple) -> str:
    """Which part of the stack a profiled function belongs to."""
    filename, _, name = func
    if filename == "~":
        for needle, label in (("epoll", "idle: waiting in epoll"),
                              ("'send' of '_socket", "syscall: socket send"),
                              ("'recv' of '_socket", "syscall: socket recv"),
                              ("'poll' of 'select.poll'", "syscall: poll (httpcore)"),
                              ("register", "syscall: epoll (un)register"),
                              ("_thread.lock", "thread locks (executor hand-offs)")):
            if needle in name:
                return label
        return "other built-ins"
    path = filename.replace("\\", "/")
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    if path.startswith(str(REPO)):
        return path[len(str(REPO)) + 1:].split("/", 1)[0] + "/ (Rigshare)"
    if "/asyncio/" in path:
        return "asyncio (stdlib)"
    return "stdlib: " + Path(path).name


def print_profile(stats_path: Path, requests: int, tokens: int, lines: int = 25) -> None:
    import io
    from collections import Counter

    stats = pstats.Stats(str(stats_path))
    own: Counter = Counter()
    for func, (_, _, tottime, _, _) in stats.stats.items():
        own[_group(func)] += tottime
    idle = own.pop("idle: waiting in epoll", 0.0)
    busy = sum(own.values())
    print(f"cProfile of the proxy's event loop thread (database threads not included) over "
          f"{requests} proxied requests of {tokens // requests} tokens: busy {busy:.2f} s = "
          f"{busy / requests * 1000:.2f} ms per request, idle in epoll {idle:.2f} s. cProfile "
          "slows Python code ~2x and system calls not at all: read shares, not absolutes.")
    print("own time by package, per request:")
    for group, seconds in own.most_common(14):
        print(f"  {seconds / requests * 1000:7.2f} ms  {seconds / busy:4.0%}  {group}")
    text = io.StringIO()
    stats.stream = text
    stats.strip_dirs().sort_stats("tottime").print_stats(lines)
    out = [line for line in text.getvalue().splitlines() if line.strip()]
    print("top functions by own time:")
    print("\n".join(out[next(i for i, line in enumerate(out) if "ncalls" in line):]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-alone", type=int, default=12,
                        help="requests per path per round at 1 stream")
    parser.add_argument("--requests-each", type=int, default=2,
                        help="requests per stream per round at 64 streams")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="the engine runs this many times faster than the card")
    parser.add_argument("--redis-db", type=int, default=15,
                        help="the Redis database (on REDIS_URL's server) the proxy uses")
    parser.add_argument("--profile", action="store_true",
                        help="run the proxy under cProfile, send it the proxied load only, "
                             "and print where its time goes")
    args = parser.parse_args()
    cores = os.cpu_count() or 1

    old = setup_databases(verbosity=0, interactive=False)
    db_name = settings.DATABASES["default"]["NAME"]
    engine = rigshare = None
    workdir = Path(tempfile.mkdtemp(prefix="bench-proxy-"))  # logs, the profile
    ok = True
    try:
        engine_port, proxy_port = free_port(), free_port()
        engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
        token = make_rows(engine_url)
        redis_url = bench_redis_url(args.redis_db)
        env = {**os.environ, "DATABASE_URL": bench_database_url(db_name),
               "REDIS_URL": redis_url, "DEBUG": "0", "LOG_LEVEL": "WARNING",
               "PYTHONWARNINGS": "ignore:No directory at"}  # WhiteNoise, as above
        engine = start([sys.executable, "-m", "fleetsim", "serve", "--profile", PROFILE,
                        "--port", str(engine_port), "--time-scale", str(args.time_scale)],
                       env, workdir / "engine.log")
        if args.profile:
            stats_path = workdir / "proxy.prof"
            cmd = [sys.executable, "-c", _PROFILED, str(proxy_port), str(stats_path)]
        else:
            cmd = [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host",
                   "127.0.0.1", "--port", str(proxy_port), "--log-level", "warning",
                   "--no-access-log"]
        rigshare = start(cmd, env, workdir / "proxy.log")
        wait_http(engine_url + "/health", engine, "the engine")
        wait_http(proxy_url + "/healthz", rigshare, "the proxy")
        connection.close()

        profile = get_profile(PROFILE)
        scale = args.time_scale
        direct = Route("direct", engine_url, profile.model, args.max_tokens)
        proxied = Route("proxied", proxy_url, MODEL, args.max_tokens, token)
        print(f"proxy benchmark: fleetsim {PROFILE} ({profile.engine}, time scale {scale:g}: "
              f"{profile.aggregate_tps(1) * scale:,.0f} tok/s alone, "
              f"{profile.aggregate_tps(64) * scale:,.0f} over 64 streams) called directly and "
              f"through Rigshare (uvicorn, 1 worker), {cores} CPUs, PostgreSQL "
              f"{connection.pg_version // 10000} database {db_name}, Redis {redis_url}")
        print(f"streams of {args.max_tokens} tokens, include_usage, a ~40-token prompt each; "
              f"{args.rounds} rounds, direct and proxied alternating; per path and round "
              f"{args.requests_alone} requests one by one, and {CONCURRENCY[-1]} streams x "
              f"{args.requests_each} requests")
        yardstick = min(timeit.repeat("sum(range(1000))", number=10_000, repeat=5)) / 10_000
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
              f"CPU yardstick sum(range(1000)): {yardstick * 1e6:.1f} µs", flush=True)

        if args.profile:
            requests = asyncio.run(profile_load(args, proxied, rigshare.pid, stats_path))
            print_profile(stats_path, requests, requests * args.max_tokens)
            expected = requests + CONCURRENCY[-1] + 3  # the warm-up's too
        else:
            watch = CpuWatch(engine.pid, rigshare.pid, db_name)
            results = asyncio.run(measure(args, direct, proxied, watch))
            report(results, args, cores)
            proxied_phases = [ph for (c, n), phs in results.items() if n == "proxied"
                              for ph in phs]
            direct_phases = [ph for (c, n), phs in results.items() if n == "direct"
                             for ph in phs]
            bad = problems_of(proxied_phases, args.max_tokens)
            bad_direct = problems_of(direct_phases, args.max_tokens)
            streams = sum(len(ph.streams) for ph in proxied_phases)
            # Warm-up: 64 + 3 proxied requests before the measured ones.
            expected = streams + CONCURRENCY[-1] + 3
            if bad or bad_direct:
                ok = False
                print(f"STREAM PROBLEMS: proxied {len(bad)} ({'; '.join(sorted(set(bad))[:5])})"
                      f", direct {len(bad_direct)}")
            else:
                print(f"every stream delivered its {args.max_tokens} tokens, the usage chunk "
                      f"and [DONE] ({streams} proxied, {streams} direct)")

        deadline = time.monotonic() + 30
        while Charge.objects.count() < expected and time.monotonic() < deadline:
            time.sleep(0.2)
        charges = Charge.objects.count()
        estimated = Charge.objects.filter(estimated=True).count()
        problems = ledger_problems()
        billed_ok = charges == expected and not estimated and not problems
        ok &= billed_ok
        print(f"billing: {charges} Charge rows for {expected} proxied requests (warm-up "
              f"included), {estimated} estimated; ledger_problems() == "
              f"{problems[:3] if problems else '[]'}" + ("" if billed_ok else "  <- WRONG"))
        log = (workdir / "proxy.log").read_text(errors="replace").strip()
        if log:
            print("the proxy wrote to stderr:\n" + "\n".join(log.splitlines()[-20:]))
    finally:
        stop(rigshare)
        stop(engine)
        # The proxy's database threads are gone with it; end anything left, then drop.
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()")
        connection.close()
        teardown_databases(old, verbosity=0)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
