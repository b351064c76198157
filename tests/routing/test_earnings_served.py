"""A provider's token earnings, from requests served through the proxy: each machine's row
counts what its engine answered, and no served token lands in an unnamed row."""

import openai
import pytest
from django.test import Client

from billing.models import Charge
from marketplace.earnings import provider_earnings
from tests.routing.conftest import MODEL

pytestmark = pytest.mark.django_db(transaction=True)


def test_tokens_served_through_the_proxy_are_earned_by_the_machine_that_served_them(
        v1, engine, deploy, carol_key, bob, mallory, settled):
    pair = deploy(engine("2x-rtx-4090"), "2x-rtx-4090")  # one engine over two cards
    client = openai.OpenAI(base_url=v1, api_key=carol_key, max_retries=0, timeout=30)
    for i in range(3):
        client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": f"Question {i}"}])
    settled()
    charges = list(Charge.objects.all())
    assert len(charges) == 3 and {c.worker for c in charges} == {f"node:{pair.node_id}"}

    data = provider_earnings(bob)
    [machine] = data["by_machine"]
    assert machine["node"].pk == pair.node_id
    assert machine["requests"] == 3
    assert machine["token_micros"] == sum(c.provider_micros for c in charges) > 0
    assert machine["tokens"] == sum(c.prompt_tokens + c.completion_tokens for c in charges)
    assert [u["node"].pk for u in data["usage"]] == [pair.node_id]

    page = Client()
    page.force_login(bob)
    html = page.get("/provider/earnings/").content.decode()
    node = pair.node
    assert f"{node.name} <span class=\"muted\">(NVIDIA GeForce RTX 4090 #1, NVIDIA GeForce RTX 4090 #2)</span>" in html
    assert "no longer yours" not in html and "deployment:" not in html

    page.force_login(mallory)
    assert provider_earnings(mallory)["by_machine"] == []
    assert node.name not in page.get("/provider/earnings/").content.decode()
