"""What renters see: the rent page's verification panel and the catalog's badges."""

import pytest

from billing.pricing import usd_to_micros
from marketplace import services as marketplace
from marketplace.models import Card, Listing
from tests.verification.conftest import YardstickAgent
from tests.verification.test_pipeline import (
    enrolled_node,
    h200_probe,
    h200_report,
    run_pipeline,
)
from verification import services

# The agent's heartbeats (the yardstick's switch) come from another thread.
pytestmark = pytest.mark.django_db(transaction=True)


def verified_card(owner, engine, probe, uuid="GPU-page-1", name=None):
    """A card of a machine whose agent runs its engine, verified: probes, load test, the
    yardstick and back, judged and published. `engine`: switching_h200's (url, engine)."""
    url, switching = engine
    report = h200_report(uuid=uuid, engine_url=url, reachable=True)
    report["engine"]["supervisor"] = {"state": "ready", "mode": "command", "argv": ["engine"]}
    if name:
        report["gpus"][0]["name"] = name
    node = enrolled_node(owner, report)
    card = Card.objects.get(node=node)
    marketplace.listing_update(owner=owner, card_id=card.pk, is_listed=True,
                               price_per_hour_micros=usd_to_micros(3), claimed_vram_gb=141)
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done", result=probe)
    agent = YardstickAgent(node.pk, switching, report)
    agent.start()
    try:
        run_pipeline(run)
    finally:
        agent.stop.set()
        agent.join()
    assert agent.failure is None, agent.failure
    card.refresh_from_db()
    return card


def test_rent_page_panel_shows_findings_charts_and_history(client, bob, switching_h200):
    card = verified_card(bob, switching_h200, h200_probe())
    html = client.get(f"/cards/{card.pk}/").content.decode()
    assert 'id="verification"' in html and "against the H200 spec" in html
    assert 'class="findings"' in html and 'data-metric="bandwidth"' in html
    assert "4,210 GB/s of 4,800 (88%)" in html  # the bar's label, measured against spec
    assert 'class="chart hw"' in html and 'class="chart tps"' in html
    assert "<circle class=\"measured\"" in html and "<circle class=\"reference\"" in html
    assert "History of runs" in html and "Enrolment" in html
    assert "verified capacity" in html and "tok/s for this card</strong> at 32 concurrent" in html
    assert "Output tokens/s of the whole machine against" in html  # one card: no share to say
    # Per basis, the figure it was judged against: its own model, and the yardstick.
    assert '<table class="bases" data-metric="serving">' in html
    assert '<table class="bases" data-metric="yardstick">' in html
    assert '<td class="judged"><strong>' in html and "<th scope=\"col\">Published</th>" in html


def test_a_flagged_card_is_flagged_on_the_page_and_in_the_catalog(client, bob, switching_h200):
    card = verified_card(bob, switching_h200, h200_probe(compute_capability_cuda="8.6",
                                                      sm_count=82))
    assert card.verification_status == "flagged"
    page = client.get(f"/cards/{card.pk}/").content.decode()
    assert "mismatch found" in page and 'class="finding mismatch"' in page
    catalog = client.get("/").content.decode()
    assert "⚑ mismatch found" in catalog
    assert client.get("/", {"verified": "1"}).context["page"].count == 0


def test_catalog_shows_and_sorts_by_verified_capacity(client, bob, switching_h200):
    card = verified_card(bob, switching_h200, h200_probe())
    other = Card.objects.create(node=card.node, index=5, name="NVIDIA H200", uuid="GPU-x",
                                memory_total_mib=143771, verified_tokens_per_s=1.0,
                                verification_status="verified", reference_spec="H200")
    Listing.objects.create(card=other, is_listed=True, price_per_hour_micros=1)
    page = client.get("/", {"sort": "-capacity"})
    ids = [c.pk for c in page.context["page"].cards]
    assert ids == [card.pk, other.pk]
    assert f"{card.verified_tokens_per_s:,.0f}" in page.content.decode()
    assert [c.pk for c in client.get("/", {"sort": "capacity"}).context["page"].cards] == [
        other.pk, card.pk]
    assert client.get("/api/cards/", {"sort": "-capacity"}).json()["count"] == 2


def test_progress_is_shown_while_a_run_is_under_way(client, bob):
    node = enrolled_node(bob, h200_report(uuid="GPU-progress"))
    card = Card.objects.get(node=node)
    marketplace.listing_update(owner=bob, card_id=card.pk, is_listed=True,
                               price_per_hour_micros=1_000_000)
    services.run_start(node_id=node.pk, trigger="enrolment")
    html = client.get(f"/cards/{card.pk}/").content.decode()
    assert 'id="verification-progress"' in html and "probing the hardware" in html
    assert "<progress" in html


def test_a_card_missing_from_the_spec_table_says_no_reference_spec(client, bob, switching_h200):
    card = verified_card(bob, switching_h200, h200_probe(), uuid="GPU-mystery",
                         name="NVIDIA B300 Prototype")
    assert card.verification_status == "verified" and card.reference_spec == ""
    assert card.verified_tokens_per_s > 0  # measured, never zero for want of a name
    assert "no reference spec" in client.get(f"/cards/{card.pk}/").content.decode()
    assert "no reference spec" in client.get("/").content.decode()


def test_checks_that_were_not_made_are_grey_and_the_card_only_serving_verified(
        client, bob, switching_h200):
    probe = {"device": "none", "gpus": [], "errors": [],
             "message": "no GPU: torch sees no CUDA device"}
    card = verified_card(bob, switching_h200, probe)
    assert card.verification_status == "serving_verified"
    html = client.get(f"/cards/{card.pk}/").content.decode()
    for metric in ("identity", "bandwidth", "compute", "vram"):
        assert f'<tr class="finding not_measured" data-metric="{metric}"' in html, metric
    assert "no GPU: torch sees no CUDA device" in html and "? TFLOPS" not in html
    assert 'id="serving-only"' in html and "serving verified" in html
    assert 'data-metric="serving" data-basis="reference"' in html
    assert 'id="serving-bases"' in html  # what serving is judged against, for renters
    assert 'class="chart hw"' not in html  # nothing measured: no bars against the spec
    catalog = client.get("/").content.decode()
    assert 'class="badge serving_verified"' in catalog
    assert client.get("/", {"verified": "1"}).context["page"].count == 0


@pytest.mark.parametrize("target, landing", [
    ("https://evil.example/phish", "/provider/"),
    ("//evil.example/phish", "/provider/"),
    ("/cards/1/", "/cards/1/"),
])
def test_reverify_goes_back_only_to_this_site(client, bob, target, landing):
    node = enrolled_node(bob, h200_report(uuid="GPU-redirect"))
    client.force_login(bob)
    response = client.post(f"/verification/nodes/{node.pk}/reverify/", {"next": target})
    assert response.status_code == 302 and response["Location"] == landing
