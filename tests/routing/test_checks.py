"""Unannounced checks (routing/checks.py): at random times, requests an engine cannot tell from a
renter's, through the real proxy's sending path to a fleetsim engine; counted in the live
figures and the card's history, billed to nobody."""

import json
import random
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import openai
import pytest
from django.utils import timezone

from billing.models import Charge, Entry, Hold
from fleetsim.profiles import get_profile
from fleetsim.server import EngineServer, ServerThread
from marketplace import engine_keys
from routing import checks, served
from routing.models import Deployment, RequestLog, UnannouncedCheck
from tests.factories import ListingFactory
from tests.routing.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)


class Recording:
    """An engine that keeps the headers and body of every chat request it is sent."""

    def __init__(self, app):
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.seen.append(({k.decode(): v.decode() for k, v in scope["headers"]},
                          json.loads(body)))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def test_checks_come_at_random_times_and_each_once(deploy):
    deployments = [deploy("http://127.0.0.1:9") for _ in range(3)]
    now = timezone.now()
    assert checks.checks_due(now=now) == []  # each given its first time, drawn
    firsts = dict(Deployment.objects.values_list("pk", "next_check_at"))
    assert all(at > now for at in firsts.values()) and len(set(firsts.values())) == 3
    later = now + timedelta(days=3)
    with ThreadPoolExecutor(2) as pool:  # two schedulers at once: each check goes once
        found = list(pool.map(lambda _: checks.checks_due(now=later), range(2)))
    assert sorted(found[0] + found[1]) == sorted(d.pk for d in deployments)
    gaps = [(at - later).total_seconds() for at in Deployment.objects.values_list(
        "next_check_at", flat=True)]
    assert all(gap > 0 for gap in gaps)
    draws = [(checks.next_at(now, random.Random(i)) - now).total_seconds() for i in range(400)]
    mean = sum(draws) / len(draws)
    assert 0.8 * checks.CHECK_EVERY.total_seconds() < mean < 1.2 * checks.CHECK_EVERY.total_seconds()
    assert min(draws) < 600  # no quiet period an engine could count on


def test_a_check_is_sent_as_a_renters_request_and_billed_to_nobody(
        v1, carol_key, deploy, settled, client, bob):
    recording = Recording(EngineServer(get_profile("rtx-pro-6000"), time_scale=10))
    with ServerThread(recording) as engine:
        deployment = deploy(engine.url)
        key = engine_keys.issue()
        node = deployment.node
        node.engine_key_sealed = engine_keys.seal(key)
        node.save(update_fields=["engine_key_sealed"])
        # A renter's request through /v1 first: what an engine sees of real traffic.
        sdk = openai.OpenAI(base_url=v1, api_key=carol_key, max_retries=0, timeout=60)
        for _ in sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                max_tokens=40, stream=True):
            pass
        settled()
        charges, entries, holds = Charge.objects.count(), Entry.objects.count(), \
            Hold.objects.count()
        Deployment.objects.filter(pk=deployment.pk).update(
            next_check_at=timezone.now() - timedelta(seconds=1))
        assert checks.checks_run() == 1
    (renter_headers, renter_body), *sent = recording.seen
    assert len(sent) == checks.REQUESTS
    for headers, body in sent:
        # The same headers, with the node's engine key, and a body of the same shape.
        assert {k: v for k, v in headers.items() if k != "content-length"} == {
            k: v for k, v in renter_headers.items() if k != "content-length"}
        assert headers["authorization"] == f"Bearer {key}"
        assert set(body) == set(renter_body)
        assert body["stream_options"] == {"include_usage": True}
        assert body["messages"][0]["content"] in checks.PROMPTS
    # Nobody pays: no charge, hold or ledger entry more than the renter's.
    assert (Charge.objects.count(), Entry.objects.count(), Hold.objects.count()) == (
        charges, entries, holds)
    done = UnannouncedCheck.objects.get()
    assert (done.deployment_id, done.requests, done.errors) == (deployment.pk, 3, 0)
    assert done.tokens_per_s > 0 and done.ttft_ms is not None
    rows = RequestLog.objects.filter(endpoint="check")
    assert rows.count() == 3 and set(rows.values_list("user_id", flat=True)) == {None}
    # Counted as served traffic in the live figures, and in the card's history.
    served.served_figures_refresh()
    card = node.cards.get()
    card.refresh_from_db()
    assert card.served["models"][0]["hour"]["requests"] == 4  # the renter's and the check's
    ListingFactory(card=card)
    page = client.get(f"/cards/{card.pk}/").content.decode()
    assert 'id="checks"' in page and f"{done.tokens_per_s:.1f} tok/s" in page
