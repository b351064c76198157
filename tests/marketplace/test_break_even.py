"""When owning a card breaks even: the public calculator (/tools/break-even) starting from the
fleet's median verified figures, a provider's own card's page, and the dashboard's summary.
Each expected figure is worked out by hand in the comments."""

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from billing.models import ModelPrice
from marketplace import selectors, services
from marketplace.models import Card
from routing.models import EngineModel, Model
from tests.factories import CardFactory, ListingFactory, NodeFactory, RentalFactory

pytestmark = pytest.mark.django_db

QWEN = "Qwen/Qwen3-27B"
RTX_4090 = "NVIDIA GeForce RTX 4090"


def verified_card(*, single, loaded, idle_w, loaded_w, price=None, owner=None, region="eu-central",
                  name=RTX_4090, model=QWEN) -> Card:
    card = CardFactory(node=NodeFactory(region=region, **({"owner": owner} if owner else {})),
                       name=name)
    ListingFactory(card=card, is_listed=price is not None,
                   price_per_hour_micros=price or 0)
    services.card_verification_publish(
        card_id=card.pk, status="verified", tokens_per_s=loaded, reference_spec="RTX 4090",
        model=model, concurrency=32, single_tokens_per_s=single, power_idle_w=idle_w,
        power_loaded_w=loaded_w)
    card.refresh_from_db()
    return card


@pytest.fixture
def fleet():
    """Three verified 4090s serving the 27B; two listed, at $0.40 and $0.50 an hour. Their
    medians: 45 tok/s alone, 220 at 32, 25 W idle and 400 W serving, $0.45 an hour."""
    return [verified_card(single=40, loaded=200, idle_w=20, loaded_w=380, price=400_000),
            verified_card(single=45, loaded=220, idle_w=25, loaded_w=400, price=500_000),
            verified_card(single=50, loaded=300, idle_w=30, loaded_w=420)]


@pytest.fixture
def platform_price():
    """The platform sells the 27B as qwen3-27b at $0.80 per 1M output tokens."""
    model = Model.objects.create(name="qwen3-27b", context_length=32_768)
    EngineModel.objects.create(engine_model_id=QWEN, model=model)
    ModelPrice.objects.create(model="qwen3-27b", input_micros_per_mtok=200_000,
                              output_micros_per_mtok=800_000,
                              effective_at=timezone.now() - timedelta(days=1))


def test_the_fleets_medians_are_the_same_from_postgresql_and_from_python(fleet):
    figures = selectors.fleet_figures(RTX_4090, QWEN)
    assert (figures.cards, figures.concurrency) == (3, 32)
    assert (figures.tokens_per_s_single, figures.tokens_per_s_loaded) == (45, 220)
    assert (figures.power_idle_w, figures.power_loaded_w) == (25, 400)
    assert figures.price_per_hour_micros == 450_000  # of the two listed
    assert figures.utilization == 0  # nobody rented them
    # The demo's SQLite takes the medians in Python: the same figures.
    with mock.patch.object(selectors.connection, "vendor", "sqlite"):
        assert selectors.fleet_figures(RTX_4090, QWEN) == figures
    assert selectors.fleet_figures(RTX_4090, "some/other-model") is None
    assert selectors.verified_gpu_models() == [(RTX_4090, QWEN, 3)]


def test_the_fleets_utilization_is_its_rented_share(fleet):
    """One of the three rented for half of its time on the platform: 1/6 of all their time."""
    now = timezone.now()
    for card in fleet:
        Card.objects.filter(pk=card.pk).update(first_seen_at=now - timedelta(days=2))
    RentalFactory(card=fleet[0], started_at=now - timedelta(days=1), price_per_hour_micros=1)
    figures = selectors.fleet_figures(RTX_4090, QWEN, now=now)
    assert figures.utilization == pytest.approx(1 / 6)


# The public page starts from the medians, Germany's electricity, the 4090's $1,599 launch
# price over 24 months, 40 W for the rest of the machine and the platform's $0.80 per 1M:
#   fixed: 1,599,000,000 / (24 x 730) = 91,267.1 micro-dollars an hour
#   idle: (25 + 40) W x $0.429713/kWh = 27,931.3 an hour; serving adds 375 W: 161,142.4
#   earns busy all the time: $0.80 x 220 x 3,600 / 10^6 = 633,600 an hour
#   break-even: (91,267.1 + 27,931.3) / (633,600 - 161,142.4) = 25.2%
#   US ($0.16/kWh): (91,267.1 + 10,400) / (633,600 - 60,000) = 17.7%
#   one at a time (45 tok/s): earns 129,600 an hour: never, in both.

def test_the_public_calculator_starts_from_the_fleets_figures(client, fleet, platform_price):
    response = client.get("/tools/break-even")
    assert response.status_code == 200
    page = response.content.decode()
    form = response.context["form"]
    assert (form.data["tokens_per_s_single"], form.data["tokens_per_s_loaded"]) == ("45", "220")
    assert (form.data["idle_w"], form.data["loaded_w"], form.data["concurrency"]) == (
        "25", "400", "32")
    assert (form.data["hardware_usd"], form.data["api_usd_per_mtok"]) == ("1599", "0.8")
    assert form.data["price_per_hour_usd"] == "0.45" and form.data["utilization_pct"] == "0"
    assert 'id="break-even">25.2%</strong>' in page
    assert 'id="break-even-single">never</strong>' in page
    places = {p["key"]: p for p in response.context["result"]["places"]}
    assert round(places["de"]["loaded"], 1) == 25.2 and round(places["us"]["loaded"], 1) == 17.7
    assert places["de"]["single"] is None and places["us"]["single"] is None
    assert "The medians of 3 verified NVIDIA GeForce RTX 4090 cards serving Qwen/Qwen3-27B" in page
    # Where the numbers come from, on the page.
    assert "BDEW-Strompreisanalyse 2025" in page and "EIA" in page


def test_changing_an_input_changes_the_result(client, fleet, platform_price):
    # The API at $2.00: earns 1,584,000 an hour; (119,198.4) / (1,584,000 - 161,142.4) = 8.4%.
    page = client.get("/tools/break-even", {"api_usd_per_mtok": "2"}).content.decode()
    assert 'id="break-even">8.4%</strong>' in page
    # At $10 even one at a time breaks even: earns 1,620,000 an hour alone;
    # 119,198.4 / (1,620,000 - 161,142.4) = 8.2%.
    page = client.get("/tools/break-even", {"api_usd_per_mtok": "10"}).content.decode()
    assert 'id="break-even-single">8.2%</strong>' in page
    # A custom electricity price of $0 leaves the hardware alone:
    # 91,267.1 / 633,600 = 14.4%.
    page = client.get("/tools/break-even", {"electricity": "custom",
                                            "electricity_usd_per_kwh": "0"}).content.decode()
    assert 'id="break-even">14.4%</strong>' in page


def test_the_chart_marks_the_break_even_and_has_a_text_alternative(client, fleet, platform_price):
    page = client.get("/tools/break-even").content.decode()
    assert '<svg class="chart cost-curve" role="img" aria-labelledby="cost-chart-title ' \
           'cost-chart-desc"' in page
    assert 'class="api"' in page and page.count('class="break-even"') == 1
    assert "32 requests at once: breaks even at 25% used" in page
    table = page.split('<table class="curve">')[1].split("</table>")[0]
    assert table.count("<tr>") == 1 + 10  # a row for each 10%
    # Busy all the time at full concurrency: (91,267.1 + 440 W x 429.713) / 0.792M tokens
    #   = (91,267.1 + 189,073.7) / 0.792 = $0.353966 per 1M.
    assert "<th scope=\"row\">100%</th><td>$0.353966</td>" in table


@pytest.mark.parametrize(("params", "field"), [
    ({"tokens_per_s_loaded": "-3"}, "tokens_per_s_loaded"),
    ({"concurrency": "zero"}, "concurrency"),
    ({"electricity": "custom"}, "electricity_usd_per_kwh"),
    ({"hardware_usd": ""}, "hardware_usd"),
    ({"utilization_pct": "140"}, "utilization_pct"),
    ({"price_per_hour_usd": ""}, "price_per_hour_usd"),  # one without the other
])
def test_bad_input_is_an_error_on_its_field(client, fleet, params, field):
    response = client.get("/tools/break-even", params)
    assert response.status_code == 400
    assert field in response.context["form"].errors
    assert f'data-field="{field}"' in response.content.decode()
    assert response.context["result"] is None


def test_with_no_verified_card_the_figures_are_asked_for(client):
    response = client.get("/tools/break-even")
    assert response.status_code == 200 and response.context["result"] is None
    assert "No card of the fleet is verified yet" in response.content.decode()
    # Typed in by hand, the calculator answers all the same (no API price: no break-even).
    response = client.get("/tools/break-even", {
        "tokens_per_s_single": "40", "tokens_per_s_loaded": "400", "concurrency": "16",
        "idle_w": "20", "loaded_w": "350", "hardware_usd": "2000"})
    assert response.status_code == 200
    assert "enter an API price to see where it breaks even" in response.content.decode()


def test_a_pick_the_fleet_does_not_have_is_said(client, fleet):
    response = client.get("/tools/break-even", {"gpu": "NVIDIA H200", "model": QWEN})
    assert response.status_code == 400
    assert "No verified NVIDIA H200 serves Qwen/Qwen3-27B" in response.content.decode()


# --- a provider's own card ---

def test_the_providers_card_starts_from_its_own_figures(client, bob, platform_price):
    """A 4090 of bob's in us-east, verified at 50 tok/s alone and 300 at 32, 30 W idle and
    420 W serving, listed at $0.50 an hour and rented for a quarter of its 4 days."""
    card = verified_card(single=50, loaded=300, idle_w=30, loaded_w=420, price=500_000,
                         owner=bob, region="us-east")
    now = timezone.now()
    Card.objects.filter(pk=card.pk).update(first_seen_at=now - timedelta(days=4))
    RentalFactory(card=card, started_at=now - timedelta(days=1),
                  stopped_at=now, price_per_hour_micros=500_000)
    client.force_login(bob)
    response = client.get(f"/provider/cards/{card.pk}/break-even")
    assert response.status_code == 200
    data = response.context["form"].data
    assert (data["tokens_per_s_single"], data["tokens_per_s_loaded"]) == ("50", "300")
    assert (data["idle_w"], data["loaded_w"], data["electricity"]) == ("30", "420", "us")
    assert (data["price_per_hour_usd"], data["utilization_pct"]) == ("0.5", "25")
    # US: idle (30 + 40) W x $0.16 = 11,200; serving adds 390 W: 62,400; earns
    # $0.80 x 1.08M = 864,000 an hour: (91,267.1 + 11,200) / (864,000 - 62,400) = 12.8%.
    page = response.content.decode()
    assert 'id="break-even">12.8%</strong>' in page
    # A month at $0.50/h rented 25%: renters pay $91.25 (730 h x 0.25 x $0.50); the 15% fee
    # is $13.69 (rounded up); bob keeps $77.56. The card's month: $1,599 / 24 = $66.625 ->
    # $66.63; electricity at 0.75 x 70 W + 0.25 x 460 W = 167.5 W: 122.275 kWh x $0.16 =
    # $19.56. Left: 77.5625 - 66.625 - 19.564 = -$8.63.
    month = response.context["result"]["month"]
    assert (month.rent_micros, month.fee_micros, month.earned_micros) == (
        91_250_000, 13_687_500, 77_562_500)
    assert (month.hardware_micros, month.electricity_micros) == (66_625_000, 19_564_000)
    assert month.net_micros == -8_626_500
    assert '<td id="month-net"><strong>-$8.63</strong></td>' in page
    # Edited there like on the public page: at $0.40 a kWh the US line is Germany-like.
    edited = client.get(f"/provider/cards/{card.pk}/break-even",
                        {"electricity": "custom", "electricity_usd_per_kwh": "0.4"})
    assert edited.context["result"]["break_even"] != response.context["result"]["break_even"]


def test_nobody_else_sees_a_providers_card(client, bob, mallory):
    card = verified_card(single=50, loaded=300, idle_w=30, loaded_w=420, owner=bob)
    assert client.get(f"/provider/cards/{card.pk}/break-even").status_code == 302  # log in
    client.force_login(mallory)
    assert client.get(f"/provider/cards/{card.pk}/break-even").status_code == 404


def test_the_dashboard_says_where_each_card_breaks_even(client, bob, platform_price):
    card = verified_card(single=50, loaded=300, idle_w=30, loaded_w=420, price=500_000,
                         owner=bob, region="us-east")
    waiting = CardFactory(node=NodeFactory(owner=bob))  # not verified yet
    ListingFactory(card=waiting, is_listed=False, price_per_hour_micros=0)
    client.force_login(bob)
    page = client.get("/provider/").content.decode()
    row = page.split(f'<tr data-card="{card.pk}">')[1].split("</tr>")[0]
    # $0.50/h over 300 tok/s (1.08M an hour): $0.462963 per 1M; 12.8% as above.
    assert "$0.462963</span> per 1M output tokens at full use" in row
    assert "breaks even against the platform at 13% busy (United States)" in row
    assert f'href="/provider/cards/{card.pk}/break-even"' in row
    other = page.split(f'<tr data-card="{waiting.pk}">')[1].split("</tr>")[0]
    assert "breaks even" not in other and f"/provider/cards/{waiting.pk}/break-even" in other
