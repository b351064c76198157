"""What a rented card costs per 1M output tokens: kept on the listing as price and verified
tokens/s change, sortable in the catalog and /api/cards/, shown beside the platform's own
per-token price for the model the card was measured with."""

from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import ModelPrice
from marketplace import services
from marketplace.models import Listing
from routing.models import EngineModel, Model
from tests.factories import CardFactory, ListingFactory, NodeFactory, UserFactory, listed_card

pytestmark = pytest.mark.django_db

QWEN = "Qwen/Qwen3-27B"


def verified(card, tokens_per_s, model=QWEN, **figures):
    services.card_verification_publish(card_id=card.pk, status="verified",
                                       tokens_per_s=tokens_per_s, reference_spec="RTX 4090",
                                       model=model, concurrency=32, **figures)
    card.refresh_from_db()
    return card


def cost(card) -> int | None:
    return Listing.objects.get(card=card).cost_per_mtok_micros


def test_the_cost_follows_the_verified_figure_and_the_price(bob):
    card = listed_card(node=NodeFactory(owner=bob), listing__price_per_hour_micros=450_000)
    assert cost(card) is None  # not verified: nothing to divide by
    # $0.45/h over 217.5 tok/s (783,000 tokens an hour): $0.574713 per 1M.
    verified(card, 217.5)
    assert cost(card) == 574_713
    # The provider halves the price: $0.225/h -> $0.287356 (287,356.3).
    services.listing_update(owner=bob, card_id=card.pk, is_listed=True,
                            price_per_hour_micros=225_000)
    assert cost(card) == 287_356
    # Re-verified faster, at 435 tok/s (1,566,000 an hour): 225,000e6 / 1,566,000 = 143,678.2.
    verified(card, 435.0)
    assert cost(card) == 143_678
    # A run that measured nothing takes the figure, and the cost, away.
    verified(card, None, model="")
    assert cost(card) is None


def test_an_operator_changing_a_price_in_the_admin_keeps_the_cost_true(client):
    card = verified(listed_card(listing__price_per_hour_micros=1_000_000), 1000.0)
    assert cost(card) == 277_778  # $1/h over 3.6M tokens an hour
    listing = Listing.objects.get(card=card)
    client.force_login(UserFactory(is_staff=True, is_superuser=True, two_factor=True))
    page = client.get(f"/admin/marketplace/listing/{listing.pk}/change/").content.decode()
    assert 'name="cost_per_mtok_micros"' not in page  # shown, never typed in
    response = client.post(f"/admin/marketplace/listing/{listing.pk}/change/", {
        "card": card.pk, "is_listed": "on", "price_per_hour_micros": 2_000_000,
        "claimed_gpu_model": "", "description": ""})
    assert response.status_code == 302, response.content
    assert cost(card) == 555_556  # $2/h over 3.6M


@pytest.fixture
def offer():
    """Four cards for rent: three verified at different costs per 1M, one not yet."""
    return {
        # $0.40/h over 100 tok/s: $1.111111
        "dear": verified(listed_card(listing__price_per_hour_micros=400_000), 100.0),
        # $3.20/h over 2,436 tok/s: $0.364897
        "h200": verified(listed_card(name="NVIDIA H200", memory_total_mib=143771,
                                     listing__price_per_hour_micros=3_200_000), 2436.0),
        # $0.45/h over 217.5 tok/s: $0.574713
        "4090": verified(listed_card(listing__price_per_hour_micros=450_000), 217.5),
        "new": listed_card(listing__price_per_hour_micros=300_000),
    }


def ids(response):
    if response["Content-Type"].startswith("application/json"):
        return [row["id"] for row in response.json()["results"]]
    return [card.pk for card in response.context["page"].cards]


@pytest.mark.parametrize("path", ["/", "/api/cards/"])
def test_sorted_by_cost_cheapest_first_the_unmeasured_last(client, offer, path):
    order = [offer[k].pk for k in ("h200", "4090", "dear", "new")]
    assert ids(client.get(path, {"sort": "cost"})) == order
    assert ids(client.get(path, {"sort": "-cost"})) == order[::-1]


def test_cost_pages_follow_one_another(client, offer, monkeypatch):
    from marketplace import api

    monkeypatch.setattr(api, "CATALOG_PAGE_SIZE", 1)
    seen, url = [], "/api/cards/?sort=cost"
    while url:
        body = client.get(url).json()
        seen += [row["id"] for row in body["results"]]
        url = body["next"]
    assert seen == [offer[k].pk for k in ("h200", "4090", "dear", "new")]


@pytest.fixture
def platform_price():
    """The platform sells the fleet's 27B as qwen3-27b (the operator's mapping), $0.80 per 1M
    output tokens now; a dearer price comes into force tomorrow."""
    model = Model.objects.create(name="qwen3-27b", context_length=32_768)
    EngineModel.objects.create(engine_model_id=QWEN, model=model)
    now = timezone.now()
    ModelPrice.objects.create(model="qwen3-27b", input_micros_per_mtok=200_000,
                              output_micros_per_mtok=900_000, effective_at=now - timedelta(days=9))
    ModelPrice.objects.create(model="qwen3-27b", input_micros_per_mtok=200_000,
                              output_micros_per_mtok=800_000, effective_at=now - timedelta(days=1))
    ModelPrice.objects.create(model="qwen3-27b", input_micros_per_mtok=200_000,
                              output_micros_per_mtok=5_000_000, effective_at=now + timedelta(days=1))
    return model


def test_the_api_shows_the_cost_beside_the_platforms_price(client, offer, platform_price):
    llama = verified(listed_card(listing__price_per_hour_micros=500_000), 1700.0,
                     model="meta-llama/Llama-3.1-8B-Instruct")
    rows = {row["id"]: row for row in client.get("/api/cards/", {"sort": "cost"}).json()[
        "results"]}
    assert rows[offer["4090"].pk]["cost_per_mtok_usd"] == "0.574713"
    assert rows[offer["4090"].pk]["platform_price"] == {"model": "qwen3-27b",
                                                        "output_usd_per_mtok": "0.800000"}
    assert rows[offer["new"].pk]["cost_per_mtok_usd"] is None
    assert rows[llama.pk]["platform_price"] is None  # the platform does not sell it
    one = client.get(f"/api/cards/{offer['h200'].pk}/").json()
    assert (one["cost_per_mtok_usd"], one["platform_price"]["output_usd_per_mtok"]) == (
        "0.364897", "0.800000")


def test_a_public_model_of_the_engines_own_name_is_priced_too(client):
    """No mapping: an engine id that is itself a public model's name (as the pool reads it)."""
    Model.objects.create(name="mistral-small", context_length=32_768)
    ModelPrice.objects.create(model="mistral-small", input_micros_per_mtok=1,
                              output_micros_per_mtok=300_000,
                              effective_at=timezone.now() - timedelta(hours=1))
    card = verified(listed_card(), 300.0, model="mistral-small")
    row = client.get(f"/api/cards/{card.pk}/").json()
    assert row["platform_price"] == {"model": "mistral-small", "output_usd_per_mtok": "0.300000"}
    # An inactive model is not sold: no platform price.
    Model.objects.filter(name="mistral-small").update(is_active=False)
    assert client.get(f"/api/cards/{card.pk}/").json()["platform_price"] is None


def test_the_catalog_and_the_card_page_say_it_in_words(client, offer, platform_price):
    page = client.get("/", {"sort": "cost"}).content.decode()
    assert "$0.574713</span> per 1M output tokens at full use" in page
    assert "platform: $0.80 for qwen3-27b" in page
    card_page = client.get(f"/cards/{offer['4090'].pk}/").content.decode()
    assert "$0.574713 per 1M output tokens at full use" in card_page
    assert "(the platform's API: $0.80 for qwen3-27b)" in card_page
    llama = verified(listed_card(), 1700.0, model="meta-llama/Llama-3.1-8B-Instruct")
    assert "(no platform price)" in client.get(f"/cards/{llama.pk}/").content.decode()


def test_the_schema_documents_the_field_and_the_sort(client):
    schema = client.get("/api/schema/", {"format": "json"}).json()
    card = schema["components"]["schemas"]["CatalogCard"]["properties"]
    assert "cost_per_mtok_usd" in card and "platform_price" in card
    assert "full use" in card["cost_per_mtok_usd"]["description"]
    [sort] = [p for p in schema["paths"]["/api/cards/"]["get"]["parameters"]
              if p["name"] == "sort"]
    assert {"cost", "-cost"} <= set(sort["schema"]["enum"])


def test_a_card_of_another_provider_keeps_its_own_cost(bob, mallory):
    mine = verified(ListingFactory(card=CardFactory(node=NodeFactory(owner=bob)),
                                   price_per_hour_micros=360_000).card, 100.0)
    theirs = verified(ListingFactory(card=CardFactory(node=NodeFactory(owner=mallory)),
                                     price_per_hour_micros=720_000).card, 100.0)
    # $0.36/h over 360,000 tokens an hour: $1.00; $0.72/h: $2.00.
    assert (cost(mine), cost(theirs)) == (1_000_000, 2_000_000)
    with pytest.raises(Exception):  # noqa: B017 (Card.DoesNotExist: not hers to change)
        services.listing_update(owner=mallory, card_id=mine.pk, is_listed=True,
                                price_per_hour_micros=1)
    assert cost(mine) == 1_000_000
