"""The agent runs the engine as its child, for real: `python -m agent run` processes reporting
to the live platform (PostgreSQL), and llama-cpp-python's server with SmolLM2-135M as the engine
(tests/engine.py). Only the GPU is simulated (fleetsim's M4 Max, where the platform computes the
command). Each test is bounded: the model loads in 1-2 s on this machine's two CPUs.

What is checked here is what a provider's machine lives through: the engine started, ready,
SIGKILLed and restarted after 1 s then 2 s, restarted on the owner's word, stopped with the
agent (SIGTERM) or dying with it (SIGKILL) with no process left behind, an agent upgrade that
never leaves two engines or none, and a new configuration from the platform that drains the
engine (a streaming request in flight completes) before restarting it with the new command.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from agent.credential import write_credential
from marketplace import services
from marketplace.models import Node
from tests.engine import ALIAS, ENGINE_AVAILABLE, NOT_INSTALLED, free_port, gguf_path
from tests.llama_server_shim import llama_server_on_path
from verification.models import ProbeJob, VerificationRun

pytestmark = [pytest.mark.real_engine, pytest.mark.django_db(transaction=True)]

REPO = Path(__file__).resolve().parents[1]
LOAD_S = 60  # an engine start, at worst (a loaded machine)
STOP_S = 20  # the agent's own stop, engine included


@pytest.fixture(autouse=True)
def _engine_installed():
    if not ENGINE_AVAILABLE:
        pytest.fail(NOT_INSTALLED)


@pytest.fixture
def platform(live_server, settings, bob):
    """The live platform, heartbeats every second; node() enrols a machine of bob's and
    returns (node id, credential file)."""
    settings.RIGSHARE_HEARTBEAT_INTERVAL_S = 1

    def node(tmp: Path, hostname: str = "box") -> tuple[int, Path]:
        _, token = services.enrolment_token_create(owner=bob)
        enrolment = services.node_enroll(token=token, hostname=hostname, agent_version="0.1.0")
        path = tmp / "agent.json"
        write_credential(path, {"platform": live_server.url, "node_id": enrolment.node.pk,
                                "credential": enrolment.credential})
        return enrolment.node.pk, path

    node.url = live_server.url
    return node


class Agent:
    """One `python -m agent run` (or `python -m fleetsim agent ... run`) process."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log_path = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = STOP_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture
def agents():
    """agents(args, log) -> a started Agent; every one still running is killed at the end.
    Their logs go to stderr, which pytest shows for a failed test."""
    started: list[Agent] = []

    def start(args, log, env=None) -> Agent:
        started.append(Agent(args, log, env))
        return started[-1]

    yield start
    for agent in started:
        if agent.proc.poll() is None:
            agent.stop(signal.SIGKILL)
        print(f"\n--- {agent.log_path.name} ---\n{agent.log()}", file=sys.stderr)


def engine_command(port: int) -> str:
    return (f"{sys.executable} -m llama_cpp.server --model {gguf_path()} --model_alias {ALIAS} "
            f"--host 127.0.0.1 --port {port} --n_ctx 512 --n_threads 1 --n_threads_batch 1 "
            f"--interrupt_requests False --use_mlock False --verbose False")


def run_args(credential: Path, state: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "agent", "run", "--credential-file", str(credential),
            "--state-dir", str(state), "--engine-url", f"http://127.0.0.1:{port}",
            "--stop-timeout", "5", *extra]


def engines(port: int) -> list[int]:
    """The pids of llama-cpp-python servers listening on `port`, from /proc (no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            words = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in words]
        if "llama_cpp.server" in words and "--port" in words and \
                words[words.index("--port") + 1] == str(port):
            found.append(int(entry))
    return found


def alive(pid: int | None) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def node_row(node_id: int) -> Node:
    return Node.objects.get(pk=node_id)


def wait_for(what: str, check, timeout: float = LOAD_S, agent: Agent | None = None):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if agent is not None and agent.proc.poll() is not None:
            pytest.fail(f"the agent exited ({agent.proc.returncode}) waiting for {what}:\n"
                        f"{agent.log()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:g} s"
                        + (f":\n{agent.log()}" if agent else ""))
        time.sleep(0.1)


def pinned_engine(node_id: int, state: Path, port: int, agent: Agent):
    """Once the node reports its engine at https:// with the certificate the agent made in
    `state`: an SSL context that trusts that certificate alone, as the platform's calls do."""
    from agent import engine_tls as agent_tls
    from marketplace import engine_tls

    made = (state / agent_tls.CERT_FILE).read_text()
    wait_for("the engine's certificate reported", lambda: (
        (row := node_row(node_id)).engine_tls_certificate == made
        and row.engine_connect_url.startswith(f"https://127.0.0.1:{port}")), agent=agent)
    return engine_tls.context(made)


def ready(node_id: int, agent: Agent, other_than: int | None = None) -> Node:
    def check():
        row = node_row(node_id)
        pid = row.engine_process.get("pid")
        return row if row.engine_state == "ready" and pid != other_than and alive(pid) else None
    return wait_for("engine ready", check, agent=agent)


def test_started_ready_crashed_restarted_with_backoff_then_stopped_with_the_agent(
        platform, agents, tmp_path):
    node_id, credential = platform(tmp_path)
    port = free_port()
    agent = agents(run_args(credential, tmp_path / "state", port,
                            "--engine-command", engine_command(port)), tmp_path / "agent.log")

    first = ready(node_id, agent)
    assert engines(port) == [first.engine_process["pid"]]
    assert first.engine_process["argv"][1:3] == ["-m", "llama_cpp.server"]
    assert first.engine_process["mode"] == "command" and first.engine_reachable
    assert first.engine_models == [ALIAS]  # the agent reports the engine it runs
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200

    # SIGKILL: the platform hears "crashed" with the exit code and the log's last lines,
    # then the engine is back after 1 s; killed again at once, after 2 s.
    os.kill(first.engine_process["pid"], signal.SIGKILL)
    crashed = wait_for("a crash reported", lambda: (
        row if (row := node_row(node_id)).engine_state == "crashed" else None), agent=agent)
    assert crashed.engine_process["exit_code"] == -9
    assert "rigshare: the engine exited (exit code -9)" in crashed.engine_process["log_tail"][-1]
    assert "Uvicorn running" in "\n".join(crashed.engine_process["log_tail"])
    second = ready(node_id, agent, other_than=first.engine_process["pid"])
    os.kill(second.engine_process["pid"], signal.SIGKILL)
    third = ready(node_id, agent, other_than=second.engine_process["pid"])
    assert third.engine_process["restarts"] == 2
    log = agent.log()
    assert "exit code -9); restarting in 1 s" in log and "exit code -9); restarting in 2 s" in log

    # The owner asks for a restart: drained (nothing in flight), restarted, acknowledged.
    assert services.node_engine_restart_request(node_id=node_id, owner=third.owner)
    fourth = ready(node_id, agent, other_than=third.engine_process["pid"])
    assert fourth.engine_process["restart_seen"] == 1 and fourth.engine_process["restarts"] == 3
    assert "Draining the engine: a restart was asked." in agent.log()

    # SIGTERM to the agent: the engine goes with it, nothing is left, the platform is told.
    keeper = json.loads((tmp_path / "state" / "engine.json").read_text())["keeper_pid"]
    assert agent.stop() == 0
    assert engines(port) == [] and not alive(keeper)
    assert not alive(fourth.engine_process["pid"])
    assert node_row(node_id).engine_state == "stopped"
    assert "Engine stopped." in agent.log() and "Traceback" not in agent.log()


def test_an_agent_killed_outright_takes_its_engine_along(platform, agents, tmp_path):
    node_id, credential = platform(tmp_path)
    port = free_port()
    agent = agents(run_args(credential, tmp_path / "state", port,
                            "--engine-command", engine_command(port)), tmp_path / "agent.log")
    pid = ready(node_id, agent).engine_process["pid"]
    keeper = json.loads((tmp_path / "state" / "engine.json").read_text())["keeper_pid"]

    agent.stop(signal.SIGKILL)  # no handler runs: its keeper sees its socket close
    wait_for("the engine gone", lambda: not alive(pid) and not engines(port), timeout=STOP_S)
    wait_for("the keeper gone", lambda: not alive(keeper), timeout=STOP_S)


def test_an_upgrade_leaves_exactly_one_engine_throughout(platform, agents, tmp_path):
    node_id, credential = platform(tmp_path)
    port = free_port()
    args = run_args(credential, tmp_path / "state", port, "--engine-command",
                    engine_command(port))
    old = agents(args, tmp_path / "old.log")
    pid = ready(node_id, old).engine_process["pid"]

    counts: list[int] = []  # engines seen, every 20 ms, until the owner's restart
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            counts.append(len(engines(port)))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        new = agents(args, tmp_path / "new.log")  # the upgrade: same state directory
        assert old.proc.wait(STOP_S) == 0  # the old agent leaves on its own
        assert "Handed over to the newer agent" in old.log()
        wait_for("the new agent in charge", lambda: "Took over the running engine" in new.log(),
                 agent=new)
        time.sleep(2)  # heartbeats of the new agent alone
        row = ready(node_id, new)
    finally:
        watching.set()
        watcher.join()
    assert row.engine_process["pid"] == pid and engines(port) == [pid]
    assert len(counts) > 50 and set(counts) == {1}  # never two, never none
    # The new agent acts on the platform's word: a restart, one engine at a time.
    assert services.node_engine_restart_request(node_id=node_id, owner=row.owner)
    restarted = ready(node_id, new, other_than=pid)
    assert engines(port) == [restarted.engine_process["pid"]] and not alive(pid)
    assert new.stop() == 0 and engines(port) == []


def test_a_new_configuration_drains_the_engine_then_restarts_it_with_the_new_command(
        platform, agents, tmp_path):
    """The platform computes the command (a simulated Apple M4 Max, so llama.cpp; the real
    engine runs it through tests/llama_server_shim.py); the owner's override changes it while
    a stream is in flight."""
    node_id, credential = platform(tmp_path)
    port, key = free_port(), "sk-engine-test-key-5f1c"
    env = {"PATH": f"{llama_server_on_path(tmp_path)}{os.pathsep}{os.environ['PATH']}",
           "RIGSHARE_ENGINE_KEY": key}
    agent = agents([sys.executable, "-m", "fleetsim", "agent", "--profile", "m4-max-llamacpp",
                    "--machine-id", "m4-test", *run_args(credential, tmp_path / "state", port,
                                                         "--serve", ALIAS, "--quantization",
                                                         "Q4_1", "--model-file",
                                                         str(gguf_path()))[3:]],
                   tmp_path / "agent.log", env)

    first = ready(node_id, agent)
    argv = first.engine_process["argv"]
    assert argv[0] == "llama-server" and argv[argv.index("-c") + 1] == "32768"
    assert argv[argv.index("-m") + 1] == str(gguf_path())  # the file this machine has
    assert argv[argv.index("--api-key") + 1] == "***"  # the key is nowhere on the platform
    assert key not in json.dumps(first.engine_process)
    assert first.engine_process["config_version"]
    ProbeJob.objects.update(status=ProbeJob.Status.DONE)  # the enrolment's run is over
    VerificationRun.objects.update(status="done")
    old_pid = first.engine_process["pid"]

    # The platform's command serves HTTPS with the certificate the agent made, and the agent
    # reports it: the platform's calls trust it alone (agent/engine_tls.py).
    pinned = pinned_engine(node_id, tmp_path / "state", port, agent)
    # A stream in flight, straight to the engine (with its key: the engine refuses others).
    assert httpx.get(f"https://127.0.0.1:{port}/v1/models", verify=pinned).status_code == 401
    stream: dict = {"chunks": 0}
    first_chunk, read_on = threading.Event(), threading.Event()

    def generate():
        # Reads the first chunk, then the rest once the drain has begun: however fast this
        # machine generates, the request is still in flight when the platform hears of it.
        body = {"model": ALIAS, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 120, "min_tokens": 120, "temperature": 0, "stream": True}
        with httpx.Client(timeout=120, verify=pinned) as client, client.stream(
                "POST", f"https://127.0.0.1:{port}/v1/chat/completions", json=body,
                headers={"Authorization": f"Bearer {key}"}) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    stream["done"] = True
                elif line.startswith("data: "):
                    stream["chunks"] += 1
                    stream["finish"] = json.loads(line[6:])["choices"][0]["finish_reason"]
                    if not first_chunk.is_set():
                        first_chunk.set()
                        read_on.wait(30)
        stream["ended"] = time.monotonic()

    generating = threading.Thread(target=generate)
    generating.start()
    assert first_chunk.wait(LOAD_S)

    gone: dict = {}

    def watch_old_engine():
        while alive(old_pid):
            time.sleep(0.02)
        gone["at"] = time.monotonic()

    watcher = threading.Thread(target=watch_old_engine)
    watcher.start()
    owner = first.owner
    services.engine_override_set(node_id=node_id, owner=owner, set_by=owner, flag="-c",
                                 value="16384", reason="shorter requests")
    wait_for("draining reported", lambda: node_row(node_id).engine_state == "draining",
             timeout=10, agent=agent)
    assert "done" not in stream  # the platform heard of the drain while the stream ran
    time.sleep(4)  # past the routers' settling time: the drain waits for this request
    assert alive(old_pid) and node_row(node_id).engine_state == "draining"
    read_on.set()
    generating.join(LOAD_S)
    watcher.join(LOAD_S)
    # The stream ran to its end ([DONE], every token), and the engine stopped after it.
    assert stream.get("done") and stream["finish"] == "length" and stream["chunks"] == 122
    assert gone["at"] >= stream["ended"]

    second = ready(node_id, agent, other_than=old_pid)
    argv = second.engine_process["argv"]
    assert argv[argv.index("-c") + 1] == "16384"
    assert second.engine_process["config_version"] != first.engine_process["config_version"]
    [pid] = engines(port)
    words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert words[words.index("--n_ctx") + 1] == "4096"  # 16,384 over llama-server's 4 slots
    # A new command, verified again.
    wait_for("a verification run", lambda: VerificationRun.objects.filter(
        node_id=node_id, trigger="engine_change").exists(), timeout=10)
    assert re.search(r"Draining the engine: the platform's configuration changed", agent.log())

    assert agent.stop() == 0 and engines(port) == []


def test_a_key_rotation_drains_the_engine_and_the_platform_follows_the_key_in_use(
        platform, agents, tmp_path):
    """The engine runs with the key the platform issued (no key in the environment); the owner
    rotates it while a stream is in flight: the stream completes on the old key, the engine
    restarts with the new one, and the platform sends the new one only once the agent reports
    its engine has it."""
    from agent import supervisor
    from marketplace import engine_keys

    node_id, credential = platform(tmp_path)
    state, port = tmp_path / "state", free_port()
    env = {"PATH": f"{llama_server_on_path(tmp_path)}{os.pathsep}{os.environ['PATH']}"}
    env_without_key = {k: v for k, v in os.environ.items() if k != "RIGSHARE_ENGINE_KEY"}
    agent = agents([sys.executable, "-m", "fleetsim", "agent", "--profile", "m4-max-llamacpp",
                    "--machine-id", "m4-test", *run_args(credential, state, port, "--serve",
                                                         ALIAS, "--quantization", "Q4_1",
                                                         "--model-file", str(gguf_path()))[3:]],
                   tmp_path / "agent.log", {**env_without_key, **env})

    # No key at the start: the first heartbeat hands the enrolment's key over, and the engine
    # starts with it.
    first = wait_for("the engine ready with its key", lambda: (
        (row := node_row(node_id)).engine_state == "ready" and row.engine_key_fingerprint
        and not row.engine_key_next and row), agent=agent)
    old_key = (state / "engine-key").read_text().strip()
    assert first.engine_key_fingerprint == engine_keys.fingerprint(old_key)
    assert engine_keys.unseal(first.engine_key_sealed) == old_key
    old_pid = first.engine_process["pid"]
    base, pinned = f"https://127.0.0.1:{port}", pinned_engine(node_id, state, port, agent)
    assert httpx.get(f"{base}/v1/models", verify=pinned).status_code == 401
    assert httpx.get(f"{base}/v1/models", verify=pinned,
                     headers={"Authorization": f"Bearer {old_key}"}).status_code == 200
    ProbeJob.objects.update(status=ProbeJob.Status.DONE)
    VerificationRun.objects.update(status="done")

    stream: dict = {"chunks": 0}
    first_chunk, read_on = threading.Event(), threading.Event()

    def generate():
        body = {"model": ALIAS, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 60, "min_tokens": 60, "temperature": 0, "stream": True}
        with httpx.Client(timeout=120, verify=pinned) as client, client.stream(
                "POST", f"{base}/v1/chat/completions", json=body,
                headers={"Authorization": f"Bearer {old_key}"}) as response:
            stream["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    stream["done"] = True
                elif line.startswith("data: "):
                    stream["chunks"] += 1
                    if not first_chunk.is_set():
                        first_chunk.set()
                        read_on.wait(30)

    generating = threading.Thread(target=generate)
    generating.start()
    assert first_chunk.wait(LOAD_S)

    assert services.node_engine_key_rotate(node_id=node_id, owner=first.owner)
    wait_for("draining reported", lambda: node_row(node_id).engine_state == "draining",
             timeout=10, agent=agent)
    new_key = (state / "engine-key").read_text().strip()
    assert new_key != old_key
    assert (state / supervisor.PREVIOUS_KEY_FILE).read_text().strip() == old_key
    # Until the engine runs with the new key, the platform sends the old one.
    draining = node_row(node_id)
    assert draining.engine_key_fingerprint == engine_keys.fingerprint(old_key)
    assert engine_keys.unseal(draining.engine_key_sealed) == old_key
    assert alive(old_pid)
    read_on.set()
    generating.join(LOAD_S)
    assert stream["status"] == 200 and stream.get("done") and stream["chunks"] == 62

    second = ready(node_id, agent, other_than=old_pid)
    second = wait_for("the new key in use", lambda: (
        (row := node_row(node_id)).engine_key_fingerprint == engine_keys.fingerprint(new_key)
        and row), timeout=10, agent=agent)
    assert not second.engine_key_next
    # The engine takes the new key only; the pool's worker carries it for the next request.
    assert httpx.get(f"{base}/v1/models", verify=pinned,
                     headers={"Authorization": f"Bearer {old_key}"}).status_code == 401
    assert httpx.get(f"{base}/v1/models", verify=pinned,
                     headers={"Authorization": f"Bearer {new_key}"}).status_code == 200
    assert engine_keys.unseal(second.engine_key_sealed) == new_key  # what the pool reads
    assert old_key not in agent.log() and new_key not in agent.log()
    assert new_key not in json.dumps(second.engine_process)
    assert agent.stop() == 0 and engines(port) == []
