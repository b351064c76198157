"""`python -m fleetsim agent`: the real node agent, handed a simulated machine
(fleetsim/machine.py), against the agent tests' local platform and engine."""

import json

import pytest

from agent import hardware
from fleetsim.__main__ import main
from tests.agent.conftest import credential_file, engine, platform  # noqa: F401 (fixtures)


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

