"""A renter's rental page: the rented card as their own endpoint. Requests go through the
real server to the card's engine; the page counts them, and nobody else's."""

import openai
import pytest
from django.test import Client
from django.utils import timezone

from billing.models import Charge
from marketplace import services
from marketplace.models import Card, Listing, Rental
from tests.routing.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_rental_page_is_the_renters_endpoint_with_their_own_live_figures(
        v1, engine, deploy, carol, carol_key, mallory, fund, settled):
    deployment = deploy(engine())
    card = Card.objects.get(node=deployment.node)
    Listing.objects.create(card=card, is_listed=True, price_per_hour_micros=1_000_000)
    deployment.node.status = "online"
    deployment.node.last_heartbeat_at = timezone.now()
    deployment.node.save(update_fields=["status", "last_heartbeat_at"])
    rental = services.rental_start(renter=carol, card_id=card.pk)

    client = openai.OpenAI(base_url=v1, api_key=carol_key, max_retries=0, timeout=30)
    for i in range(3):
        client.chat.completions.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": f"turn {i}"}])
    settled()
    assert not Charge.objects.exists()  # the rented card's tokens are the rental's

    page = Client()
    page.force_login(carol)
    response = page.get(f"/rentals/{rental.pk}/")
    html = response.content.decode()
    panel = response.context["panels"][0]["context"]
    assert panel["models"][0]["name"] == MODEL
    assert panel["total"] == {"requests": 3, "completion_tokens": 15,
                              "prompt_tokens": panel["total"]["prompt_tokens"]}
    assert panel["live"]["requests"] == 3 and panel["live"]["tokens_per_s"] > 0
    assert f'model="{MODEL}"' in html and 'id="sdk-snippet"' in html
    assert 'id="live-requests">3<' in html

    # Not mallory's to see, nor to stop; the confirmation page stops nothing by itself.
    page.force_login(mallory)
    assert page.get(f"/rentals/{rental.pk}/").status_code == 404
    assert page.get(f"/rentals/{rental.pk}/stop/").status_code == 404
    assert page.post(f"/rentals/{rental.pk}/stop/").status_code == 404
    page.force_login(carol)
    confirm = page.get(f"/rentals/{rental.pk}/stop/")
    assert "Stop rental" in confirm.content.decode()
    assert Rental.objects.get(pk=rental.pk).stopped_at is None
    page.post(f"/rentals/{rental.pk}/stop/")
    assert Rental.objects.get(pk=rental.pk).stopped_at is not None
    ended = page.get(f"/rentals/{rental.pk}/").content.decode()
    assert "This rental has ended" in ended and "Stop this rental" not in ended
