"""The heartbeat fast path (agentapi/asgi.py) with an engine the agent runs: a report whose
engine state moved is never answered as the one before, and what the owner asks reaches the
agent at its next heartbeat."""

import pytest

from marketplace import services
from marketplace.models import Node
from tests.marketplace.test_engine_process import supervised
from tests.marketplace.test_heartbeat_fast import agent, entry, platform, report  # noqa: F401
from verification.models import ProbeJob, VerificationRun

pytestmark = pytest.mark.django_db(transaction=True)


def with_supervisor(**fields):
    body = report()
    body["engine"]["supervisor"] = supervised(**fields)
    return body


def verified(agent, body):  # noqa: F811
    """The engine's first ready report starts a verification run (its first command): answer
    it, as the agent would, so that the answers that follow carry no job."""
    assert agent(body).status_code == 200
    assert VerificationRun.objects.filter(node_id=agent.node_id, trigger="engine_change").exists()
    ProbeJob.objects.update(status=ProbeJob.Status.DONE)
    VerificationRun.objects.update(status="done")


def test_a_changed_engine_state_takes_the_full_path(agent):  # noqa: F811
    ready = with_supervisor()
    verified(agent, ready)
    assert agent(ready).status_code == 200
    assert agent(ready).status_code == 200  # the full path stored it, this one came from Redis
    assert entry(agent.prefix) is not None

    draining = agent(with_supervisor(state="draining"))
    assert draining.status_code == 200
    node = Node.objects.get(pk=agent.node_id)
    assert node.engine_state == "draining"  # recorded, not answered from the entry
    # Only the log's lines moved: a new report all the same.
    assert agent(with_supervisor(state="draining", log_tail=["one more line"])).status_code == 200
    assert Node.objects.get(pk=agent.node_id).engine_process["log_tail"] == ["one more line"]


def test_a_restart_asked_reaches_the_agent_through_the_fast_path(agent, bob):  # noqa: F811
    ready = with_supervisor()
    verified(agent, ready)
    assert agent(ready).json()["engine"]["restart"] == 0
    assert agent(ready).json()["engine"]["restart"] == 0
    assert entry(agent.prefix) is not None

    assert services.node_engine_restart_request(node_id=agent.node_id, owner=bob)
    assert entry(agent.prefix) is None  # forgotten at once
    assert agent(ready).json()["engine"]["restart"] == 1
    assert agent(ready).json()["engine"]["restart"] == 1  # and the entry repeats the new answer
