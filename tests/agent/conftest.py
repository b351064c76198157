import pytest

from agent import hardware
from agent.credential import write_credential
from tests.agent.fakes import H200, FakeServer, fake_nvml

NODE_REPLY = {"node_id": 7, "status": "online", "needs_review": False,
              "heartbeat_interval_s": 0.05, "jobs": []}


def platform_default(request):
    if request.path == "/api/agent/enroll/":
        return 201, {"node_id": 7, "credential": "rsn_secret", "heartbeat_interval_s": 10}
    return 200, NODE_REPLY


@pytest.fixture
def platform():
    server = FakeServer(platform_default)
    yield server
    server.stop()


@pytest.fixture
def engine():
    server = FakeServer(lambda request: (200, {"object": "list", "data": [
        {"id": "Qwen/Qwen3-27B", "object": "model"}]}))
    yield server
    server.stop()


@pytest.fixture
def credential_file(tmp_path, platform):
    path = tmp_path / "agent.json"
    write_credential(path, {"platform": platform.url, "node_id": 7, "credential": "rsn_secret"})
    return path


@pytest.fixture
def h200_machine(monkeypatch):
    """This machine, as far as the agent can tell, has one H200."""
    nvml = fake_nvml([H200])
    monkeypatch.setattr(hardware, "load_pynvml", lambda: nvml)
    return nvml
