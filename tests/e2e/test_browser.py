"""The whole marketplace in a browser: a provider brings a (simulated) machine, a renter rents it.

Bob signs up, adds a machine and starts `python -m fleetsim up` with the enrolment token the
page showed him; the real node agent enrols and heartbeats to the live server, the machine
appears on his dashboard and he lists its card. Alice signs up, filters the catalog, opens the
rent page, rents the card until she stops it, stops it, and the card is for rent again.
"""

from __future__ import annotations

import re
import time

import pytest

from agent import __version__ as agent_version
from fleetsim.profiles import get_profile

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PASSWORD = "correct horse battery staple"
PROFILE = "rtx-pro-6000"
# The agent heartbeats as soon as it starts; enrolment plus two Python start-ups fit well inside.
MACHINE_ONLINE_DEADLINE_S = 40


def test_provider_lists_a_machine_and_a_renter_rents_and_stops_it(page, live_server, fleet,
                                                                 screenshot_dir, gpu_specs):
    from playwright.sync_api import expect

    from marketplace.models import Card, Rental

    profile = get_profile(PROFILE)
    bob, alice = "bob@example.com", "alice@example.com"

    # 1. Bob signs up and asks for an enrolment token.
    sign_up(page, bob)
    page.goto("/provider/")
    expect(page.get_by_role("heading", name="My machines")).to_be_visible()
    page.locator("#add-machine").click()
    expect(page.get_by_role("heading", name="Add a machine")).to_be_visible()
    token = page.locator("#enrolment-token").inner_text().strip()
    assert re.fullmatch(r"rse_\S+_\S+", token), token
    expect(page.locator("#enroll-command")).to_have_text(
        f"python -m agent enroll --platform {live_server.url} --token {token}")
    expect(page.locator("#run-command")).to_contain_text("python -m agent run --engine-url")

    # Shown once: the dashboard lists the token by its prefix only, never the secret.
    page.goto("/provider/")
    expect(page.locator("table.tokens tbody tr[data-token]")).to_have_count(1)
    expect(page.locator("table.tokens .state")).to_have_text("active")
    expect(page.locator("#enrolment-token")).to_have_count(0)
    assert token not in page.content()
    page.reload()
    assert token not in page.content()

    # 2. The machine: an engine server plus the real agent, enrolled with that token.
    proc = fleet.start(platform=live_server.url, profile=PROFILE, token=token)

    # 3. Bob reloads his dashboard until the machine is online with its card.
    node_section = page.locator("section.node")
    deadline = time.monotonic() + MACHINE_ONLINE_DEADLINE_S
    while True:
        page.goto("/provider/")
        # Online with its card, and its engine (which the agent starts) serving its model.
        if (node_section.locator(".status.online").count()
                and node_section.locator("tr[data-card]").count()
                and profile.model in node_section.inner_text()):
            break
        if proc.poll() is not None:
            pytest.fail(f"fleetsim exited with status {proc.returncode}:\n{fleet.log()}")
        if time.monotonic() > deadline:
            pytest.fail(f"the machine was not online within {MACHINE_ONLINE_DEADLINE_S} s:\n"
                        f"{fleet.log()}")
        page.wait_for_timeout(250)
    expect(node_section).to_have_count(1)
    expect(node_section.locator(".status")).to_have_text("Online")
    expect(node_section).to_contain_text(f"agent {agent_version}")
    expect(node_section).to_contain_text(profile.model)
    expect(page.locator("table.tokens .state")).to_contain_text("used")

    row = node_section.locator("tr[data-card]")
    expect(row).to_have_count(profile.gpu_count)
    card_id = int(row.get_attribute("data-card"))
    card = Card.objects.get(pk=card_id)
    assert card.node.owner.email == bob
    assert "RTX PRO 6000" in card.name
    expect(row).to_contain_text("RTX PRO 6000")
    expect(row).to_contain_text(f"{profile.memory_total_mib} MiB")
    expect(row.locator("td.listed")).to_have_text("no")
    expect(row.locator("td.price")).to_have_text("—")

    row.locator("input[name$='price_per_hour']").fill("1.25")
    row.get_by_label("listed", exact=True).check()
    row.get_by_role("button", name="Save").click()
    expect(page.get_by_role("status").filter(has_text="listing saved")).to_be_visible()
    row = page.locator(f"tr[data-card='{card_id}']")
    expect(row.locator("td.listed")).to_have_text("yes")
    expect(row.locator("td.price")).to_have_text("$1.25/h")

    # Verification: the machine's first heartbeat started a run; the agent answers its probe
    # job on its own, then the beat task (run here) load-tests, evaluates and publishes.
    from verification import services as verification_services
    from verification import tasks as verification_tasks
    from verification.models import VerificationRun

    page.goto(f"/cards/{card_id}/")
    expect(page.locator("#verification-progress")).to_be_visible()
    deadline = time.monotonic() + MACHINE_ONLINE_DEADLINE_S
    while not (ready := verification_services.runs_ready_for_load_test()):
        if time.monotonic() > deadline:
            pytest.fail(f"the agent did not answer its probe job:\n{fleet.log()}")
        time.sleep(0.5)
    for run_id in ready:  # the chain the beat task would enqueue, run here
        verification_tasks.pipeline(run_id).apply()
    assert VerificationRun.objects.get(node=card.node).status == "done"
    page.reload()
    panel = page.locator("#verification")
    expect(panel.locator(".badge.verified").first).to_be_visible()
    expect(panel).to_contain_text("against the RTX PRO 6000 Blackwell spec")
    expect(panel.locator("tr.finding[data-metric='bandwidth']")).to_contain_text("GB/s")
    expect(panel.locator("svg.chart.hw rect")).to_have_count(3)
    expect(panel.locator("svg.chart.tps circle.measured")).to_have_count(3)

    log_out(page)

    # 4. Alice signs up and filters the catalog down to that card.
    sign_up(page, alice)
    # Rentals are prepaid: she buys $50 of credit with the gateway's test card.
    page.goto("/billing/")
    topup = page.locator("form#topup")
    topup.get_by_label("Amount (USD)").fill("50")
    topup.get_by_label("Card number").fill("4242 4242 4242 4242")
    topup.get_by_role("button", name="Pay").click()
    expect(page.get_by_text("$50.00").first).to_be_visible()
    page.goto("/")
    filters = page.locator("form#filters")
    filters.get_by_label("GPU model").select_option(label=card.name)
    filters.get_by_label("Max $/h").fill("2")
    filters.get_by_role("button", name="Apply").click()
    expect(page).to_have_url(re.compile(r"max_price=2"))
    catalog_rows = page.locator("table.catalog tbody tr[data-card]")
    expect(catalog_rows).to_have_count(1)
    expect(catalog_rows).to_have_attribute("data-card", str(card_id))
    expect(catalog_rows).to_contain_text("RTX PRO 6000")
    expect(catalog_rows).to_contain_text("$1.25/h")
    expect(page.locator("p.count")).to_have_text("1 card for rent")
    expect(filters.get_by_role("alert")).to_have_count(0)

    # A price cap below the card's price hides it.
    filters.get_by_label("Max $/h").fill("1")
    filters.get_by_role("button", name="Apply").click()
    expect(page.locator("p.count")).to_have_text("0 cards for rent")
    expect(catalog_rows).to_have_count(0)

    # A value that is not a number is refused visibly, not ignored.
    filters.get_by_label("Max $/h").fill("2")
    filters.get_by_label("Min VRAM (GB)").fill("lots")
    with page.expect_response(lambda r: "min_vram_gb=lots" in r.url) as bad:
        filters.get_by_role("button", name="Apply").click()
    assert bad.value.status == 400
    alert = page.get_by_role("alert")
    expect(alert).to_be_visible()
    expect(alert).to_contain_text("Min VRAM (GB)")
    expect(alert).to_contain_text("whole number")
    expect(page.locator("table.catalog")).to_have_count(0)
    expect(filters.get_by_label("Min VRAM (GB)")).to_have_value("lots")

    filters.get_by_role("link", name="Clear").click()
    expect(page).to_have_url(f"{live_server.url}/")
    expect(page.get_by_role("alert")).to_have_count(0)
    expect(filters.get_by_label("Min VRAM (GB)")).to_have_value("")
    expect(catalog_rows).to_have_count(1)
    expect(catalog_rows).to_have_attribute("data-card", str(card_id))

    # 5. The rent page: what the machine reported, what the provider claims, the uptime.
    catalog_rows.get_by_role("link", name="Rent").click()
    expect(page).to_have_url(f"{live_server.url}/cards/{card_id}/")
    expect(page.get_by_role("heading", level=1)).to_contain_text("RTX PRO 6000")
    expect(page.locator(".lead .price")).to_have_text("$1.25/h")
    expect(page.locator(".lead .status")).to_have_text("Online")
    expect(page.locator(".lead")).to_contain_text(re.compile(r"reliability \d+(\.\d+)?%"))

    expect(page.get_by_role("heading", name="Reported by the machine")).to_be_visible()
    expect(fact(page, "GPU")).to_have_text(card.name)
    expect(fact(page, "Memory")).to_have_text(
        f"{profile.memory_total_mib} MiB ({round(profile.memory_total_mib / 1024)} GB)")
    expect(fact(page, "Compute capability")).to_have_text(profile.compute_capability)
    expect(fact(page, "PCIe link")).to_have_text(
        f"Gen {profile.pcie_gen_current} x{profile.pcie_width_current} now, "
        f"Gen {profile.pcie_gen_max} x{profile.pcie_width_max} max")
    expect(fact(page, "Power limit")).to_have_text(f"{profile.power_limit_w} W")

    expect(page.get_by_role("heading", name="What the provider claims")).to_be_visible()
    # A renter sees who provides it, never their email.
    expect(fact(page, "Provider")).to_have_text(re.compile(r"^Provider #\d+$"))
    expect(page.get_by_text(bob)).to_have_count(0)

    expect(page.get_by_role("heading", name="Uptime, last 48 hours")).to_be_visible()
    expect(page.get_by_text("Reliability over the last 30 days")).to_contain_text("%")
    uptime = page.locator("svg.uptime")
    expect(uptime).to_be_visible()
    # The hour the machine joined in has heartbeats, so at least one bar is not "down".
    assert uptime.locator("rect.up, rect.partial").count() >= 1
    page.screenshot(path=screenshot_dir / "rent-page.png", full_page=True)

    # Alice rents it until she stops it.
    expect(page.get_by_label("Until I stop it")).to_be_checked()
    page.locator("#rent-button").click()
    expect(page).to_have_url(f"{live_server.url}/rentals/")
    expect(page.get_by_role("status").filter(has_text="You are renting")).to_be_visible()
    active = page.locator("table.rentals.active tbody tr[data-rental]")
    expect(active).to_have_count(1)
    expect(active).to_contain_text("RTX PRO 6000")
    expect(active).to_contain_text("until stopped")
    expect(active.locator("td.elapsed")).to_have_text(re.compile(r"^\d+ s$"))
    rental_id = int(active.get_attribute("data-rental"))
    expect(page.locator("table.rentals.past")).to_contain_text("None yet.")

    # While it is rented, nobody else finds it in the catalog.
    page.goto("/")
    expect(page.locator("p.count")).to_have_text("0 cards for rent")

    # Her rental's page: the card as her own endpoint.
    page.goto("/rentals/")
    active.get_by_role("link", name="RTX PRO 6000").click()
    expect(page).to_have_url(f"{live_server.url}/rentals/{rental_id}/")
    expect(page.get_by_role("heading", level=1)).to_contain_text(f"Rental #{rental_id}")
    endpoint = page.locator("section#endpoint")
    expect(endpoint.get_by_role("heading", name="Your endpoint")).to_be_visible()
    expect(endpoint).to_contain_text("pay no per-token price")
    expect(endpoint.locator("#endpoint-live")).to_be_visible()

    # Stopping asks first, then stops.
    page.get_by_role("link", name="Stop this rental…").click()
    expect(page.get_by_role("heading", level=1)).to_have_text(f"Stop rental #{rental_id}?")
    page.get_by_role("link", name="Keep it running").click()
    expect(page).to_have_url(f"{live_server.url}/rentals/{rental_id}/")
    assert Rental.objects.get(pk=rental_id).stopped_at is None
    page.goto("/rentals/")
    active.get_by_role("link", name="Stop…").click()
    page.get_by_role("button", name="Stop the rental").click()
    expect(page.get_by_role("status").filter(has_text=f"Rental #{rental_id} stopped")
           ).to_be_visible()
    expect(active).to_have_count(0)
    expect(page.locator("table.rentals.active")).to_contain_text("No active rentals")
    past = page.locator(f"table.rentals.past tbody tr[data-rental='{rental_id}']")
    expect(past).to_be_visible()
    expect(past).to_contain_text("stopped by the renter")

    rental = Rental.objects.get(pk=rental_id)
    assert rental.card_id == card_id
    assert rental.renter.email == alice
    assert rental.price_per_hour_micros == 1_250_000
    assert rental.ends_at is None
    assert rental.started_at is not None and rental.stopped_at is not None
    assert rental.stopped_at > rental.started_at
    assert rental.stop_reason == Rental.StopReason.REQUESTED
    # Charged by the second up to the stop, from the credit she bought.
    from billing import ledger, pricing
    from billing.models import Account

    assert rental.charged_until == rental.stopped_at
    assert rental.billed_seconds == int((rental.stopped_at - rental.started_at).total_seconds())
    assert rental.charged_micros == pricing.rental_due_micros(1_250_000, rental.billed_seconds)
    assert ledger.balance(Account.Kind.WALLET, rental.renter_id) == (
        50_000_000 - rental.charged_micros)

    # 6. The card is for rent again.
    page.goto("/")
    expect(catalog_rows).to_have_count(1)
    expect(catalog_rows).to_have_attribute("data-card", str(card_id))

    assert proc.poll() is None, f"fleetsim stopped during the test:\n{fleet.log()}"


def sign_up(page, email: str) -> None:
    from playwright.sync_api import expect

    page.goto("/accounts/signup/")
    page.get_by_label("Email address").fill(email)
    page.get_by_label("Password:", exact=True).fill(PASSWORD)
    page.get_by_label("Password confirmation").fill(PASSWORD)
    page.locator("main").get_by_role("button", name="Sign up").click()
    expect(page.get_by_role("status").filter(has_text="Welcome to Rigshare")).to_be_visible()
    expect(page.locator("header .who")).to_have_text(email)


def log_out(page) -> None:
    from playwright.sync_api import expect

    page.locator("header").get_by_role("button", name="Log out").click()
    expect(page.locator("header").get_by_role("link", name="Log in")).to_be_visible()
    expect(page.locator("header .who")).to_have_count(0)


def fact(page, term: str):
    """The <dd> that follows <dt>term</dt> in one of the rent page's fact lists."""
    return page.locator(f"dl.facts dt:text-is('{term}') + dd")

