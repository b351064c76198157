"""An engine its agent drains (or restarts) takes no new request: its deployments leave the
pool until the agent says it is ready again, and the change feed names the node at once."""

import pytest

from marketplace.models import Node
from routing import changes, pool, services
from routing.models import Deployment
from tests.routing.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)


def workers() -> list[int]:
    return sorted(w.deployment_id for w in pool.build().workers.get(MODEL, ()))


@pytest.mark.parametrize("state", ["draining", "starting", "loading", "crashed", "stopped"])
def test_an_engine_that_is_not_ready_leaves_the_pool_and_comes_back(deploy, state):
    deployment = deploy("http://a")
    other = deploy("http://b")
    served = [{"id": deployment.engine_model_id, "engine": "vllm", "max_context": 32768,
               "quantization": "fp8"}]
    Node.objects.filter(pk=deployment.node_id).update(
        engine_state="ready", engine_models=[deployment.engine_model_id], engine_served=served,
        engine_connect_url="http://a")
    services.deployments_sync(node_id=deployment.node_id)
    assert workers() == sorted([deployment.pk, other.pk])

    feed = changes.start()
    Node.objects.filter(pk=deployment.node_id).update(engine_state=state)
    services.deployments_sync(node_id=deployment.node_id)  # as its heartbeat does
    assert not Deployment.objects.get(pk=deployment.pk).reported
    assert deployment.node_id in changes.read(feed).nodes  # the routers re-read it
    assert workers() == [other.pk]

    Node.objects.filter(pk=deployment.node_id).update(engine_state="ready")
    services.deployments_sync(node_id=deployment.node_id)
    assert workers() == sorted([deployment.pk, other.pk])


def test_an_engine_the_provider_runs_serves_while_it_answers(deploy):
    deployment = deploy("http://a")
    Node.objects.filter(pk=deployment.node_id).update(
        engine_state="", engine_models=[deployment.engine_model_id], engine_connect_url="http://a")
    services.deployments_sync(node_id=deployment.node_id)
    assert workers() == [deployment.pk]
