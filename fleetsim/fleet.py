"""`python -m fleetsim up`: several simulated machines, each an engine server plus the real agent.

All engine servers share one uvicorn server and one event loop (one listening socket per
machine, dispatched on the local port), so a demo fleet costs one small Python process plus
one agent process per machine. A machine whose profile is in `agent_engines` is the exception:
its agent runs its engine as its own child (`--engine-command "python -m fleetsim serve ..."`,
docs/agent-protocol.md section 4), as a provider who lets the agent run the engine would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import uvicorn

from agent.engine_tls import TLS_CERT, TLS_KEY
from agent.supervisor import KEY_PLACEHOLDER
from fleetsim.profiles import Profile, get_profile, machine_ids
from fleetsim.server import EngineServer

REPO_ROOT = Path(__file__).resolve().parent.parent
# How long an agent gets to stop after SIGTERM before it is killed.
AGENT_STOP_TIMEOUT_S = 5.0
# How long an agent that runs its engine gives it to stop, within AGENT_STOP_TIMEOUT_S.
ENGINE_STOP_TIMEOUT_S = 2.0
# How long requests in flight (a verification load test's streams) may hold up the stop.
SERVER_STOP_TIMEOUT_S = 2


class FleetError(Exception):
    """A problem with the arguments or the platform: printed as one line, exit status 1."""


@dataclass
class Machine:
    machine_id: str
    profile: Profile
    port: int | None  # None: a free port, picked when the fleet binds it
    credential_file: Path
    token: str | None
    own_engine: bool = False  # the agent runs the engine as its child
    # Its engine answers only with the engine key the platform hands its agent (--api-key).
    engine_key: bool = False
    # Its engine serves HTTPS with the certificate its agent makes and reports (engine_tls).
    engine_tls: bool = False

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def plan_machines(profile_keys: list[str], tokens: list[str], state_dir: Path,
                  base_port: int | None, *, platform: str | None = None,
                  agent_engines: frozenset[str] = frozenset()) -> list[Machine]:
    """One machine per profile key, ids like `h200-1`, `h200-2`; one token each, except that a
    machine whose credential file exists is already enrolled (restarting keeps the node).
    Machines of the profiles in `agent_engines` have their agent run their engine.
    Engine ports run from `base_port`, or are left to the system (free ones) when it is None;
    a run of ports that holds the platform's own is refused."""
    if base_port is not None:
        taken = _port_of(platform) if platform else None
        last = base_port + len(profile_keys) - 1
        if last > 65535:
            raise FleetError(f"--base-port {base_port}: {len(profile_keys)} engine ports do not "
                             "fit below 65536")
        if taken is not None and base_port <= taken <= last:
            raise FleetError(
                f"the engine ports {base_port}-{last} include the platform's port {taken} "
                f"({platform}): give another --base-port, or none to use free ports")
    machines = []
    for i, (key, machine_id) in enumerate(zip(profile_keys, machine_ids(profile_keys),
                                              strict=True)):
        try:
            profile = get_profile(key)
        except KeyError as exc:
            raise FleetError(exc.args[0]) from None
        port = None if base_port is None else base_port + i
        machines.append(Machine(machine_id, profile, port, state_dir / f"{machine_id}.json",
                                None, own_engine=key in agent_engines))
    all_enrolled = all(m.credential_file.exists() for m in machines)
    if (tokens and len(tokens) != len(machines)) or (not tokens and not all_enrolled):
        raise FleetError(
            f"give one enrolment token per machine: {len(machines)} machine(s), "
            f"{len(tokens)} token(s) (tokens may be left out only when every machine already "
            f"has a credential file in {state_dir})")
    for machine, token in zip(machines, tokens, strict=False):
        # "-": this machine is enrolled already (its credential file says as whom).
        machine.token = None if token == "-" else token
    lost = [m.machine_id for m in machines if m.token is None and not m.credential_file.exists()]
    if lost:
        raise FleetError(f"no enrolment token and no credential file in {state_dir} for: "
                         f"{', '.join(lost)}")
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


def _port_of(url: str) -> int | None:
    try:
        parts = urlsplit(url)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def _bind(port: int | None) -> socket.socket:
    """A listening socket on 127.0.0.1:port, or on a free port the system picks (None)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port or 0))
    except OSError as exc:
        sock.close()
        raise FleetError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror} (give another "
                         "--base-port, or none to use free ports)") from None
    return sock


def _agent_env() -> dict[str, str]:
    # `python -m fleetsim agent` and `python -m agent` must import from this repository
    # wherever `up` was started from; HF_HUB_CACHE (run_fleet sets it) is where the simulated
    # machines keep their models' files, for their agents to read.
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


def agent_run_args(machine: Machine, time_scale: float = 1.0) -> list[str]:
    """`python -m agent run`'s arguments for `machine`. The simulated engines say their kind
    and context; vLLM never says its quantization, so the agent is told, as a provider would.
    A machine whose agent runs its engine gets the command that starts it."""
    args = ["run", "--engine-url", machine.engine_url,
            "--credential-file", str(machine.credential_file),
            "--quantization", machine.profile.quantization]
    if machine.own_engine:
        args += ["--engine-command", shlex.join([
            sys.executable, "-m", "fleetsim", "serve", "--profile", machine.profile.key,
            "--port", str(machine.port), "--time-scale", f"{time_scale:g}",
            *(["--api-key", KEY_PLACEHOLDER] if machine.engine_key else []),
            *(["--ssl-keyfile", TLS_KEY, "--ssl-certfile", TLS_CERT]
              if machine.engine_tls else [])]),
            "--state-dir", str(machine.credential_file.with_suffix(".engine")),
            "--stop-timeout", f"{ENGINE_STOP_TIMEOUT_S:g}"]
    return args


async def _start_agent(machine: Machine, time_scale: float) -> asyncio.subprocess.Process:
    # The real agent, handed the simulated machine (fleetsim/machine.py).
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetsim", "agent", "--profile", machine.profile.key,
        "--machine-id", machine.machine_id, "--time-scale", f"{time_scale:g}",
        *agent_run_args(machine, time_scale),
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
    if machines:  # the simulated machines' models, on "disk" (sparse files) for their agents
        os.environ.setdefault("HF_HUB_CACHE",
                              str(machines[0].credential_file.parent / "hf-cache"))
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)

    sockets = []
    try:
        for m in machines:
            sockets.append(_bind(m.port))
            m.port = sockets[-1].getsockname()[1]
    except FleetError:
        for sock in sockets:
            sock.close()
        raise
    # An engine the agent runs binds its port itself: the port is only picked here.
    for m, sock in zip(machines, list(sockets), strict=True):
        if m.own_engine and with_agents:
            sock.close()
            sockets.remove(sock)
    apps = {m.port: EngineServer(m.profile, time_scale=time_scale) for m in machines
            if not (m.own_engine and with_agents)}
    server = _Server(uvicorn.Config(_PortRouter(apps), log_level="warning", lifespan="off",
                                    timeout_graceful_shutdown=SERVER_STOP_TIMEOUT_S))
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
                proc = await _start_agent(m, time_scale)
                agents.append(proc)
                pipes.append(asyncio.create_task(_follow(proc, f"[{m.machine_id}]", stop)))
            node = _node_id(m) if with_agents else None
            print(f"{m.machine_id:<24} {m.profile.key:<22} {m.engine_url}  "
                  f"node {node if node is not None else '-'}"
                  f"{'  (engine run by its agent)' if m.own_engine and with_agents else ''}",
                  flush=True)
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
