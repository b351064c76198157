"""The engine an agent runs as its child (docs/agent-protocol.md, section 4), as the platform
records it, answers it and shows it to its owner."""

import copy
import re

import pytest

from marketplace import services
from marketplace.models import Node
from tests.marketplace.test_agent_api import H200, beat, enroll, report
from verification.models import VerificationRun

pytestmark = pytest.mark.django_db

ARGV = ["vllm", "serve", "Qwen/Qwen3-27B", "--port", "8000", "--api-key", "***"]


def supervised(state="ready", **fields) -> dict:
    return {"state": state, "mode": "command", "model": None, "quantization": None,
            "argv": list(ARGV), "config_version": None, "pid": 4242, "exit_code": None,
            "restarts": 0, "log_tail": ["INFO loading", "INFO ready"], "error": None,
            "restart_seen": 0, **fields}


def with_engine(supervisor=None, **engine) -> dict:
    body = report()
    body["engine"] = {**body["engine"], "served": [], **engine}
    if supervisor is not None:
        body["engine"]["supervisor"] = supervisor
    return body


@pytest.fixture
def node(api, bob):
    enrolled = enroll(api, bob)
    first = beat(api, enrolled["credential"], report())  # the first report: GPUs known
    assert first.status_code == 200
    VerificationRun.objects.update(status="done")  # the enrolment run is over
    return enrolled


def test_the_engines_state_is_recorded_with_since_when(api, node):
    assert beat(api, node["credential"], with_engine(supervised("loading"))).status_code == 200
    row = Node.objects.get(pk=node["node_id"])
    assert row.engine_state == "loading" and row.engine_process["pid"] == 4242
    since = row.engine_state_since
    assert since is not None

    assert beat(api, node["credential"], with_engine(supervised("loading"))).status_code == 200
    assert Node.objects.get(pk=node["node_id"]).engine_state_since == since  # no change

    crashed = supervised("crashed", pid=None, exit_code=-9, restarts=2,
                         log_tail=["Traceback", "CUDA error: out of memory"],
                         error="the engine exited (exit code -9)")
    assert beat(api, node["credential"], with_engine(crashed)).status_code == 200
    row = Node.objects.get(pk=node["node_id"])
    assert row.engine_state == "crashed" and row.engine_state_since > since
    assert row.engine_process["exit_code"] == -9
    assert row.engine_process["log_tail"][-1] == "CUDA error: out of memory"

    # The provider runs the engine again: no state, nothing of the child kept.
    assert beat(api, node["credential"], with_engine()).status_code == 200
    row = Node.objects.get(pk=node["node_id"])
    assert (row.engine_state, row.engine_process) == ("", {})


@pytest.mark.parametrize("bad", [
    {"state": "sleeping"},
    {"argv": ["x" * 1025]},
    {"argv": ["x"] * 257},
    {"log_tail": ["line"] * 51},
    {"log_tail": ["nul \x00 inside"]},
    {"exit_code": 300},
    {"pid": 0},
    {"mode": "shell"},
])
def test_an_engine_report_out_of_bounds_is_refused(api, node, bad):
    response = beat(api, node["credential"], with_engine(supervised(**bad)))
    assert response.status_code == 400, response.content
    assert "supervisor" in response.json()["engine"]
    assert Node.objects.get(pk=node["node_id"]).engine_state == ""


def test_the_reply_carries_the_platforms_command_to_an_agent_that_serves_a_model(api, node):
    serving = supervised("starting", mode="platform", model="Qwen/Qwen3-27B",
                         quantization="fp8", argv=[], pid=None)
    reply = beat(api, node["credential"], with_engine(serving)).json()
    config = reply["engine"]["config"]
    assert reply["engine"]["restart"] == 0
    assert config["runnable"] and re.fullmatch(r"[0-9a-f]{16}", config["version"])
    # The model the agent names, before any engine serves it, on this machine's H200.
    assert config["argv"][:3] == ["vllm", "serve", "Qwen/Qwen3-27B"]
    argv = config["argv"]
    assert argv[argv.index("--port") + 1] == "8000"  # where the agent says the engine listens
    assert argv[argv.index("--api-key") + 1] == "${RIGSHARE_ENGINE_KEY}"

    # The same facts: the same version. An override set by the owner: a new one.
    again = beat(api, node["credential"], with_engine(serving)).json()["engine"]["config"]
    assert again["version"] == config["version"]
    owner = Node.objects.get(pk=node["node_id"]).owner
    services.engine_override_set(node_id=node["node_id"], owner=owner, set_by=owner,
                                 flag="--max-num-seqs", value="64", reason="fewer at once")
    changed = beat(api, node["credential"], with_engine(serving)).json()["engine"]["config"]
    assert changed["version"] != config["version"]
    assert changed["argv"][changed["argv"].index("--max-num-seqs") + 1] == "64"


def test_an_unknown_model_is_no_command_with_the_reason(api, node):
    serving = supervised("starting", mode="platform", model="acme/unknown-7b", argv=[], pid=None)
    config = beat(api, node["credential"], with_engine(serving)).json()["engine"]["config"]
    assert not config["runnable"] and config["argv"] == []
    assert "does not know acme/unknown-7b" in config["problems"][0]


def test_the_providers_own_command_gets_no_configuration_and_others_no_engine_part(api, node):
    reply = beat(api, node["credential"], with_engine(supervised())).json()
    assert reply["engine"] == {"config": None, "restart": 0, "yardstick": None}
    assert "engine" not in beat(api, node["credential"], with_engine()).json()


@pytest.mark.django_db(transaction=True)  # a run starts once the heartbeat has committed
def test_a_new_command_is_verified_again_once_ready_a_restart_is_not(api, node):
    def runs():
        return list(VerificationRun.objects.filter(node_id=node["node_id"],
                                                   trigger="engine_change"))

    assert beat(api, node["credential"], with_engine(supervised("loading"))).status_code == 200
    assert runs() == []  # not ready yet
    assert beat(api, node["credential"], with_engine(supervised("ready"))).status_code == 200
    assert len(runs()) == 1  # the first command it became ready with
    VerificationRun.objects.update(status="done")

    for state in ("crashed", "loading", "ready"):  # restarted with the same command
        beat(api, node["credential"], with_engine(supervised(state, restarts=1)))
    assert len(runs()) == 1

    new = [*ARGV, "--max-num-seqs", "64"]
    for state in ("draining", "starting", "loading", "ready"):
        beat(api, node["credential"], with_engine(supervised(state, argv=new)))
    assert len(runs()) == 2


def test_the_owner_asks_for_a_restart_and_the_reply_carries_it(api, node, bob, mallory, login):
    assert beat(api, node["credential"], with_engine(supervised())).status_code == 200
    url = f"/provider/machines/{node['node_id']}/engine/restart/"

    refused = login(mallory).post(url)
    assert refused.status_code == 404
    assert Node.objects.get(pk=node["node_id"]).engine_restarts_requested == 0

    owner = login(bob)
    assert owner.get(url).status_code == 405  # a change is a POST
    response = owner.post(url)
    assert response.status_code == 302
    assert response["Location"].endswith(f"/provider/machines/{node['node_id']}/#engine-process")
    row = Node.objects.get(pk=node["node_id"])
    assert row.engine_restarts_requested == 1 and row.engine_restart_requested_at

    page = owner.get(f"/provider/machines/{node['node_id']}/").content.decode()
    assert 'id="engine-restart-pending"' in page

    reply = beat(api, node["credential"], with_engine(supervised())).json()
    assert reply["engine"]["restart"] == 1
    # The agent acted on it: nothing pending any more.
    beat(api, node["credential"], with_engine(supervised("draining", restart_seen=1)))
    page = owner.get(f"/provider/machines/{node['node_id']}/").content.decode()
    assert 'id="engine-restart-pending"' not in page


def test_no_restart_for_an_engine_the_agent_does_not_run(api, node, bob, login):
    assert beat(api, node["credential"], with_engine()).status_code == 200
    response = login(bob).post(f"/provider/machines/{node['node_id']}/engine/restart/",
                               follow=True)
    assert "does not run its engine" in response.content.decode()
    assert Node.objects.get(pk=node["node_id"]).engine_restarts_requested == 0


def test_the_machine_page_shows_the_engines_state_command_and_log(api, node, bob, login):
    crashed = supervised("crashed", pid=None, exit_code=1, restarts=3,
                         argv=["llama-server", "-m", "/models/x.gguf", "--api-key", "***"],
                         log_tail=["loading model", "error: <unknown> tensor type"],
                         error="the engine exited (exit code 1)")
    assert beat(api, node["credential"], with_engine(crashed)).status_code == 200
    page = login(bob).get(f"/provider/machines/{node['node_id']}/").content.decode()
    section = page.split('id="engine-process"', 1)[1].split("</section>", 1)[0]
    assert 'data-state="crashed"' in section
    assert "the agent restarts it after a short wait" in section
    assert "last exit code 1" in section and "3 since the agent started" in section
    assert "llama-server -m /models/x.gguf --api-key ***" in section
    assert "error: &lt;unknown&gt; tensor type" in section  # escaped, as any text
    assert 'action="/provider/machines/' in section and "Restart engine" in section


def test_the_page_of_a_machine_whose_engine_the_provider_runs(api, node, bob, login):
    assert beat(api, node["credential"], with_engine()).status_code == 200
    page = login(bob).get(f"/provider/machines/{node['node_id']}/").content.decode()
    section = page.split('id="engine-process"', 1)[1].split("</section>", 1)[0]
    assert "You run this machine's engine yourself" in section
    assert "Restart engine" not in section


def test_a_report_without_gpus_change_keeps_the_engine_digest(api, node):
    # Nothing of the engine is a hardware fact: the GPUs' baseline is untouched by it.
    body = with_engine(supervised())
    body["gpus"] = [copy.deepcopy(H200)]
    assert beat(api, node["credential"], body).status_code == 200
    assert Node.objects.get(pk=node["node_id"]).hardware_changed_at is None
