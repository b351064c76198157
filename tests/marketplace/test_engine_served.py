"""engine.served in the heartbeat (docs/agent-protocol.md, section 2): validated, stored on the
node for routing, refused whole when malformed; and what the real agent reports from real
(fleetsim) engines is what the platform stores."""

import httpx
import pytest

from agent import client
from fleetsim.profiles import MODEL_27B, get_profile
from fleetsim.server import EngineServer, ServerThread
from marketplace.models import Node, NodeUptimeHour
from tests.agent.fakes import FakeServer
from tests.marketplace.test_agent_api import beat, enroll, report

pytestmark = pytest.mark.django_db

VLLM_27B = {"id": MODEL_27B, "engine": "vllm", "max_context": 262_144, "quantization": "bf16"}


def engine(*served, models=(MODEL_27B,)):
    return {"url": "http://127.0.0.1:8000", "reachable": True, "models": list(models),
            "error": None, "served": list(served)}


def test_served_is_stored_as_validated(api, bob):
    enrolled = enroll(api, bob)
    llama = {"id": "qwen3-8b"}  # what is not said is stored as unknown
    response = beat(api, enrolled["credential"], report(engine=engine(
        {**VLLM_27B, "note": "not part of the protocol"}, llama,
        models=[MODEL_27B, "qwen3-8b", "described-nowhere"])))
    assert response.status_code == 200, response.content
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.engine_models == [MODEL_27B, "qwen3-8b", "described-nowhere"]
    assert node.engine_served == [
        VLLM_27B, {"id": "qwen3-8b", "engine": "", "max_context": None, "quantization": ""}]


def test_a_heartbeat_without_served_stores_none(api, bob):
    enrolled = enroll(api, bob)
    beat(api, enrolled["credential"], report(engine=engine(VLLM_27B)))
    response = beat(api, enrolled["credential"], report())  # an agent older than `served`
    assert response.status_code == 200, response.content
    node = Node.objects.get(pk=enrolled["node_id"])
    assert node.engine_served == [] and node.engine_models == [MODEL_27B]
    assert NodeUptimeHour.objects.get(node=node).heartbeats == 2


@pytest.mark.parametrize(("served", "models", "path", "message"), [
    ([dict(VLLM_27B, max_context=0)], [MODEL_27B], ["0", "max_context"], "greater than or equal"),
    ([dict(VLLM_27B, max_context=-4096)], [MODEL_27B], ["0", "max_context"], "greater than"),
    ([dict(VLLM_27B, max_context=10_000_001)], [MODEL_27B], ["0", "max_context"], "less than"),
    ([dict(VLLM_27B, max_context="lots")], [MODEL_27B], ["0", "max_context"], "valid integer"),
    ([dict(VLLM_27B, engine="sglang")], [MODEL_27B], ["0", "engine"], "not a valid choice"),
    ([dict(VLLM_27B, engine=None)], [MODEL_27B], ["0", "engine"], "may not be null"),
    ([dict(VLLM_27B, quantization="q" * 65)], [MODEL_27B], ["0", "quantization"],
     "no more than 64 characters"),
    ([dict(VLLM_27B, quantization=None)], [MODEL_27B], ["0", "quantization"], "may not be null"),
    ([dict(VLLM_27B, id="x" * 257)], ["x" * 256], ["0", "id"], "no more than 256 characters"),
    ([{"engine": "vllm"}], [MODEL_27B], ["0", "id"], "required"),
    ([VLLM_27B, "qwen3-8b"], [MODEL_27B, "qwen3-8b"], ["1", "non_field_errors"],
     "Expected a dictionary"),
    ([{"id": f"m{i}"} for i in range(257)], [f"m{i}" for i in range(256)], [],
     "no more than 256 elements"),
    ([VLLM_27B, VLLM_27B], [MODEL_27B], [], "only once"),
    ([dict(VLLM_27B, id="qwen3-8b")], [MODEL_27B], [], "'qwen3-8b' is not in models"),
    ("all of them", [MODEL_27B], [], "Expected a list"),
])
def test_bad_served_is_refused_naming_the_entry_and_changes_nothing(api, bob, served, models,
                                                                      path, message):
    enrolled = enroll(api, bob)
    beat(api, enrolled["credential"], report(engine=engine(VLLM_27B)))
    node = Node.objects.get(pk=enrolled["node_id"])
    before = (node.engine_models, node.engine_served, node.last_heartbeat_at)

    response = beat(api, enrolled["credential"],
                    report(engine={**engine(models=models), "served": served}))
    assert response.status_code == 400
    errors = response.json()["engine"]["served"]
    for key in path:  # DRF's own error body, down to the entry and field at fault
        errors = errors[key]
    assert len(errors) == 1 and message in errors[0]
    node.refresh_from_db()
    assert (node.engine_models, node.engine_served, node.last_heartbeat_at) == before
    assert NodeUptimeHour.objects.get(node=node).heartbeats == 1


# --- the real agent against real engines ------------------------------------------------------

@pytest.fixture
def http():
    with httpx.Client() as c:
        yield c


@pytest.mark.parametrize(("key", "flags", "expected"), [
    ("h200", {"quantization": "bf16"}, VLLM_27B),
    ("m4-max-llamacpp", {},
     {"id": MODEL_27B, "engine": "llama.cpp", "max_context": 32_768, "quantization": "Q4_K_M",
      # llama-server says its GGUF's parameters and bytes: the model's size, from the machine
      "files": {"config": {"hidden_size": 5120, "vocab_size": 248_320,
                           "max_position_embeddings": 262_144},
                "weights_bytes": int(27e9 * 4.85 / 8), "params": 27_000_000_000,
                "source": "llama-server's model list"}}),
])
def test_what_the_agent_reports_from_fleetsim_engines_is_stored(api, bob, http, key, flags,
                                                                expected):
    enrolled = enroll(api, bob)
    with ServerThread(EngineServer(get_profile(key))) as server:
        status = client.engine_status(http, server.url, **flags)
    response = beat(api, enrolled["credential"], report(engine=status))
    assert response.status_code == 200, response.content
    assert Node.objects.get(pk=enrolled["node_id"]).engine_served == [expected]


def test_what_the_agent_keeps_from_a_nonsense_engine_is_accepted(api, bob, http):
    junk = [{"id": ""}, {"id": " padded"}, {"id": "x" * 257}, {"id": "nul\x00"},
            {"id": "neg", "owned_by": "vllm", "max_model_len": -1},
            {"id": "neg", "owned_by": "vllm", "max_model_len": 4096},
            {"id": "gguf", "owned_by": "llamacpp",
             "meta": {"n_ctx": 10**12, "ftype": "Q" * 65}}]
    # The longest facts the protocol allows, more models than it does: the body still fits.
    many = [{"id": f"m{i:03}".ljust(256, "-"), "owned_by": "llamacpp",
             "meta": {"n_ctx": 10_000_000, "ftype": "Q" * 64}} for i in range(1000)]
    fake = FakeServer(lambda request: (200, {"object": "list", "data": [*junk, *many]}))
    try:
        status = client.engine_status(http, fake.url, max_context=8192)
    finally:
        fake.stop()
    enrolled = enroll(api, bob)
    response = beat(api, enrolled["credential"], report(engine=status))
    assert response.status_code == 200, response.content
    node = Node.objects.get(pk=enrolled["node_id"])
    assert len(node.engine_models) == len(node.engine_served) == 256
    assert node.engine_served[-1] == {"id": "m253".ljust(256, "-"), "engine": "llama.cpp",
                                      "max_context": 10_000_000, "quantization": "Q" * 64}
    assert node.engine_served[:2] == [
        {"id": "neg", "engine": "vllm", "max_context": 8192, "quantization": ""},
        {"id": "gguf", "engine": "llama.cpp", "max_context": 8192, "quantization": ""}]
