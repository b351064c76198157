"""An API consumer's way through the site in a browser: the navigation's Models and
Developers entries, the page Developers leads to, and the activity log with its filters.
(Each page's accessibility, phone layout and screenshot: tests/e2e/test_pages.py.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "qwen3-27b"


@pytest.fixture
def served(bob, server_threads_closed):
    """MODEL priced and served by a verified worker of bob's; the routers read it afresh."""
    from billing.models import ModelPrice
    from marketplace.models import Card
    from routing.models import Deployment, EngineModel, Model
    from routing.pool import POOL
    from tests.factories import CardFactory, NodeFactory
    from verification.models import VerificationRun, VerifiedCapacity

    model = Model.objects.create(name=MODEL, context_length=32_768,
                                 description="Qwen3 27B, instruction-tuned")
    EngineModel.objects.create(engine_model_id="Qwen/Qwen3-27B", model=model)
    ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=200_000,
                              output_micros_per_mtok=800_000,
                              effective_at=datetime(2026, 1, 1, tzinfo=UTC))
    node = NodeFactory(owner=bob, engine_url="http://127.0.0.1:9", engine_reachable=True)
    cards = [CardFactory(node=node, index=i, verification_status=Card.Verification.VERIFIED)
             for i in range(2)]
    run = VerificationRun.objects.create(node=node, trigger="enrolment", status="done",
                                         model="Qwen/Qwen3-27B")
    for card in cards:
        VerifiedCapacity.objects.create(card=card, model="Qwen/Qwen3-27B", tokens_per_s=671.0,
                                        run=run)
    deployment = Deployment.objects.create(node=node, engine_model_id="Qwen/Qwen3-27B",
                                           engine="vllm", max_context=40_960)
    POOL.invalidate()
    yield deployment
    POOL.invalidate()


def log_in(page, live_server, user) -> None:
    client = Client()
    client.force_login(user)
    page.context.add_cookies([{"name": "sessionid", "value": client.cookies["sessionid"].value,
                               "url": live_server.url}])


def test_a_consumer_finds_models_keys_and_their_activity(page, live_server, carol, served):
    from playwright.sync_api import expect

    from tests.routing.test_activity import key_of, request

    key = key_of(carol, "laptop")
    now = datetime.now(UTC).replace(microsecond=0)
    for i in range(6):
        request(key, now - timedelta(minutes=7 * i), deployment=served,
                prompt=800 + 97 * i, completion=120 + 31 * i)
    request(key, now - timedelta(minutes=3), status=429, error_code="rate_limited",
            charged=False, prompt=0, completion=0, ttft_ms=None, latency_ms=2.1)

    # Public: the models page, reached from the navigation.
    page.goto("/")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Models").click()
    expect(page.get_by_role("heading", name="Models", level=1)).to_be_visible()
    row = page.locator(f'tr[data-model="{MODEL}"]')
    expect(row.locator(".price-in")).to_have_text("$0.20")
    expect(row.locator(".price-out")).to_have_text("$0.80")
    expect(row.locator(".context")).to_have_text("40,960")
    expect(row.locator(".capacity")).to_have_text("1,342 tokens/s")

    # Logged in: Developers leads to keys, tokens, docs and the activity log.
    log_in(page, live_server, carol)
    page.goto("/")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Developers").click()
    expect(page.get_by_role("heading", name="Developers", level=1)).to_be_visible()
    for name in ("API keys", "Personal tokens", "REST API reference", "Models", "Activity"):
        expect(page.get_by_role("main").get_by_role("link", name=name, exact=True)
               ).to_be_visible()

    page.get_by_role("main").get_by_role("link", name="Activity", exact=True).click()
    expect(page.get_by_role("heading", name="Activity", level=1)).to_be_visible()
    expect(page.locator("tr[data-request]")).to_have_count(7)
    expect(page.locator("tr.error .status")).to_have_text("429 rate_limited")
    expect(page.locator("tr.ok .worker").first).to_contain_text(f"deployment:{served.pk}")

    page.get_by_label("Status").select_option("error")
    page.get_by_role("button", name="Show").click()
    expect(page.locator("tr[data-request]")).to_have_count(1)
    page.get_by_label("To (UTC)").fill("2020-01-01")
    page.get_by_label("From (UTC)").fill("2021-01-01")
    page.get_by_role("button", name="Show").click()
    expect(page.get_by_text("The end of the range is before its start.")).to_be_visible()
