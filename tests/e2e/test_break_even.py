"""/tools/break-even in a browser: someone deciding whether to buy an RTX 4090 starts from the
fleet's figures, changes the API price they compare against and sees the answer move; a figure
out of range is said on the form."""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_pages import _owned_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_a_buyer_changes_an_input_and_the_break_even_moves(page, live_server, alice, bob):
    from playwright.sync_api import expect

    _owned_fleet({"alice": alice, "bob": bob}, {})
    page.goto("/")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Break-even").click()
    expect(page.get_by_role("heading", name="When owning a GPU breaks even")).to_be_visible()
    expect(page.locator("#fleet-basis")).to_contain_text(
        "The medians of 3 verified NVIDIA GeForce RTX 4090 cards serving Qwen/Qwen3-27B")

    form = page.locator("#calculator")
    expect(form.get_by_label("Output tokens/s at full concurrency")).to_have_value("219")
    expect(form.get_by_label("API price to beat ($ per 1M output tokens)")).to_have_value("0.8")
    # Against the platform's $0.80 per 1M, at Germany's price (BDEW 2025): the 4090's $1,599
    # over 24 months and 65 W idle cost 119,198 micro-dollars an hour; serving adds 377 W
    # (162,002 an hour); busy all the time it earns $0.80 x 219 x 3,600 / 10^6 = 630,720:
    # 119,198 / (630,720 - 162,002) = 25.4%.
    expect(page.locator("#break-even")).to_have_text("25.4%")
    expect(page.locator("#break-even-single")).to_have_text("never")
    expect(page.locator("svg.cost-curve circle.break-even")).to_have_count(1)

    form.get_by_label("API price to beat ($ per 1M output tokens)").fill("2")
    form.get_by_role("button", name="Calculate").click()
    # 119,198 / (1,576,800 - 162,002) = 8.4%.
    expect(page.locator("#break-even")).to_have_text("8.4%")
    assert re.search(r"api_usd_per_mtok=2\b", page.url)  # a link that says what was asked

    # A question the form cannot answer is said on its field, and no answer pretends otherwise
    # (the browser itself refuses a negative figure: the fields say their bounds).
    form = page.locator("#calculator")
    expect(form.get_by_label("GPU power serving (W)")).to_have_attribute("min", "0")
    form.locator("select[name=electricity]").select_option("custom")
    form.get_by_role("button", name="Calculate").click()
    expect(page.locator('[data-field="electricity_usd_per_kwh"]')).to_contain_text(
        "Enter your price per kWh, or pick a country's average.")
    expect(page.locator("#result")).to_have_count(0)
    form = page.locator("#calculator")
    form.get_by_label("My electricity price ($/kWh)").fill("0")
    form.get_by_role("button", name="Calculate").click()
    # Free electricity leaves the hardware: 91,267 / 1,576,800 = 5.8%.
    expect(page.locator("#break-even")).to_have_text("5.8%")
