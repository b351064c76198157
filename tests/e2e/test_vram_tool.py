"""/tools/vram in a browser: a renter asks whether the 27B runs at its full context, reads the
table, follows a card that fits and then the filtered catalog."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_renter_asks_what_fits_and_finds_a_card(page, live_server, screenshot_dir, bob):
    from playwright.sync_api import expect

    from tests.factories import NodeFactory, listed_card

    node = NodeFactory(owner=bob, name="rig-h200", region="us-east")
    h200 = listed_card(node=node, name="NVIDIA H200", memory_total_mib=143_771,
                       verification_status="verified", listing__price_per_hour_micros=3_000_000)
    pro = listed_card(node=NodeFactory(owner=bob, name="rig-pro", region="eu-central"),
                      name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                      memory_total_mib=97_887, listing__price_per_hour_micros=1_500_000)
    small = listed_card(node=NodeFactory(owner=bob, name="rig-4090"),
                        listing__price_per_hour_micros=400_000)

    page.goto("/")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="What fits").click()
    expect(page.get_by_role("heading", name="What fits on a card")).to_be_visible()

    form = page.locator("#vram-tool")
    form.get_by_label("Model").select_option(label="Qwen3.5-27B")
    form.get_by_label("Weights").select_option("bf16")
    form.get_by_label("Context (tokens)").fill("262144")
    form.get_by_role("button", name="Show").click()

    expect(page.get_by_role("heading", name="Qwen3.5-27B at 262,144 tokens, BF16 weights on "
                                            "vLLM")).to_be_visible()
    rows = page.locator("table.fits tbody tr")
    expect(rows).to_have_count(6)
    expect(page.locator('tr[data-mib="24564"] .verdict')).to_contain_text("Does not fit")
    expect(page.locator('tr[data-mib="143771"] .verdict')).to_contain_text("Fits")
    expect(page.locator(".fit-cards li")).to_have_count(2)  # the H200 and the PRO 6000
    expect(page.locator(f'.fit-cards li[data-card="{small.pk}"]')).to_have_count(0)
    page.screenshot(path=screenshot_dir / "tools-vram.png", full_page=True)

    # A bad context is said on the form, and no table pretends to answer it.
    form.get_by_label("Context (tokens)").fill("300000")
    form.get_by_role("button", name="Show").click()
    expect(page.get_by_role("alert")).to_contain_text("Qwen3.5-27B reads at most 262,144 tokens.")
    expect(page.locator("table.fits")).to_have_count(0)
    page.go_back()

    page.get_by_role("link", name="All 2 in the catalog").click()
    expect(page.locator("table.catalog tbody tr[data-card]")).to_have_count(2)
    expect(page.locator(".fit-note")).to_contain_text("run Qwen3.5-27B at 262,144 tokens")
    page.locator(f'tr[data-card="{h200.pk}"] td.gpu a').click()
    expect(page).to_have_url(f"{live_server.url}/cards/{h200.pk}/")
    assert pro.pk != h200.pk
