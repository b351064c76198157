"""What the platform serves, as API consumers meet it: the public models page and the extra
fields of /v1/models (OpenRouter's `context_length` and `pricing`, and `x_rigshare`), read from
the routers' pool snapshot."""

from datetime import timedelta

import httpx
import openai
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import ModelPrice
from routing import pool, selectors
from routing.models import Model
from routing.pool import POOL
from tests.factories import RentalFactory
from tests.routing.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)

NOWHERE = "http://127.0.0.1:9"  # listing a model calls no engine


def sdk(v1: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=v1, api_key=key, max_retries=0, timeout=30)


@pytest.fixture
def fleet(deploy, alice):
    """Three verified workers of MODEL, one of them rented by alice, and one unverified."""
    big = deploy(NOWHERE, capacity=1_000.0, max_context=65_536)
    small = deploy(NOWHERE, capacity=342.5, max_context=16_384)
    rented = deploy(NOWHERE, capacity=5_000.0, max_context=131_072)
    RentalFactory(card=rented.node.cards.get(), renter=alice)
    deploy(NOWHERE, verified=False, max_context=262_144)
    POOL.invalidate()
    return big, small


def test_v1_models_gives_price_context_and_verified_capacity_through_the_sdk(v1, carol_key,
                                                                            fleet):
    listed = sdk(v1, carol_key).models.list().data
    assert [m.id for m in listed] == [MODEL]
    found = listed[0]
    # OpenAI's own fields, as before.
    assert (found.object, found.owned_by) == ("model", "rigshare")
    assert isinstance(found.created, int)
    # OpenRouter's: dollars per token, as exact decimal strings ($0.20 and $0.80 per 1M).
    assert found.pricing == {"prompt": "0.0000002", "completion": "0.0000008"}
    # The largest context of a verified worker that takes shared traffic: not the rented
    # one's (it serves alice alone), nor the unverified one's.
    assert found.context_length == 65_536
    assert found.x_rigshare == {
        "description": "", "context_length_basis": "verified_workers",
        "model_context_length": 32_768, "verified_workers": 2,
        "verified_tokens_per_s": 1_342,  # 1,000 + 342.5, rounded
        "served": None}  # no traffic yet (test_served_figures: with it)
    assert found.available is True
    assert sdk(v1, carol_key).models.retrieve(MODEL).model_dump() == found.model_dump()


def test_over_plain_http_a_model_nobody_verified_serves_says_so(v1, carol_key, deploy, model):
    quiet = Model.objects.create(name="quiet-model", context_length=8_192,
                                 description="Served when a verified machine comes back.")
    ModelPrice.objects.create(model=quiet.name, input_micros_per_mtok=1_500_000,
                              output_micros_per_mtok=15_000_000,
                              effective_at=timezone.now() - timedelta(hours=1))
    # Priced from tomorrow only: not on offer yet.
    Model.objects.create(name="tomorrow-model", context_length=4_096)
    ModelPrice.objects.create(model="tomorrow-model", input_micros_per_mtok=1,
                              output_micros_per_mtok=1,
                              effective_at=timezone.now() + timedelta(days=1))
    deploy(NOWHERE, capacity=900.0, max_context=8_000)
    POOL.invalidate()
    auth = {"Authorization": f"Bearer {carol_key}"}
    data = httpx.get(f"{v1}/models", headers=auth).json()
    assert [m["id"] for m in data["data"]] == ["quiet-model", MODEL]
    found = httpx.get(f"{v1}/models/quiet-model", headers=auth)
    assert found.status_code == 200
    assert found.json() == {
        "id": "quiet-model", "object": "model", "created": int(quiet.created_at.timestamp()),
        "owned_by": "rigshare", "context_length": 8_192, "available": False,
        "pricing": {"prompt": "0.0000015", "completion": "0.000015"},
        "x_rigshare": {"description": "Served when a verified machine comes back.",
                       "context_length_basis": "model", "model_context_length": 8_192,
                       "verified_workers": 0, "verified_tokens_per_s": 0, "served": None}}
    # A worker whose context is below the model's figure: what it holds is what is said.
    served = httpx.get(f"{v1}/models/{MODEL}", headers=auth).json()
    assert (served["context_length"], served["x_rigshare"]["verified_tokens_per_s"]) == (
        8_000, 900)
    missing = httpx.get(f"{v1}/models/tomorrow-model", headers=auth)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    assert httpx.get(f"{v1}/models").status_code == 401


def test_the_models_page_is_public_and_shows_the_same_figures(v1, fleet, bob):
    base = v1.removesuffix("/v1")
    response = httpx.get(f"{base}/models/")  # nobody logged in
    assert response.status_code == 200
    html = response.text
    row = html.split(f'<tr data-model="{MODEL}">')[1].split("</tr>")[0]
    assert '<td class="price-in">$0.20</td>' in row
    assert '<td class="price-out">$0.80</td>' in row
    assert '<td class="context">65,536</td>' in row
    assert '<td class="capacity">1,342 tokens/s</td>' in row
    assert '<td class="workers">2</td>' in row
    assert "USD per 1M tokens" in html and "the largest a verified worker serving it holds" \
        in html
    assert bob.email not in html
    assert 'href="/models/"' in html  # in the navigation, for everyone


def test_the_offers_are_read_from_the_snapshot_without_a_query(fleet):
    snap = pool.build()
    with CaptureQueriesContext(connection) as captured:
        offers = selectors.model_offers(snap)
    assert len(captured) == 0
    assert [(o.name, o.workers, o.served_context) for o in offers] == [(MODEL, 2, 65_536)]


def test_the_page_and_the_snapshot_it_reads_cost_the_same_queries_whatever_the_fleet(
        client, deploy, model):
    def queries() -> tuple[int, int]:
        POOL.invalidate()
        with CaptureQueriesContext(connection) as page:  # the request's own thread
            assert client.get("/models/").status_code == 200
        with CaptureQueriesContext(connection) as build:  # what the routers' refresh reads
            pool.build()
        return len(page), len(build)

    deploy(NOWHERE)
    one = queries()
    for _ in range(4):
        deploy(NOWHERE)
    assert queries() == one
