"""What renters see: the rent page's verification panel and the catalog's badges."""

import pytest

from billing.pricing import usd_to_micros
from marketplace import services as marketplace
from marketplace.models import Card, Listing
from tests.verification.test_pipeline import (
    enrolled_node,
    h200_probe,
    h200_report,
    run_pipeline,
)
from verification import services

pytestmark = pytest.mark.django_db


def verified_card(owner, engine_url, probe, uuid="GPU-page-1"):
    node = enrolled_node(owner, h200_report(uuid=uuid, engine_url=engine_url, reachable=True))
    card = Card.objects.get(node=node)
    marketplace.listing_update(owner=owner, card_id=card.pk, is_listed=True,
                               price_per_hour_micros=usd_to_micros(3), claimed_vram_gb=141)
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done", result=probe)
    run_pipeline(run)
    card.refresh_from_db()
    return card


def test_rent_page_panel_shows_findings_charts_and_history(client, bob, h200_engine):
    card = verified_card(bob, h200_engine, h200_probe())
    html = client.get(f"/cards/{card.pk}/").content.decode()
    assert 'id="verification"' in html and "against the H200 spec" in html
    assert 'class="findings"' in html and 'data-metric="bandwidth"' in html
    assert "4,210 GB/s of 4,800 (88%)" in html  # the bar's label, measured against spec
    assert 'class="chart hw"' in html and 'class="chart tps"' in html
    assert "<circle class=\"measured\"" in html and "<circle class=\"reference\"" in html
    assert "History of runs" in html and "Enrolment" in html
    assert "verified capacity" in html and "tok/s for this card</strong> at 32 concurrent" in html
    assert "Output tokens/s of the whole machine against" in html  # one card: no share to say


def test_a_flagged_card_is_flagged_on_the_page_and_in_the_catalog(client, bob, h200_engine):
    card = verified_card(bob, h200_engine, h200_probe(compute_capability_cuda="8.6",
                                                      sm_count=82))
    assert card.verification_status == "flagged"
    page = client.get(f"/cards/{card.pk}/").content.decode()
    assert "mismatch found" in page and 'class="finding mismatch"' in page
    catalog = client.get("/").content.decode()
    assert "⚑ mismatch found" in catalog
    assert client.get("/", {"verified": "1"}).context["page"].count == 0


def test_catalog_shows_and_sorts_by_verified_capacity(client, bob, h200_engine):
    card = verified_card(bob, h200_engine, h200_probe())
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


def test_a_card_missing_from_the_spec_table_says_no_reference_spec(client, bob, h200_engine):
    probe = h200_probe()
    report = h200_report(uuid="GPU-mystery", engine_url=h200_engine, reachable=True)
    report["gpus"][0]["name"] = "NVIDIA B300 Prototype"
    node = enrolled_node(bob, report)
    card = Card.objects.get(node=node)
    marketplace.listing_update(owner=bob, card_id=card.pk, is_listed=True,
                               price_per_hour_micros=1_000_000)
    run = services.run_start(node_id=node.pk, trigger="enrolment")
    job = services.jobs_for_node(node.pk)[0]
    services.job_result_record(node_id=node.pk, job_id=job["id"], status="done", result=probe)
    run_pipeline(run)
    card.refresh_from_db()
    assert card.verification_status == "verified" and card.reference_spec == ""
    assert card.verified_tokens_per_s > 0  # measured, never zero for want of a name
    assert "no reference spec" in client.get(f"/cards/{card.pk}/").content.decode()
    assert "no reference spec" in client.get("/").content.decode()


def test_checks_that_were_not_made_are_grey_and_the_card_only_serving_verified(
        client, bob, h200_engine):
    probe = {"device": "none", "gpus": [], "errors": [],
             "message": "no GPU: torch sees no CUDA device"}
    card = verified_card(bob, h200_engine, probe)
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
