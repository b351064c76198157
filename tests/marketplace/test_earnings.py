from datetime import timedelta

import pytest
from django.utils import timezone

from billing import metering
from billing.keys import api_key_authenticate, api_key_create
from billing.models import ModelPrice
from marketplace import services
from marketplace.models import NodeStatusChange, node_ref
from tests.factories import CardFactory, ListingFactory, NodeFactory, price_at

pytestmark = pytest.mark.django_db


def test_provider_earnings_by_machine_and_day_with_tokens_and_rental_hours(
        client, alice, bob, carol, mallory, fund, settings, django_assert_max_num_queries):
    settings.RIGSHARE_PLATFORM_FEE_BPS = 1000
    node = NodeFactory(owner=bob, name="box")
    card = CardFactory(node=node)
    ListingFactory(card=card, price_per_hour_micros=3_600_000)
    start = timezone.now() - timedelta(hours=2)
    NodeStatusChange.objects.create(node=node, status="online", at=start - timedelta(days=1))
    fund(alice, 50_000_000)
    rental = services.rental_start(renter=alice, card_id=card.pk, now=start)
    services.rental_stop(rental_id=rental.pk, renter=alice, now=start + timedelta(hours=1))

    fund(carol, 10_000_000)
    _, token = api_key_create(user=carol, name="k")
    key = api_key_authenticate(token)
    ModelPrice.objects.create(model="m", input_micros_per_mtok=1_000_000,
                              output_micros_per_mtok=2_000_000,
                              effective_at=start - timedelta(days=1))
    price = price_at("m")
    for i in range(3):
        held = metering.reserve(key=key, model="m", price=price, max_cost=10_000,
                                request_id=f"r{i}", tokens=1000)
        metering.settle(hold=held, usage=metering.Usage(1000, 500),
                        worker=metering.Worker(bob.pk, node_ref(node.pk)))

    client.force_login(bob)
    with django_assert_max_num_queries(12):
        page = client.get("/provider/earnings/")
    data = page.context
    [row] = data["by_machine"]  # the rental (its card) and the tokens (its machine) together
    assert row["node"] == node and row["rental_hours"] == 1
    assert row["rental_micros"] == 3_240_000  # $3.60 less 10%
    assert row["requests"] == 3 and row["tokens"] == 4500
    assert row["token_micros"] == 3 * 1800  # 2,000 micros a request less 10%
    assert data["unpaid_micros"] == 3_240_000 + 5400 == data["total_micros"]
    html = page.content.decode()
    assert "<td>$3.25</td>" in html and "<td>$0.0054</td>" in html and "<rect" in html
    assert f"{card.name} #1)" in html  # cards count from 1

    client.force_login(mallory)
    page = client.get("/provider/earnings/")
    assert page.context["by_machine"] == [] and page.context["unpaid_micros"] == 0
    client.logout()
    assert client.get("/provider/earnings/").status_code == 302
