"""`python -m fleetsim agent`: the real node agent, handed a simulated machine
(fleetsim/machine.py), against the agent tests' local platform and engine."""

import json

import pytest

from agent import hardware
from fleetsim.__main__ import main
from tests.agent.conftest import (  # noqa: F401 (fixtures)
    NODE_REPLY,
    credential_file,
    engine,
    platform,
)
from tests.agent.fakes import scripted


def simulated(capsys, machine_id, *command):
    assert main(["agent", "--profile", "h200", "--machine-id", machine_id, *command]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulated_h200_has_a_deterministic_uuid(capsys):
    facts = simulated(capsys, "m1", "facts")
    assert facts["simulated"] is True and facts["nvidia"] is True
    assert facts["hostname"] == "m1"  # simulated machines share one host: ids tell them apart
    [gpu] = facts["gpus"]
    assert gpu["name"] == "NVIDIA H200" and gpu["memory_total_mib"] == 143_771
    assert gpu["uuid"].startswith("GPU-")
    assert simulated(capsys, "m1", "facts")["gpus"][0]["uuid"] == gpu["uuid"]
    assert simulated(capsys, "m2", "facts")["gpus"][0]["uuid"] != gpu["uuid"]


def test_simulated_heartbeat(platform, engine, credential_file, monkeypatch):  # noqa: F811
    monkeypatch.setattr(hardware, "load_pynvml", lambda: pytest.fail("NVML read"))
    assert main(["agent", "--profile", "2x-rtx-4090", "--machine-id", "box-1", "run",
                 "--engine-url", engine.url, "--credential-file", str(credential_file),
                 "--once"]) == 0
    [beat] = [r.body for r in platform.requests if r.path == "/api/agent/heartbeat/"]
    assert (beat["simulated"], beat["hostname"]) == (True, "box-1")
    assert [g["index"] for g in beat["gpus"]] == [0, 1]


def test_simulated_probes_come_from_the_profile(capsys):
    result = simulated(capsys, "m1", "probe", "--quick")
    assert result["device"] == "cuda" and len(result["gpus"]) == 1
    assert result["gpus"][0]["uuid"] == simulated(capsys, "m1", "facts")["gpus"][0]["uuid"]


def test_unknown_profile_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["agent", "--profile", "h999", "--machine-id", "m1", "facts"])
    assert exit_.value.code == 2
    assert "invalid choice: 'h999'" in capsys.readouterr().err



def test_a_simulated_machine_reports_its_power_draw_when_asked(
        platform, engine, credential_file):  # noqa: F811
    """The agent is run with the machine's engine URL; asked (report_power), the heartbeats
    carry each GPU's draw for the batch that engine runs (none: idle, 25 W on a 4090)."""
    platform.respond = scripted((200, {**NODE_REPLY, "report_power": True}), (200, NODE_REPLY),
                                (403, {"detail": "revoked"}))
    assert main(["agent", "--profile", "2x-rtx-4090", "--machine-id", "box-1", "run",
                 "--engine-url", engine.url, "--credential-file", str(credential_file),
                 "--interval", "0.05"]) == 1
    beats = [r.body for r in platform.requests if r.path == "/api/agent/heartbeat/"]
    assert [[g.get("power_draw_w") for g in b["gpus"]] for b in beats] == [
        [None, None], [25, 25], [None, None]]
    assert any(r.path == "/metrics" for r in engine.requests)  # its load, read from the engine
