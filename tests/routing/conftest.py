"""The inference API under test: the real ASGI app under uvicorn on a thread, fleetsim engines
as workers, the official openai SDK and httpx as clients."""

import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.keys import api_key_create
from billing.models import ModelPrice
from fleetsim.profiles import get_profile
from fleetsim.server import EngineServer, ServerThread
from marketplace.models import Card
from routing import proxy, requestlog
from routing.models import Deployment, EngineModel, Model
from routing.pool import INFLIGHT, POOL
from routing.retry import BREAKER
from tests.factories import CardFactory, NodeFactory
from verification.models import VerificationRun, VerifiedCapacity

MODEL = "qwen3-27b"
IN_PER_MTOK = 200_000  # $0.20 per 1M input tokens
OUT_PER_MTOK = 800_000  # $0.80 per 1M output tokens
TIME_SCALE = 40  # fleetsim engines run this many times faster than the cards


@dataclass
class Seen:
    """One stream as its client saw it: the tokens after the first, the seconds from the first
    token to the stream's end (what the platform counts as its decode) and from the request
    to the end."""

    decoded: int
    decode_s: float
    whole_s: float


def streamed(client, *, max_tokens: int, prompt: str = "Tell me about GPUs.") -> Seen:
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True})
    started, first, usage = time.monotonic(), None, None
    for chunk in chunks:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic()
        usage = chunk.usage or usage
    ended = time.monotonic()
    return Seen(usage.completion_tokens - 1, ended - first, ended - started)


def seen_rate(seen: list[Seen], *, whole: bool = False) -> float:
    """Tokens/s per stream over these streams, summed as the platform sums them: over their
    decode, or over the whole request (its wait and prefill included)."""
    return sum(s.decoded for s in seen) / sum(s.whole_s if whole else s.decode_s for s in seen)


@pytest.fixture(scope="session", autouse=True)
def _threads_closed(server_threads_closed):
    """Every routing test's server threads are closed before the database is dropped."""


@pytest.fixture(scope="session")
def rigshare_server(server_threads_closed):
    from config.asgi import application

    with ServerThread(application) as server:
        yield server


def _quiet(timeout: float = 10.0) -> None:
    """Wait until the server has settled every request and written its log rows."""
    deadline = time.monotonic() + timeout
    while proxy._background or INFLIGHT or requestlog._rows or requestlog.writing:
        if time.monotonic() > deadline:
            raise AssertionError(f"the proxy did not settle: {len(proxy._background)} tasks, "
                                 f"in flight {dict(INFLIGHT)}, {len(requestlog._rows)} log rows")
        time.sleep(0.02)


@pytest.fixture
def v1(rigshare_server, transactional_db):
    """The /v1 base URL, with a pool that forgets what earlier tests left."""
    POOL.invalidate()
    BREAKER.__init__()
    yield rigshare_server.url + "/v1"
    _quiet()
    POOL.invalidate()


@pytest.fixture
def settled():
    """settled(): wait until every request the server took is billed and logged."""
    return _quiet


@pytest.fixture
def engine():
    """engine(profile_key, **EngineServer options) -> a running fleetsim engine's URL."""
    servers = []

    def _engine(key: str = "rtx-pro-6000", **options):
        options.setdefault("time_scale", TIME_SCALE)
        server = ServerThread(EngineServer(get_profile(key), **options)).__enter__()
        servers.append(server)
        return server.url

    yield _engine
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def model(transactional_db):
    row = Model.objects.create(name=MODEL, context_length=32_768)
    ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=IN_PER_MTOK,
                              output_micros_per_mtok=OUT_PER_MTOK,
                              effective_at=timezone.now() - timedelta(days=1))
    EngineModel.objects.create(engine_model_id="Qwen/Qwen3-27B", model=row)
    # A refresh may have run between the `v1` fixture's invalidation and these rows.
    POOL.invalidate()
    return row


@pytest.fixture
def deploy(model, bob):
    """deploy(url, profile_key) -> a Deployment of the profile's model on a node of bob's,
    verified with the profile's capacity at 32 concurrent unless told otherwise."""

    def _deploy(url: str, key: str = "rtx-pro-6000", *, owner=None, verified=True,
                capacity: float | None = None, max_context: int | None = None,
                quantization: str = "fp8", engine_model: str | None = None) -> Deployment:
        profile = get_profile(key)
        node = NodeFactory(owner=owner or bob, engine_url=url, engine_reachable=True,
                           name=f"{key}-{uuid.uuid4().hex[:6]}")
        status = Card.Verification.VERIFIED if verified else Card.Verification.UNVERIFIED
        cards = [CardFactory(node=node, index=i, name=profile.gpu_name,
                             verification_status=status) for i in range(profile.gpu_count)]
        engine_model = engine_model or profile.model
        if verified:
            run = VerificationRun.objects.create(node=node, trigger="enrolment", status="done",
                                                 model=engine_model)
            total = capacity if capacity is not None else dict(profile.throughput)[32]
            for card in cards:
                VerifiedCapacity.objects.create(card=card, model=engine_model,
                                                tokens_per_s=total / len(cards), run=run)
        deployment = Deployment.objects.create(
            node=node, engine_model_id=engine_model, engine=profile.engine,
            max_context=max_context or profile.context_length, quantization=quantization)
        POOL.invalidate()  # the server's next request sees it (in production: within 1 s)
        return deployment

    return _deploy


@pytest.fixture
def carol_key(carol, fund):
    fund(carol, 10_000_000)  # $10
    _, token = api_key_create(user=carol, name="test")
    return token
