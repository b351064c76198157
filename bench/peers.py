"""Peer routers for the routing benchmark (bench/routing.py): the same fleetsim engines driven
through other projects' routers, so Rigshare's figures stand beside theirs.

Peers, each run from a virtualenv of its own under var/bench-peers/ (their pins are no business
of the project's .venv), installed on first use from the pinned bench/peers-<peer>.txt:
- vllm-router (vllm-project/router, Rust): `cache_aware` (a per-worker radix tree of request
  text: a prefix match above --cache-threshold goes to that worker, otherwise to the one with
  the smallest tree, and the shortest queue wins while load is imbalanced) and `round_robin`.
  It proxies HTTP workers as they are: no tokenizer, nothing fetched from a hub; the
  tokenizer options in its binary serve gRPC workers only.
- litellm: LiteLLM's proxy with `routing_strategy: least-busy` (fewest requests in flight), the
  engines as two deployments of one model name on the `hosted_vllm/` provider. It refuses to
  start without a master key, so every call carries HEADERS.
Replicas are independent processes of one peer (no shared state), which the benchmark splits
requests between at random, as it does for Rigshare's two processes.

Usage, from the benchmark:
    with peers.running("vllm-router", "cache_aware", 2, engine_urls, model, workdir) as urls:
        ...  # urls: the processes' base URLs (no /v1), each answering; send peers.HEADERS
`running` raises PeerUnavailable(reason) when the peer cannot be installed or started here.
`python bench/peers.py --smoke` starts two engines (time scale 40) and sends 4 streamed chat
requests through each configuration in CONFIGS: what answered, and the cached tokens seen.
"""

import argparse
import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.proxy import free_port, stop, wait_http  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = REPO / "var" / "bench-peers"
REQUIREMENTS = {
    "vllm-router": REPO / "bench" / "peers-vllm-router.txt",
    "litellm": REPO / "bench" / "peers-litellm.txt",
}
EXECUTABLES = {"vllm-router": "vllm-router", "litellm": "litellm"}
POLICIES = {"vllm-router": ("cache_aware", "round_robin"), "litellm": ("least-busy",)}
# (peer, policy, replicas): what the benchmark runs.
CONFIGS = [("vllm-router", "cache_aware", 1), ("vllm-router", "cache_aware", 2),
           ("vllm-router", "round_robin", 1), ("vllm-router", "round_robin", 2),
           ("litellm", "least-busy", 1), ("litellm", "least-busy", 2)]
# LiteLLM's master key (it will not start without one); vllm-router ignores the header.
MASTER_KEY = "sk-rigshare-bench-" + "0" * 32
HEADERS = {"Authorization": f"Bearer {MASTER_KEY}"}
START_TIMEOUT_S = 180  # LiteLLM imports for ~10 s on an idle 2-core machine
INSTALL_TIMEOUT_S = 1200
# Inherited settings a peer would act on: LiteLLM connects to a DATABASE_URL (Prisma) and
# reads its own LITELLM_* / provider keys; none of the project's may leak into it.
_SCRUB = ("DATABASE_URL", "DIRECT_URL", "REDIS_URL", "REDIS_HOST", "REDIS_PORT",
          "REDIS_PASSWORD", "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_BASE")


class PeerUnavailable(Exception):
    """The peer cannot be installed or run here; str(exc) says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def label(peer: str, policy: str, replicas: int) -> str:
    return f"{peer} {policy} x{replicas}"


# --- install ---

def ensure_installed(peer: str) -> Path:
    """The peer's executable in its virtualenv, creating the virtualenv and installing its
    pinned requirements first when they are not there (or the pins changed since)."""
    if peer not in REQUIREMENTS:
        raise ValueError(f"unknown peer {peer!r}; one of {sorted(REQUIREMENTS)}")
    requirements = REQUIREMENTS[peer]
    venv = PEERS_DIR / peer
    exe = venv / "bin" / EXECUTABLES[peer]
    stamp = venv / ".requirements.sha256"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    if exe.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return exe
    python = venv / "bin" / "python"
    if not python.exists():
        _run_install([sys.executable, "-m", "venv", str(venv)], peer, "python -m venv")
    _run_install([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                  "-r", str(requirements)], peer, f"pip install -r {requirements.name}")
    if not exe.exists():
        raise PeerUnavailable(f"{peer}: {requirements.name} installed, but {exe} is missing")
    stamp.write_text(digest + "\n")
    return exe


def _run_install(cmd: list[str], peer: str, what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"{peer}: {what} did not finish within "
                              f"{INSTALL_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr + done.stdout).splitlines()
                 if ln.strip() and not ln.startswith("WARNING: Location")]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-3:]
        raise PeerUnavailable(f"{peer}: {what} failed: " + " | ".join(errors[-3:]))


# --- processes ---

def _vllm_router_cmd(exe: Path, policy: str, port: int, engines: list[str]) -> list[str]:
    return [str(exe), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *engines, "--policy", policy,
            # Its Prometheus exporter listens on 29000 unless told: one port per replica.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            # It waits for every worker's /health before it listens; the engines are up.
            "--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1"]


def _litellm_config(policy: str, engines: list[str], model: str) -> dict:
    """LiteLLM's proxy config (JSON is YAML): one deployment per engine under the engines'
    own model name, so the benchmark's request bodies go through unchanged."""
    return {
        "model_list": [{"model_name": model,
                        "litellm_params": {"model": f"hosted_vllm/{model}",
                                           "api_base": f"{url}/v1", "api_key": "none"}}
                       for url in engines],
        "router_settings": {"routing_strategy": policy},
    }


def _litellm_cmd(exe: Path, port: int, config: Path) -> list[str]:
    return [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]


def _env(peer: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in _SCRUB and not k.startswith(("LITELLM_", "VIRTUAL_ENV"))}
    if peer == "litellm":
        env |= {"LITELLM_MASTER_KEY": MASTER_KEY,
                # The bundled model cost map: no fetch from GitHub at start (no network here).
                "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return env


def _ready_path(peer: str) -> str:
    return "/health" if peer == "vllm-router" else "/health/liveliness"


def _tail(log: Path, lines: int = 6) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(ln.strip() for ln in text[-lines:])


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, what: str) -> None:
    try:
        wait_http(url, proc, what, START_TIMEOUT_S)
    except SystemExit as exc:
        raise PeerUnavailable(f"{exc}; log {log}: {_tail(log)}") from None


def _warm(url: str, model: str, n: int, what: str, log: Path) -> None:
    """`n` tiny concurrent streams through one process (one per engine, where the peer
    spreads them), so the first measured request does not pay for its lazy start: LiteLLM's
    first answer takes ~0.5 s."""

    def one(_):
        body = {"model": model, "max_tokens": 1, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"warm-up {uuid.uuid4()}"}]}
        with httpx.Client(timeout=60) as http:
            resp = http.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS)
        if resp.status_code != 200 or "[DONE]" not in resp.text:
            raise PeerUnavailable(f"{what} answers its health check but not a chat stream: "
                                  f"HTTP {resp.status_code} {resp.text[:300]!r}; log {log}: "
                                  f"{_tail(log)}")

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


@contextlib.contextmanager
def running(peer: str, policy: str, replicas: int, engines: list[str], model: str,
            workdir: Path, procs_out: list | None = None) -> Iterator[list[str]]:
    """`replicas` processes of `peer` routing to `engines` (base URLs) with `policy`; yields
    their base URLs once each answers, stops them on exit. Logs: workdir/<peer>-<policy>-N.log.
    `procs_out`: a list that gets their processes (Popen), for a caller that measures them."""
    if policy not in POLICIES.get(peer, ()):
        raise ValueError(f"unknown peer/policy {peer!r}/{policy!r}; see POLICIES")
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    exe = ensure_installed(peer)
    engines = [url.rstrip("/") for url in engines]
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    started: list[tuple[str, subprocess.Popen, Path, str]] = []
    try:
        for i in range(replicas):
            name = f"{peer}-{policy}-{i}"
            port = free_port()
            if peer == "vllm-router":
                cmd = _vllm_router_cmd(exe, policy, port, engines)
            else:
                config = workdir / f"{name}.yaml"
                config.write_text(json.dumps(_litellm_config(policy, engines, model), indent=2))
                cmd = _litellm_cmd(exe, port, config)
            log = workdir / f"{name}.log"
            with log.open("wb") as out:
                out.write(("$ " + " ".join(cmd) + "\n").encode())
                out.flush()
                # cwd: the workdir, so LiteLLM finds no .env of the project's.
                proc = subprocess.Popen(cmd, cwd=workdir, env=_env(peer), stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(proc)
            if procs_out is not None:
                procs_out.append(proc)
            started.append((f"http://127.0.0.1:{port}", proc, log, name))
        for url, proc, log, name in started:
            _wait_ready(url + _ready_path(peer), proc, log, name)
        for url, _, log, name in started:
            _warm(url, model, len(engines), name, log)
        yield [url for url, *_ in started]
    finally:
        for proc in procs:
            stop(proc)


# --- the engines' own word ---

ENGINE_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                   "vllm:prefix_cache_hits_total")


def engine_counters(engines: list[str]) -> dict[str, dict[str, float]]:
    """Each engine's vLLM counters (ENGINE_COUNTERS) from its /metrics: a difference between
    two readings says which engine did the work between them, whatever router was in front
    (vllm-router names no worker in its responses)."""
    out = {}
    for url in engines:
        values = dict.fromkeys(ENGINE_COUNTERS, 0.0)
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            name = line.split("{", 1)[0]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
        out[url] = values
    return out


# --- smoke ---

def _stream(url: str, model: str, messages: list) -> tuple[bool, int | None]:
    """One streamed chat completion with include_usage: (ok, usage's cached_tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    usage, done = {}, False
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=HEADERS) as resp:
        if resp.status_code != 200:
            return False, None
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                usage = json.loads(line[6:]).get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return done and bool(usage), cached


def smoke(time_scale: float) -> int:
    from fleetsim.profiles import get_profile

    profiles = ("rtx-pro-6000", "2x-rtx-4090")
    model = get_profile(profiles[0]).model
    workdir = PEERS_DIR / "smoke"
    workdir.mkdir(parents=True, exist_ok=True)
    engines, procs = {}, []
    failures = 0
    try:
        for key in profiles:
            port = free_port()
            log = workdir / f"engine-{key}.log"
            with log.open("wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fleetsim", "serve", "--profile", key,
                     "--port", str(port), "--time-scale", str(time_scale),
                     "--enable-prompt-tokens-details"],
                    cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            engines[f"http://127.0.0.1:{port}"] = key
            _wait_ready(f"http://127.0.0.1:{port}/health", procs[-1], log, f"engine {key}")
        rng = random.Random(1)
        for peer, policy, replicas in CONFIGS:
            name = label(peer, policy, replicas)
            # A system prompt of this configuration's own: its first request finds no cache.
            system = f"[{name}] You are a careful assistant for people who rent GPUs. " * 8
            try:
                with running(peer, policy, replicas, list(engines), model,
                             workdir / name.replace(" ", "-")) as urls:
                    oks, answered, cached = 0, [], []
                    for i in range(4):
                        before = engine_counters(list(engines))
                        messages = [{"role": "system", "content": system},
                                    {"role": "user", "content": f"Question {i}: which card?"}]
                        ok, hit = _stream(rng.choice(urls), model, messages)
                        after = engine_counters(list(engines))
                        oks += ok
                        cached.append(hit)
                        answered.append(",".join(
                            engines[u] for u in engines
                            if after[u]["vllm:prompt_tokens_total"]
                            > before[u]["vllm:prompt_tokens_total"]) or "?")
                    failures += oks < 4
                    print(f"{name:<28} ok {oks}/4  engines {answered}  cached_tokens {cached}",
                          flush=True)
            except PeerUnavailable as exc:
                failures += 1
                print(f"{name:<28} unavailable: {exc}", flush=True)
    finally:
        for proc in procs:
            stop(proc)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="run every configuration in CONFIGS against two fleetsim engines")
    parser.add_argument("--install", action="store_true",
                        help="create the peers' virtualenvs (var/bench-peers/) and exit")
    parser.add_argument("--time-scale", type=float, default=40.0)
    args = parser.parse_args()
    if args.install:
        for peer in REQUIREMENTS:
            print(peer, ensure_installed(peer))
        return 0
    if args.smoke:
        return smoke(args.time_scale)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
