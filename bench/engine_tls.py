"""What TLS to the engines costs the proxy: the same streamed requests through the proxy's own
transport (routing/upstream.py) to one engine over plain HTTP and to the same kind of engine
over TLS pinned to its certificate (marketplace/engine_tls.py), interleaved in rounds in one
process so that the VM's speed drift hits both alike.

Two fleetsim H200 engines (`python -m fleetsim serve`, one with --ssl-keyfile/--ssl-certfile
from a certificate made as the agent makes it), time scale 1. Per path and round: `--streams`
concurrent streams of `--max-tokens` tokens, back to back for `--requests` requests each, on
kept-alive connections (as the proxy's pool keeps them), reading every chunk as the proxy
reads it (body_reader), on uvloop as uvicorn runs the proxy. Measured: this process's CPU (time.process_time) per request, the
time to first byte, and the CPU of opening a connection (TCP, and TCP + the TLS handshake
with the pinned certificate). What TLS does to the proxy's own goals (added TTFT, CPU per
request) is measured end to end by `bench/proxy.py --engine-tls`; this one isolates the
transport's share. Both engines run on this machine, so their side of TLS (encrypting every
token) takes from the same two cores: the first byte's difference is an upper bound.

Run by `make bench-engine-tls`; no database.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent import engine_tls as agent_tls  # noqa: E402
from marketplace import engine_tls  # noqa: E402
from routing import upstream  # noqa: E402

PROFILE = "h200"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(port: int, tls_files=None) -> subprocess.Popen:
    flags = (["--ssl-keyfile", str(tls_files[0]), "--ssl-certfile", str(tls_files[1])]
             if tls_files else [])
    return subprocess.Popen([sys.executable, "-m", "fleetsim", "serve", "--profile", PROFILE,
                             "--port", str(port), "--time-scale", "1", *flags], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def wait_port(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine on :{port} exited ({proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"no engine on :{port}")


def body(max_tokens: int, i: int) -> bytes:
    return json.dumps({"model": "Qwen/Qwen3-27B", "stream": True, "max_tokens": max_tokens,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": f"Request {i}: a story."}]}
                      ).encode()


async def one_stream(client, url, extensions, payload) -> float:
    started = time.perf_counter()
    request = client.build_request("POST", url, content=payload, extensions=extensions,
                                   headers={"content-type": "application/json"})
    response = await client.send(request, stream=True)
    reader = upstream.body_reader(response)
    first = None
    while await reader.read():
        if first is None:
            first = time.perf_counter() - started
    await response.aclose()
    return first or 0.0


async def phase(client, url, extensions, streams: int, requests: int, max_tokens: int):
    """(CPU s of this process, wall s, first-byte times) for streams x requests."""
    firsts: list[float] = []

    async def worker(w: int):
        for r in range(requests):
            firsts.append(await one_stream(client, url, extensions,
                                           body(max_tokens, w * 1000 + r)))

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(streams)))
    return time.process_time() - cpu, time.perf_counter() - wall, firsts


async def handshake_cpu_us(url: str, extensions: dict, n: int = 200) -> float:
    """CPU per new connection and one small request on it (no keep-alive reuse)."""
    cpu = time.process_time()
    for _ in range(n):
        transport = upstream.Transport(max_idle=0)
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            await client.get(url + "/health", extensions=extensions)
    return (time.process_time() - cpu) / n * 1e6


async def measure(args, plain_url: str, tls_url: str, pem: str) -> dict:
    paths = {"plain": (plain_url, {}), "tls": (tls_url, engine_tls.extensions(pem))}
    results = {name: {"cpu": [], "firsts": []} for name in paths}
    clients = {name: httpx.AsyncClient(transport=upstream.Transport(), timeout=120)
               for name in paths}
    try:
        for name, (url, ext) in paths.items():  # warm-up: the pools' connections
            await phase(clients[name], url + "/v1/chat/completions", ext, args.streams, 1,
                        args.max_tokens)
        for r in range(args.rounds):
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                url, ext = paths[name]
                cpu, _, firsts = await phase(clients[name], url + "/v1/chat/completions", ext,
                                             args.streams, args.requests, args.max_tokens)
                results[name]["cpu"].append(cpu / (args.streams * args.requests))
                results[name]["firsts"] += firsts
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        for name, (url, ext) in paths.items():
            results[name]["opened"] = clients[name]._transport.opened
            results[name]["connect_us"] = await handshake_cpu_us(url, ext)
    finally:
        for client in clients.values():
            await client.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-engine-tls-"))
    tls_files = agent_tls.ensure_certificate(workdir)
    pem = tls_files[1].read_text()
    plain_port, tls_port = free_port(), free_port()
    engines = [start_engine(plain_port), start_engine(tls_port, tls_files)]
    try:
        wait_port(plain_port, engines[0])
        wait_port(tls_port, engines[1])
        from bench.results import cpu_yardstick_us

        yardstick = cpu_yardstick_us()
        print(f"engine TLS benchmark: two fleetsim {PROFILE} engines (time scale 1), one over "
              f"plain HTTP, one over TLS pinned to its certificate (EC P-256, self-signed, as "
              f"the agent makes it); the proxy's transport; {args.streams} streams x "
              f"{args.requests} requests of {args.max_tokens} tokens per path and round, "
              f"{args.rounds} rounds interleaved; {os.cpu_count()} CPUs; CPU yardstick "
              f"sum(range(1000)): {yardstick:.1f} µs")
        # uvloop, as uvicorn runs the proxy: its TLS is its own (Cython), not asyncio's.
        import uvloop

        results = uvloop.run(measure(args, f"http://127.0.0.1:{plain_port}",
                                     f"https://127.0.0.1:{tls_port}", pem))
    finally:
        for engine in engines:
            engine.terminate()
            engine.wait(10)
    rows = {}
    for name, found in results.items():
        cpu_us = statistics.median(found["cpu"]) * 1e6
        firsts = sorted(found["firsts"])
        p50 = firsts[len(firsts) // 2] * 1e3
        rows[name] = (cpu_us, p50, found["connect_us"])
        print(f"{name:<6} CPU per streamed request {cpu_us:8.0f} µs (rounds "
              f"{' '.join(f'{c * 1e6:.0f}' for c in found['cpu'])}); first byte p50 "
              f"{p50:6.2f} ms; a new connection and one request: {found['connect_us']:.0f} µs "
              f"CPU; {found['opened']} connections opened in all")
    ratio = rows["tls"][0] / rows["plain"][0]
    added = rows["tls"][1] - rows["plain"][1]
    print(f"TLS over plain: CPU per streamed request {rows['tls'][0] - rows['plain'][0]:+.0f} µs "
          f"(x{ratio:.3f}), first byte {added:+.2f} ms; a new connection "
          f"+{rows['tls'][2] - rows['plain'][2]:.0f} µs CPU (the handshake, once per pooled "
          "connection)")
    from bench import results as recorded

    recorded.record("engine_tls", f"TLS / plain CPU per streamed request, {args.streams} "
                    "streams", ratio, "x", better="lower", scales=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
