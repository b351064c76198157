"""`python -m fleetsim up`: several simulated machines, each an engine server plus the real agent.

All engine servers share one uvicorn server and one event loop (one listening socket per
machine, dispatched on the local port), so a demo fleet costs one small Python process plus
one agent process per machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from fleetsim.profiles import Profile, get_profile, machine_ids
from fleetsim.server import EngineServer

REPO_ROOT = Path(__file__).resolve().parent.parent
# How long an agent gets to stop after SIGTERM before it is killed.
AGENT_STOP_TIMEOUT_S = 5.0


class FleetError(Exception):
    """A problem with the arguments or the platform: printed as one line, exit status 1."""


@dataclass
class Machine:
    machine_id: str
    profile: Profile
    port: int
    credential_file: Path
    token: str | None

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def plan_machines(profile_keys: list[str], tokens: list[str], state_dir: Path,
                  base_port: int) -> list[Machine]:
    """One machine per profile key, ids like `h200-1`, `h200-2`; one token each, except that a
    machine whose credential file exists is already enrolled (restarting keeps the node)."""
    machines = []
    for i, (key, machine_id) in enumerate(zip(profile_keys, machine_ids(profile_keys),
                                              strict=True)):
        try:
            profile = get_profile(key)
        except KeyError as exc:
            raise FleetError(exc.args[0]) from None
        machines.append(Machine(machine_id, profile, base_port + i,
                                state_dir / f"{machine_id}.json", None))
    all_enrolled = all(m.credential_file.exists() for m in machines)
    if (tokens and len(tokens) != len(machines)) or (not tokens and not all_enrolled):
        raise FleetError(
            f"give one enrolment token per machine: {len(machines)} machine(s), "
            f"{len(tokens)} token(s) (tokens may be left out only when every machine already "
            f"has a credential file in {state_dir})")
    for machine, token in zip(machines, tokens, strict=False):
        machine.token = token
    return machines


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # `up` handles SIGINT/SIGTERM itself: it must stop the agents as well as the servers.
        yield


class _PortRouter:
    """One ASGI app per listening port, so many machines share one uvicorn server."""

    def __init__(self, apps: dict[int, EngineServer]):
        self.apps = apps

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return
        await self.apps[scope["server"][1]](scope, receive, send)


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise FleetError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None
    return sock


def _agent_env() -> dict[str, str]:
    # The agent imports fleetsim.profiles under --simulate: make the repository importable
    # wherever `up` was started from.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def _follow(proc: asyncio.subprocess.Process, prefix: str, stop: asyncio.Event) -> None:
    """Print the agent's output under its machine's name, and say so if it dies on its own."""
    async for line in proc.stdout:
        print(f"{prefix} {line.decode(errors='replace').rstrip()}", flush=True)
    returncode = await proc.wait()
    if not stop.is_set():
        print(f"{prefix} agent exited with status {returncode}", flush=True)


async def _enroll(platform: str, machine: Machine) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "enroll", "--platform", platform,
        "--token", machine.token, "--credential-file", str(machine.credential_file),
        "--hostname", machine.machine_id,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=_agent_env())
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        text = out.decode(errors="replace").strip()
        raise FleetError(f"{machine.machine_id}: agent enroll failed: {text}")


def _node_id(machine: Machine):
    try:
        return json.loads(machine.credential_file.read_text()).get("node_id")
    except (OSError, ValueError):
        return None


def agent_run_args(machine: Machine) -> list[str]:
    """`python -m agent run`'s arguments for `machine`. The simulated engines say their kind
    and context; vLLM never says its quantization, so the agent is told, as a provider would."""
    return ["run", "--engine-url", machine.engine_url,
            "--simulate", machine.profile.key, "--machine-id", machine.machine_id,
            "--credential-file", str(machine.credential_file),
            "--quantization", machine.profile.quantization]


async def _start_agent(machine: Machine) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", *agent_run_args(machine),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=_agent_env())


async def _stop_agent(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), AGENT_STOP_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()


async def run_fleet(platform: str, machines: list[Machine], *, time_scale: float = 1.0,
                    with_agents: bool = True, ready: asyncio.Event | None = None,
                    stop: asyncio.Event | None = None) -> None:
    """Serve every machine's engine, enrol and start its agent, run until SIGINT/SIGTERM (or
    `stop` is set), then stop the agents and the servers. Never leaves a child behind."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)

    apps = {m.port: EngineServer(m.profile, time_scale=time_scale) for m in machines}
    sockets = []
    try:
        for m in machines:
            sockets.append(_bind(m.port))
    except FleetError:
        for sock in sockets:
            sock.close()
        raise
    server = _Server(uvicorn.Config(_PortRouter(apps), log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=sockets))
    agents: list[asyncio.subprocess.Process] = []
    pipes: list[asyncio.Task] = []
    try:
        while not server.started:
            if serving.done():
                serving.result()  # raises what stopped it
                raise FleetError("the engine servers stopped during startup")
            await asyncio.sleep(0.01)
        if with_agents:
            # Enrol side by side (each is a short process start plus one request), and wait
            # for all of them so a failure never leaves an enrolment half-done behind us.
            pending = [m for m in machines if not m.credential_file.exists()]
            for m in pending:
                m.credential_file.parent.mkdir(parents=True, exist_ok=True)
            results = await asyncio.gather(*(_enroll(platform, m) for m in pending),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        for m in machines:
            if with_agents:
                proc = await _start_agent(m)
                agents.append(proc)
                pipes.append(asyncio.create_task(_follow(proc, f"[{m.machine_id}]", stop)))
            node = _node_id(m) if with_agents else None
            print(f"{m.machine_id:<24} {m.profile.key:<22} {m.engine_url}  "
                  f"node {node if node is not None else '-'}", flush=True)
        if ready is not None:
            ready.set()
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([stopping, serving], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
    finally:
        stop.set()
        await asyncio.gather(*(_stop_agent(p) for p in agents))
        for task in pipes:
            task.cancel()
        server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await serving
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
