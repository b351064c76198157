"""`python -m fleetsim up`: engine servers plus the real node agent against a stand-in platform."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fleetsim.__main__ import build_parser
from fleetsim.fleet import FleetError, plan_machines
from fleetsim.profiles import PLANTED_FLEET
from fleetsim.server import ServerThread

REPO = Path(__file__).resolve().parents[2]


def test_plan_names_machines_and_gives_each_a_port_and_a_token(tmp_path):
    machines = plan_machines(["h200", "2x-rtx-4090", "h200"], ["t1", "t2", "t3"], tmp_path, 9000)
    assert [m.machine_id for m in machines] == ["h200-1", "2x-rtx-4090-1", "h200-2"]
    assert [m.port for m in machines] == [9000, 9001, 9002]
    assert [m.token for m in machines] == ["t1", "t2", "t3"]
    assert machines[2].credential_file == tmp_path / "h200-2.json"
    assert machines[1].engine_url == "http://127.0.0.1:9001"


def test_plan_wants_one_token_per_machine_unless_all_are_enrolled(tmp_path):
    with pytest.raises(FleetError, match="one enrolment token per machine"):
        plan_machines(["h200", "h200"], ["t1"], tmp_path, 9000)
    with pytest.raises(FleetError, match="one enrolment token per machine"):
        plan_machines(["h200"], [], tmp_path, 9000)
    (tmp_path / "h200-1.json").write_text("{}")
    (machine,) = plan_machines(["h200"], [], tmp_path, 9000)
    assert machine.token is None


def test_a_dash_token_stands_for_an_enrolled_machine(tmp_path, capsys):
    # A restarted demo passes "-" for each machine enrolled before: as "--tokens=-,-", since
    # "--tokens -,-" reads as an option and argparse stops.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--platform", "http://p", "--profiles", "h200,h200",
                                   "--tokens", "-,-"])
    args = build_parser().parse_args(["up", "--platform", "http://p", "--profiles", "h200,h200",
                                      "--tokens=-,rse_b"])
    with pytest.raises(FleetError, match="no enrolment token and no credential file .*h200-1"):
        plan_machines(args.profiles, args.tokens, tmp_path, None)
    (tmp_path / "h200-1.json").write_text("{}")
    machines = plan_machines(args.profiles, args.tokens, tmp_path, None)
    assert [m.token for m in machines] == [None, "rse_b"]
    capsys.readouterr()


def test_engine_ports_are_free_ones_and_never_the_platforms(tmp_path):
    machines = plan_machines(["h200", "h200"], ["t1", "t2"], tmp_path, None,
                             platform="http://127.0.0.1:8100")
    assert [m.port for m in machines] == [None, None]  # picked by the system when bound
    with pytest.raises(FleetError, match="8100-8101 include the platform's port 8100"):
        plan_machines(["h200", "h200"], ["t1", "t2"], tmp_path, 8100,
                      platform="http://127.0.0.1:8100")
    with pytest.raises(FleetError, match="include the platform's port 8001"):
        plan_machines(["h200", "h200"], ["t1", "t2"], tmp_path, 8000,
                      platform="http://localhost:8001/")
    assert [m.port for m in plan_machines(["h200"], ["t1"], tmp_path, 8101,
                                          platform="http://127.0.0.1:8100")] == [8101]


def test_plan_rejects_an_unknown_profile(tmp_path):
    with pytest.raises(FleetError, match="known profiles"):
        plan_machines(["a100"], ["t"], tmp_path, 9000)


def test_up_planted_is_the_whole_planted_fleet_with_one_token_per_machine(tmp_path, capsys):
    args = build_parser().parse_args(["up", "--platform", "http://p", "--planted"])
    assert args.profiles == PLANTED_FLEET
    tokens = [f"t{i}" for i in range(len(PLANTED_FLEET))]
    machines = plan_machines(args.profiles, tokens, tmp_path, 9000)
    # One machine a key, but the twins: two machines of one key.
    assert [m.machine_id for m in machines] == [
        f"{key}-{PLANTED_FLEET[:i + 1].count(key)}" for i, key in enumerate(PLANTED_FLEET)]
    assert {m.machine_id for m in machines} >= {"liar-twin-5090-24b-1", "liar-twin-5090-24b-2"}
    assert [m.token for m in machines] == tokens
    with pytest.raises(FleetError, match="one enrolment token per machine"):
        plan_machines(args.profiles, tokens[:-1], tmp_path, 9000)
    # The new keys work with --profiles too; --planted and --profiles do not mix.
    args = build_parser().parse_args(["up", "--platform", "http://p", "--profiles",
                                      "liar-48gb,rtx-4090"])
    assert args.profiles == ["liar-48gb", "rtx-4090"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--platform", "http://p", "--planted",
                                   "--profiles", "h200"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--platform", "http://p"])
    capsys.readouterr()


class FakePlatform:
    """The two agent endpoints of docs/agent-protocol.md, recording what arrives."""

    def __init__(self):
        self.enrolments: list[dict] = []
        self.heartbeats: list[tuple[str, dict]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = json.loads(body or b"{}")
        if scope["path"] == "/api/agent/enroll/":
            self.enrolments.append(data)
            status, reply = 201, {"node_id": 100 + len(self.enrolments),
                                  "credential": f"rsn_{data['token']}", "heartbeat_interval_s": 10}
        elif scope["path"] == "/api/agent/heartbeat/":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode()
            self.heartbeats.append((auth, data))
            status, reply = 200, {"node_id": 0, "status": "online", "needs_review": False,
                                  "heartbeat_interval_s": 0.2, "jobs": []}
        else:
            status, reply = 404, {"detail": "Not found."}
        payload = json.dumps(reply).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            held = []
            for port in range(base, base + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no run of free ports")


def children_of(pid: int) -> set[int]:
    kids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry.name))
    return kids


def wait_for(condition, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_up(platform_url, state_dir, base_port, tokens, profiles="h200,h200,m4-max-llamacpp"):
    args = [sys.executable, "-m", "fleetsim", "up", "--platform", platform_url,
            "--profiles", profiles, "--state-dir", str(state_dir), "--time-scale", "100"]
    if base_port is not None:
        args += ["--base-port", str(base_port)]
    if tokens:
        args += ["--tokens", ",".join(tokens)]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def stop(proc, sig) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=15)
    return out


@pytest.mark.e2e  # several processes: `up`, three agents
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks for orphans through /proc")
def test_up_runs_engines_and_real_agents_and_stops_without_orphans(tmp_path):
    platform = FakePlatform()
    base = free_port_run(3)
    with ServerThread(platform) as fake:
        proc = start_up(fake.url, tmp_path, base, ["rse_a", "rse_b", "rse_c"])
        try:
            # Every machine enrols once and heartbeats with its own credential.
            wait_for(lambda: len({auth for auth, _ in platform.heartbeats}) == 3,
                     what="heartbeats from three agents")
            agents = children_of(proc.pid)
            assert len(agents) == 3
            for port in (base, base + 1, base + 2):
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
                assert models[0]["id"] == "Qwen/Qwen3-27B"
            owners = {httpx.get(f"http://127.0.0.1:{p}/v1/models").json()["data"][0]["owned_by"]
                      for p in (base, base + 1, base + 2)}
            assert owners == {"vllm", "llamacpp"}
        finally:
            out = stop(proc, signal.SIGTERM)
        assert proc.returncode == 0, out
        assert not any(Path(f"/proc/{pid}").exists() for pid in agents), "agent left running"

        assert sorted(e["token"] for e in platform.enrolments) == ["rse_a", "rse_b", "rse_c"]
        latest = {auth: body for auth, body in platform.heartbeats}
        assert all(b["simulated"] and b["engine"]["reachable"] for b in latest.values())
        assert all(b["engine"]["models"] == ["Qwen/Qwen3-27B"] for b in latest.values())
        uuids = [g["uuid"] for b in latest.values() for g in b["gpus"]]
        assert len(uuids) == len(set(uuids)) == 3
        assert latest["Bearer rsn_rse_c"]["gpus"][0]["name"] == "Apple M4 Max"
        for machine, token in (("h200-1", "rse_a"), ("h200-2", "rse_b"),
                               ("m4-max-llamacpp-1", "rse_c")):
            credential = json.loads((tmp_path / f"{machine}.json").read_text())
            assert credential["credential"] == f"rsn_{token}"  # the machine's own token
            assert any(line.startswith(machine) and f"node {credential['node_id']}" in line
                       for line in out.splitlines()), out

        # Restarting without a token keeps the node: no new enrolment, the same credential.
        seen = len(platform.heartbeats)
        proc = start_up(fake.url, tmp_path, base, [], profiles="h200")
        try:
            wait_for(lambda: len(platform.heartbeats) > seen, what="a heartbeat after restart")
        finally:
            out = stop(proc, signal.SIGINT)
        assert proc.returncode == 0, out
        assert len(platform.enrolments) == 3
        assert {auth for auth, _ in platform.heartbeats[seen:]} == {"Bearer rsn_rse_a"}


@pytest.mark.e2e
def test_up_reports_a_refused_enrolment_and_exits(tmp_path):
    with ServerThread(FakePlatform()) as fake:
        result = subprocess.run(
            [sys.executable, "-m", "fleetsim", "up", "--platform", fake.url + "/nowhere",
             "--profiles", "h200", "--tokens", "rse_x", "--state-dir", str(tmp_path),
             "--base-port", str(free_port_run(1))],
            cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "h200-1: agent enroll failed" in result.stderr
    assert not (tmp_path / "h200-1.json").exists()


@pytest.mark.e2e
def test_up_takes_free_engine_ports_by_default(tmp_path):
    """Whatever listens on 8100 (a demo's site, say), the fleet starts: its engines take free
    ports unless given --base-port."""
    platform = FakePlatform()
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", 8100))
        squatter.listen()
    except OSError:
        pass  # taken already: as good for this test
    try:
        with ServerThread(platform) as fake:
            proc = start_up(fake.url, tmp_path, None, ["rse_a", "rse_b"], profiles="h200,h200")
            try:
                wait_for(lambda: len({auth for auth, _ in platform.heartbeats}) == 2
                         or proc.poll() is not None, what="heartbeats from two agents")
                assert proc.poll() is None, proc.stdout.read()
            finally:
                out = stop(proc, signal.SIGTERM)
    finally:
        squatter.close()
    ports = {int(body["engine"]["url"].rsplit(":", 1)[1]) for _, body in platform.heartbeats}
    assert len(ports) == 2 and 8100 not in ports, out
    assert all(body["engine"]["reachable"] for _, body in platform.heartbeats)


@pytest.mark.e2e
def test_up_says_in_one_line_why_it_cannot_listen(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "fleetsim", "up", "--platform", "http://127.0.0.1:1",
             "--profiles", "h200", "--tokens", "rse_x", "--state-dir", str(tmp_path),
             "--base-port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"fleetsim: cannot listen on 127.0.0.1:{port}: ")


def test_a_machine_of_an_agent_engine_profile_has_its_agent_start_the_engine(tmp_path, capsys):
    from agent.cli import build_parser as agent_parser
    from fleetsim.fleet import agent_run_args

    own, served = plan_machines(["m4-max-llamacpp", "h200"], ["t1", "t2"], tmp_path, 9300,
                                agent_engines=frozenset({"m4-max-llamacpp"}))
    assert (own.own_engine, served.own_engine) == (True, False)
    args = agent_parser().parse_args(agent_run_args(own, time_scale=50))
    assert args.engine_command.split()[1:] == ["-m", "fleetsim", "serve", "--profile",
                                               "m4-max-llamacpp", "--port", "9300",
                                               "--time-scale", "50"]
    assert args.engine_url == "http://127.0.0.1:9300"
    assert args.state_dir == tmp_path / "m4-max-llamacpp-1.engine"
    assert agent_parser().parse_args(agent_run_args(served)).engine_command is None

    typo = build_parser().parse_args(["up", "--platform", "http://p", "--profiles", "h200",
                                      "--tokens", "t", "--agent-engines", "m4-max"])
    assert typo.command(typo) == 1  # said, not ignored
    assert "--agent-engines: unknown fleetsim profile 'm4-max'" in capsys.readouterr().err
