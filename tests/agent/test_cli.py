"""The agent's commands against a real local HTTP platform and engine (tests/agent/fakes.py)."""

import ast
import json
import socket
from pathlib import Path

import pytest

from agent import __version__, hardware
from agent.cli import main
from agent.credential import read_credential
from tests.agent.conftest import NODE_REPLY
from tests.agent.fakes import H200, NVMLError_LibraryNotFound, fake_nvml, scripted


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def heartbeats(server):
    return [r for r in server.requests if r.path == "/api/agent/heartbeat/"]


# --- enroll ---------------------------------------------------------------------------------

def test_enroll_stores_the_credential_and_says_what_next(platform, tmp_path, capsys):
    path = tmp_path / "rigshare" / "agent.json"
    code = main(["enroll", "--platform", platform.url + "/", "--token", "rse_abc_def",
                 "--credential-file", str(path)])
    assert code == 0
    [request] = platform.requests
    assert (request.method, request.path) == ("POST", "/api/agent/enroll/")
    assert request.body == {"token": "rse_abc_def", "hostname": socket.gethostname(),
                            "agent_version": __version__}
    assert read_credential(path) == {"platform": platform.url, "node_id": 7,
                                     "credential": "rsn_secret"}
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "node 7" in out and str(path) in out
    assert f"python -m agent run --engine-url http://127.0.0.1:8000 --credential-file {path}" in out


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (401, {"detail": "This enrolment token has expired."}, "This enrolment token has expired."),
        (400, {"token": ["This field is required."]}, "token: This field is required."),
    ],
)
def test_enroll_refused_prints_the_platforms_reason(platform, tmp_path, capsys, status, body,
                                                    message):
    platform.respond = lambda request: (status, body)
    path = tmp_path / "agent.json"
    assert main(["enroll", "--platform", platform.url, "--token", "rse_x",
                 "--credential-file", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not path.exists()


def test_enroll_with_the_platform_down(tmp_path, capsys):
    url = closed_port_url()
    assert main(["enroll", "--platform", url, "--token", "rse_x",
                 "--credential-file", str(tmp_path / "agent.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreachable" in err and url in err


# --- run ------------------------------------------------------------------------------------

def run_agent(credential_file, engine_url, *extra, machine=None):
    return main(["run", "--engine-url", engine_url, "--credential-file", str(credential_file),
                 "--interval", "0.05", *extra], machine=machine)


def test_heartbeat_carries_credential_hardware_and_models(platform, engine, credential_file,
                                                          h200_machine, capsys):
    assert run_agent(credential_file, engine.url, "--once") == 0
    [request] = heartbeats(platform)
    assert request.method == "POST"
    assert request.headers["Authorization"] == "Bearer rsn_secret"
    body = request.body
    assert body["agent_version"] == __version__
    assert body["hostname"] == socket.gethostname()
    assert body["os"] == hardware.host_os()
    assert (body["simulated"], body["nvidia"]) == (False, True)
    assert (body["driver_version"], body["cuda_version"]) == ("560.35.03", "12.6")
    assert [(g["name"], g["memory_total_mib"]) for g in body["gpus"]] == [("NVIDIA H200", 143_771)]
    assert body["engine"] == {"url": engine.url, "reachable": True, "models": ["Qwen/Qwen3-27B"],
                              "error": None, "key_held": None, "key_fingerprint": None,
                              "tls_certificate": None,  # plain HTTP
                              "served": [{"id": "Qwen/Qwen3-27B", "engine": "",
                                          "max_context": None, "quantization": ""}]}
    assert [r.path for r in engine.requests] == ["/v1/models"]
    assert "Heartbeat OK: node 7 online; 1 GPU(s); engine up, 1 model(s)" in capsys.readouterr().err


def test_engine_down_still_heartbeats(platform, credential_file, h200_machine):
    assert run_agent(credential_file, closed_port_url(), "--once") == 0
    engine = heartbeats(platform)[0].body["engine"]
    assert engine["reachable"] is False and engine["models"] == []
    assert "ConnectError" in engine["error"]


def test_engine_that_is_not_openai_compatible(platform, engine, credential_file, h200_machine):
    engine.respond = lambda request: (404, {"detail": "Not Found"})
    assert run_agent(credential_file, engine.url, "--once") == 0
    assert heartbeats(platform)[0].body["engine"]["error"] == "GET /v1/models answered HTTP 404"


@pytest.mark.parametrize(
    ("status", "detail"),
    [(403, "This node's credential has been revoked."), (401, "Invalid credential.")],
)
def test_refused_node_stops(platform, engine, credential_file, h200_machine, capsys, status,
                            detail):
    platform.respond = lambda request: (status, {"detail": detail})
    assert run_agent(credential_file, engine.url) == 1  # the loop, not --once: it must stop
    assert len(heartbeats(platform)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and detail in err and str(status) in err


def test_survives_a_platform_restart(platform, engine, credential_file, h200_machine, capsys):
    # Down for two heartbeats (connection refused), then up but failing (503), then fine,
    # then revoked so that the loop ends. The engine is asked once per heartbeat, before the
    # platform, so it tells when to bring the platform back.
    platform.respond = scripted((503, {"detail": "starting"}), (200, NODE_REPLY),
                                (403, {"detail": "revoked"}))
    platform.stop()
    answer_models = engine.respond

    def engine_respond(request):
        if len(engine.requests) == 3:
            platform.start()
        return answer_models(request)

    engine.respond = engine_respond
    assert run_agent(credential_file, engine.url) == 1
    assert len(heartbeats(platform)) == 3
    err = capsys.readouterr().err
    assert err.count("platform unreachable: ConnectError") == 2
    assert "platform answered HTTP 503; retrying in 0.05 s" in err
    assert "Heartbeat OK: node 7 online" in err


def test_the_platforms_interval_is_obeyed(platform, engine, credential_file, h200_machine):
    platform.respond = scripted((200, {**NODE_REPLY, "heartbeat_interval_s": 0.3}),
                                (200, NODE_REPLY), (403, {"detail": "revoked"}))
    assert main(["run", "--engine-url", engine.url, "--credential-file", str(credential_file),
                 "--interval", "5"]) == 1
    first, second, third = (r.at for r in heartbeats(platform))
    assert 0.3 <= second - first < 3  # not the 5 s of --interval
    assert third - second < 0.3  # the second reply said 0.05 s


def test_no_gpu_line_is_printed_once(platform, engine, credential_file, monkeypatch, capsys):
    nvml = fake_nvml([], init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found"))
    monkeypatch.setattr(hardware, "load_pynvml", lambda: nvml)
    platform.respond = scripted((200, NODE_REPLY), (200, NODE_REPLY), (403, {"detail": "bye"}))
    assert run_agent(credential_file, engine.url) == 1
    body = heartbeats(platform)[0].body
    assert (body["nvidia"], body["gpus"]) == (False, [])
    assert len(heartbeats(platform)) == 3
    err = capsys.readouterr().err
    assert err.count("No NVIDIA GPU found on this machine "
                     "(NVML: NVML Shared Library Not Found); reporting it without GPUs.") == 1


def test_malformed_heartbeat_is_logged_and_retried(platform, engine, credential_file,
                                                   h200_machine, capsys):
    platform.respond = scripted((400, {"gpus": {"0": {"uuid": ["This field is required."]}}}),
                                (403, {"detail": "bye"}))
    assert run_agent(credential_file, engine.url) == 1
    assert len(heartbeats(platform)) == 2
    assert "HTTP 400): gpus: 0: uuid: This field is required." in capsys.readouterr().err


def test_once_fails_when_the_platform_is_down(tmp_path, engine, capsys, h200_machine):
    from agent.credential import write_credential

    path = tmp_path / "agent.json"
    write_credential(path, {"platform": closed_port_url(), "node_id": 7, "credential": "rsn_x"})
    assert run_agent(path, engine.url, "--once") == 1
    assert "platform unreachable" in capsys.readouterr().err


def test_run_without_enrolling(tmp_path, capsys):
    assert run_agent(tmp_path / "agent.json", "http://127.0.0.1:8000", "--once") == 1
    assert "enrol first" in capsys.readouterr().err


# --- facts, and a machine handed to the agent ---------------------------------------------------------------

def test_facts_prints_the_hardware_part(h200_machine, capsys):
    assert main(["facts"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["gpus"][0]["uuid"] == H200["uuid"]
    assert (facts["nvidia"], facts["simulated"]) == (True, False)


class StandIn:
    """A machine handed to the agent by its caller (as fleetsim does): the agent asks it, and
    nothing else, for the hostname, the facts and the probes."""

    def __init__(self, gpus=2):
        self.gpus = [{"index": i, "name": "Stand-in GPU", "uuid": f"GPU-stand-in-{i}",
                      "memory_total_mib": 1024, "compute_capability": "8.9",
                      "pcie_gen_current": 4, "pcie_gen_max": 4, "pcie_width_current": 16,
                      "pcie_width_max": 16, "power_limit_w": 450} for i in range(gpus)]

    def hostname(self):
        return "stand-in-1"

    def facts(self):
        return {"os": "Linux 6.8", "simulated": True, "nvidia": True,
                "driver_version": "560.35.03", "cuda_version": "12.6", "gpus": self.gpus}, None

    def probes(self, params, *, device=None, log=None):
        return {"device": "cuda", "gpus": [], "errors": [], "asked": [params, device]}


def test_a_handed_machine_replaces_this_ones(platform, engine, credential_file, monkeypatch,
                                             capsys):
    monkeypatch.setattr(hardware, "load_pynvml", lambda: pytest.fail("NVML read"))
    assert main(["facts"], machine=StandIn()) == 0
    facts = json.loads(capsys.readouterr().out)
    assert (facts["hostname"], facts["simulated"]) == ("stand-in-1", True)
    assert run_agent(credential_file, engine.url, "--once", machine=StandIn()) == 0
    body = heartbeats(platform)[0].body
    assert (body["hostname"], body["simulated"]) == ("stand-in-1", True)
    assert [g["uuid"] for g in body["gpus"]] == ["GPU-stand-in-0", "GPU-stand-in-1"]
    assert main(["probe", "--quick", "--device", "cpu"], machine=StandIn()) == 0
    assert json.loads(capsys.readouterr().out)["asked"] == [{"quick": True}, "cpu"]


def test_the_agent_knows_no_simulator(capsys):
    with pytest.raises(SystemExit):
        main(["facts", "--simulate", "h200", "--machine-id", "m1"])
    assert "unrecognized arguments: --simulate" in capsys.readouterr().err
    imported = set()
    for path in Path(hardware.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    assert "fleetsim" not in imported and "agent" in imported


def test_the_gpus_power_draw_is_sent_while_the_platform_asks(platform, engine, credential_file,
                                                              h200_machine):
    """`report_power` in an answer: the heartbeats after it carry each GPU's draw (W), until an
    answer no longer asks."""
    platform.respond = scripted((200, NODE_REPLY), (200, {**NODE_REPLY, "report_power": True}),
                                (200, {**NODE_REPLY, "report_power": True}), (200, NODE_REPLY),
                                (403, {"detail": "revoked"}))
    assert run_agent(credential_file, engine.url) == 1
    draws = [[gpu.get("power_draw_w") for gpu in r.body["gpus"]] for r in heartbeats(platform)]
    # The fake H200 reads 112,640 mW.
    assert draws == [[None], [None], [113], [113], [None]]
    assert "power_draw_w" not in heartbeats(platform)[0].body["gpus"][0]
