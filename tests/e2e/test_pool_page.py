"""The staff's pool page in a browser: it refreshes itself, so a worker that joins the pool
appears without a reload."""

from __future__ import annotations

import pytest
from django.test import Client

from routing.models import Deployment
from tests.factories import CardFactory, NodeFactory, UserFactory
from verification.models import VerificationRun, VerifiedCapacity

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _worker(owner, engine_model: str, tps: float) -> Deployment:
    from marketplace.models import Card
    from routing.models import EngineModel, Model

    model, _ = Model.objects.get_or_create(name="qwen3-27b", defaults={"context_length": 32_768})
    EngineModel.objects.get_or_create(engine_model_id=engine_model, defaults={"model": model})
    node = NodeFactory(owner=owner, engine_url="http://127.0.0.1:9", engine_reachable=True)
    card = CardFactory(node=node, index=0, verification_status=Card.Verification.VERIFIED)
    run = VerificationRun.objects.create(node=node, trigger="enrolment", status="done",
                                         model=engine_model)
    VerifiedCapacity.objects.create(card=card, model=engine_model, tokens_per_s=tps, run=run)
    return Deployment.objects.create(node=node, engine_model_id=engine_model, engine="vllm")


def test_the_pool_page_shows_a_new_worker_without_a_reload(page, live_server, bob):
    from playwright.sync_api import expect

    first = _worker(bob, "Qwen/Qwen3-27B", 1342.0)
    staff = UserFactory(email="ops@example.com", is_staff=True, two_factor=True)
    client = Client()
    client.force_login(staff)
    page.context.add_cookies([{"name": "sessionid", "value": client.cookies["sessionid"].value,
                               "url": live_server.url}])
    page.goto("/staff/pool/")
    expect(page.locator(f'tr[data-worker="{first.worker_ref}"]')).to_be_visible()
    expect(page.locator(f'tr[data-worker="{first.worker_ref}"] .key-share')).to_have_text(
        "100.0%")

    second = _worker(bob, "Qwen/Qwen3-27B", 435.0)
    # No reload: the page fetches itself again within its refresh interval.
    row = page.locator(f'tr[data-worker="{second.worker_ref}"]')
    expect(row).to_be_visible(timeout=15_000)
    expect(page.locator(f'tr[data-worker="{first.worker_ref}"] .key-share')).not_to_have_text(
        "100.0%")
