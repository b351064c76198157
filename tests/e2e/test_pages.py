"""Every page of Rigshare in Chromium, at desktop width and on a 390 px phone: axe-core finds
no critical or serious accessibility violation, and the page never scrolls sideways.

PAGES is the one list of pages: a new page is one more line (its URL, who is logged in, the
data it needs from DATA). Phone and desktop screenshots of the pages that name one go to
docs/img/.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}
BLOCKING = ("critical", "serious")


@dataclass(frozen=True)
class Page:
    url: str  # formatted with what `needs` made: "/cards/{verified_card}/"
    user: str | None = None  # alice (renter), bob (provider), carol (API consumer), staff
    needs: tuple[str, ...] = ()  # names in DATA
    click: str | None = None  # a page reached by a form's POST: the button that posts it
    exclude: tuple[str, ...] = ()  # markup that is not Rigshare's own, left out of axe's run
    screenshot: str | None = None  # docs/img/<name>.png and <name>-phone.png
    ids: str = field(default="", compare=False)

    def __str__(self):
        return self.ids or f"{self.url} as {self.user or 'anonymous'}"


PAGES = [
    Page("/", None, ("verified_card", "flagged_card", "worker", "served_traffic"),
         screenshot="catalog"),
    Page("/?min_vram_gb=lots", None, ids="catalog with a refused filter"),
    Page("/cards/{verified_card}/", None, ("verified_card",)),
    Page("/cards/{verified_card}/", "alice", ("verified_card", "worker", "served_traffic"),
         screenshot="rent-page-served", ids="a card's rent page with its live figures"),
    Page("/cards/{flagged_card}/", "alice", ("flagged_card",),
         screenshot="verification-flagged"),
    Page("/accounts/login/"),
    Page("/accounts/signup/", screenshot="signup"),
    Page("/api/docs/", exclude=("#swagger-ui",)),
    Page("/rentals/", "alice", ("rentals",), screenshot="rentals"),
    Page("/rentals/{rentals}/", "alice", ("worker", "rentals"), screenshot="rental-endpoint"),
    Page("/rentals/{rentals}/stop/", "alice", ("rentals",), ids="stop a rental: confirm"),
    Page("/billing/", "alice", ("receipt", "payment_to_confirm"), screenshot="billing"),
    Page("/billing/transactions/", "alice", ("receipt",)),
    Page("/billing/payments/{receipt}/", "alice", ("receipt",)),
    Page("/billing/test-gateway/{payment_to_confirm}/", "alice", ("payment_to_confirm",)),
    Page("/provider/", "bob", ("verified_card", "flagged_card", "alerts", "worker",
                               "served_traffic"), screenshot="provider"),
    Page("/provider/alerts/", "bob", ("verified_card", "flagged_card", "alerts")),
    Page("/provider/", "bob", click="#add-machine", ids="add machine as bob"),
    Page("/provider/machines/{node}/", "bob", ("verified_card",)),
    Page("/provider/machines/{engine_node}/", "bob", ("engine_node",),
         screenshot="engine-config", ids="a machine's engine configuration with an override"),
    Page("/provider/earnings/", "bob", ("rentals",)),
    Page("/billing/payouts/", "bob"),
    Page("/billing/payouts/destination/", "bob", ("payout_destination",)),
    Page("/billing/keys/", "carol", ("api_key",)),
    Page("/billing/keys/{api_key}/", "carol", ("api_key",)),
    Page("/billing/usage/", "carol", ("api_key",)),
    Page("/accounts/tokens/", "carol"),
    Page("/accounts/password/reset/"),
    Page("/accounts/", "alice", screenshot="account"),
    Page("/accounts/", "bob", ids="account settings with two-factor on"),
    Page("/accounts/email/", "alice"),
    Page("/accounts/password/change/", "alice"),
    Page("/accounts/2fa/", "alice"),
    Page("/accounts/2fa/", "bob", ids="two-factor on"),
    Page("/accounts/2fa/totp/activate/", "alice", ids="password asked again before two-factor"),
    Page("/accounts/sessions/", "alice"),
    Page("/accounts/close/", "alice", ("receipt",)),
    Page("/staff/pool/", "staff", ("worker",)),
    Page("/models/", None, ("worker", "model_price", "served_traffic"), screenshot="models"),
    Page("/tools/vram?model=Qwen%2FQwen3.5-27B&context=262144&quant=bf16", None,
         ("verified_card",), ids="what fits"),
    Page("/tools/vram?model=Qwen%2FQwen3.5-27B&context=999999", None,
         ids="what fits with a refused context"),
    Page("/tools/break-even", None, ("owned_fleet",), screenshot="tools-break-even",
         ids="break-even from the fleet's medians"),
    Page("/tools/break-even?api_usd_per_mtok=-1&electricity=custom", None, ("owned_fleet",),
         ids="break-even with refused inputs"),
    Page("/tools/break-even", None, ids="break-even with no verified card"),
    Page("/provider/cards/{owned_fleet}/break-even", "bob", ("owned_fleet",),
         screenshot="provider-break-even", ids="break-even of a provider's card"),
    Page("/developers/", None),
    Page("/developers/", "carol", screenshot="developers"),
    Page("/activity/", "carol", ("worker", "model_price", "api_key", "activity"),
         screenshot="activity"),
    Page("/activity/?since=2026-11-20&until=2026-11-19", "carol",
         ids="activity with a refused filter"),
]


# What the pages need, made through the services where one exists. Each takes the users and
# what was made before it, and returns the value its name stands for in a URL.
def _node(users, made, *, flagged: bool):
    from marketplace import services as marketplace
    from marketplace.models import Card
    from tests.factories import CardFactory, ListingFactory, NodeFactory
    from verification.models import Finding, Measurement, VerificationRun

    node = NodeFactory(owner=users["bob"], name="rig-flagged" if flagged else "rig-1",
                       engine_url="http://127.0.0.1:9", engine_reachable=True,
                       engine_models=["Qwen/Qwen3-27B"], driver_version="580.65",
                       cuda_version="13.0", os="Ubuntu 24.04")
    card = CardFactory(node=node, index=0, name="NVIDIA H200", memory_total_mib=143771,
                       verification_status=(Card.Verification.FLAGGED if flagged
                                            else Card.Verification.VERIFIED),
                       verified_tokens_per_s=1342.0, reference_spec="H200")
    ListingFactory(card=card, price_per_hour_micros=3_000_000, claimed_vram_gb=141)
    marketplace.listing_costs_refresh(card_ids=[card.pk])  # as publishing the verdict does
    ListingFactory(card=CardFactory(node=node, index=1, name="NVIDIA H200",
                                    memory_total_mib=143771), is_listed=False)
    run = VerificationRun.objects.create(node=node, trigger="enrolment", status="done",
                                         finished_at=timezone.now(), model="Qwen/Qwen3-27B")
    for metric, value, unit in (("bandwidth_gbs", 2900.0 if flagged else 4210.0, "GB/s"),
                                ("bf16_tflops", 700.0, "TFLOPS"), ("h2d_gbs", 50.0, "GB/s")):
        Measurement.objects.create(run=run, card=card, metric=metric, value=value, unit=unit)
    for level, tps in ((1, 60.0), (8, 420.0), (32, 1342.0)):
        Measurement.objects.create(run=run, card=None, metric=f"tps@{level}", value=tps,
                                   unit="tok/s")
    findings = [("bandwidth", "mismatch" if flagged else "ok", "4,800 GB/s",
                 "2,900 GB/s" if flagged else "4,210 GB/s"),
                ("compute", "warning", "989 TFLOPS", "700 TFLOPS"),
                ("pcie", "not_measured", "", ""),
                ("serving", "ok", "1,300 tok/s", "1,342 tok/s")]
    for metric, severity, expected, measured in findings:
        Finding.objects.create(run=run, card=card, metric=metric, severity=severity,
                               expected=expected, measured=measured, basis="spec",
                               message=f"{metric}: {severity.replace('_', ' ')}")
    return card.pk


def _rentals(users, made):
    users["fund"](users["alice"])
    now = timezone.now()
    with transaction.atomic():
        return _rent(users, now, made)


def _rent(users, now, made):
    from marketplace import services as marketplace
    from tests.factories import listed_card

    past = listed_card(node__owner=users["bob"], node__name="rig-past")
    rental = marketplace.rental_start(renter=users["alice"], card_id=past.pk,
                                      now=now - timedelta(hours=2))
    marketplace.rental_stop(rental_id=rental.pk, renter=users["alice"],
                            now=now - timedelta(hours=1))
    # With a worker made, alice rents its card: her rental page shows the model it serves.
    if "worker" in made:
        from routing.models import Deployment

        node = Deployment.objects.get(pk=made["worker"]).node
        active = node.cards.get(listing__is_listed=True).pk
    else:
        active = listed_card(node__owner=users["bob"], node__name="rig-active").pk
    return marketplace.rental_start(renter=users["alice"], card_id=active).pk


def _payment(users, *, card_number: str) -> str:
    from billing import services as billing

    return billing.payment_create(user=users["alice"], amount_micros=20_000_000,
                                  idempotency_key=f"pages:{uuid.uuid4()}",
                                  card_number=card_number)


def _api_key(users, made):
    from billing.keys import api_key_create

    users["fund"](users["carol"])
    row, _ = api_key_create(user=users["carol"], name="laptop", requests_per_minute=600)
    api_key_create(user=users["carol"], name="ci", tokens_per_minute=100_000)
    return row.pk


def _worker(users, made):
    from routing.models import Deployment, EngineModel, Model
    from verification.models import VerificationRun, VerifiedCapacity

    node_card = made.get("verified_card") or _node(users, made, flagged=False)
    from marketplace.models import Card

    card = Card.objects.get(pk=node_card)
    model = Model.objects.create(name="qwen3-27b", context_length=32_768)
    EngineModel.objects.create(engine_model_id="Qwen/Qwen3-27B", model=model)
    run = VerificationRun.objects.filter(node=card.node).first()
    VerifiedCapacity.objects.create(card=card, model="Qwen/Qwen3-27B", tokens_per_s=1342.0,
                                    run=run)
    return Deployment.objects.create(node=card.node, engine_model_id="Qwen/Qwen3-27B",
                                     engine="vllm").pk


def _model_price(users, made):
    from billing.models import ModelPrice
    from routing.pool import POOL

    price = ModelPrice.objects.create(model="qwen3-27b", input_micros_per_mtok=200_000,
                                      output_micros_per_mtok=800_000,
                                      effective_at=timezone.now() - timedelta(days=1))
    POOL.invalidate()  # the live server's routers read the new price and worker now
    return price.pk


def _activity(users, made):
    """Carol's requests: served and charged, one estimated, one refused."""
    from billing.models import ApiKey
    from routing.models import Deployment
    from tests.routing.test_activity import request

    key = ApiKey.objects.get(pk=made["api_key"])
    deployment = Deployment.objects.get(pk=made["worker"])
    now = timezone.now()
    for i in range(5):
        request(key, now - timedelta(minutes=7 * i), deployment=deployment,
                prompt=800 + 97 * i, completion=120 + 31 * i, estimated=i == 3)
    request(key, now - timedelta(minutes=3), status=429, error_code="rate_limited",
            charged=False, prompt=0, completion=0, ttft_ms=None, latency_ms=2.1)
    return key.pk


def _served_traffic(users, made):
    """An hour and a day of traffic served by the worker (its card: the verified card), as the
    request log writes it, and the minute's refresh of the live figures."""
    from routing import requestlog, served

    now = timezone.now()
    rows = []
    for i in range(240):
        concurrency = (1, 6, 20)[i % 3]
        decode_s = 100 / (60.0, 52.0, 38.0)[i % 3]
        ttft_ms = (180.0, 260.0, 640.0)[i % 3] + (i % 7) * 20
        rows.append(dict(
            request_id=f"served-{i}", created_at=now - timedelta(minutes=(i * 5) % 1400),
            endpoint="chat", model="qwen3-27b", deployment_id=made["worker"], stream=True,
            status=502 if i % 97 == 5 else 200, attempts=1, prompt_tokens=900,
            completion_tokens=101, ttft_ms=ttft_ms, latency_ms=ttft_ms + decode_s * 1000,
            concurrency=concurrency))
    requestlog.write(rows)
    served.served_figures_refresh()
    return made["worker"]


def _alerts(users, made):
    """bob's flagged card and a machine of his that went offline and came back."""
    from marketplace import alerts
    from marketplace.models import Card

    flagged = Card.objects.select_related("node").get(pk=made["flagged_card"])
    alerts.card_flagged(card=flagged)
    alerts.nodes_offline(node_ids=[flagged.node_id])
    alerts.node_back(node=flagged.node)
    return flagged.pk


def _engine_node(users, made):
    """bob's 2x RTX 4090 serving the 27B at FP8 (fleetsim's 2x-rtx-4090), verified, with one
    flag he set by hand; its agent runs the engine (docs/agent-protocol.md, section 4)."""
    from django.utils import timezone

    from marketplace import services as marketplace
    from tests.factories import CardFactory, NodeFactory

    node = NodeFactory(owner=users["bob"], name="rig-pair", os="Linux 6.8.0-45-generic",
                       has_nvidia=True, engine_models=["Qwen/Qwen3-27B"],
                       engine_served=[{"id": "Qwen/Qwen3-27B", "engine": "vllm",
                                       "max_context": 65536, "quantization": "fp8"}],
                       engine_state="ready", engine_state_since=timezone.now(),
                       engine_process={
                           "state": "ready", "mode": "platform", "model": "Qwen/Qwen3-27B",
                           "quantization": "fp8", "pid": 48211, "exit_code": -9,
                           "restarts": 1, "restart_seen": 0, "error": None,
                           "argv": ["vllm", "serve", "Qwen/Qwen3-27B",
                                    "--tensor-parallel-size", "2", "--port", "8000",
                                    "--api-key", "***"],
                           "log_tail": ["INFO Starting vLLM API server on http://0.0.0.0:8000",
                                        "INFO Application startup complete."]})
    for index in range(2):
        CardFactory(node=node, index=index, bandwidth_gbs=905.0)
    marketplace.engine_override_set(node_id=node.pk, owner=users["bob"], set_by=users["bob"],
                                    flag="--max-num-seqs", value="24",
                                    reason="Long agent sessions: fewer at once, each faster")
    return node.pk


def _owned_fleet(users, made):
    """Three of bob's RTX 4090s serving the 27B, verified with their power draw (figures as
    fleetsim's rtx-4090 would measure), two listed, one rented for a while; the platform sells
    the model at $0.80 per 1M output tokens. The first card's id."""
    from billing.models import ModelPrice
    from marketplace import services as marketplace
    from routing.models import EngineModel, Model
    from tests.factories import CardFactory, ListingFactory, NodeFactory, RentalFactory

    model, _ = Model.objects.get_or_create(name="qwen3-27b",
                                           defaults={"context_length": 32_768})
    EngineModel.objects.get_or_create(engine_model_id="Qwen/Qwen3-27B",
                                      defaults={"model": model})
    if not ModelPrice.objects.filter(model="qwen3-27b").exists():
        ModelPrice.objects.create(model="qwen3-27b", input_micros_per_mtok=200_000,
                                  output_micros_per_mtok=800_000,
                                  effective_at=timezone.now() - timedelta(days=1))
    cards = []
    for i, (single, loaded, idle, busy, price) in enumerate((
            (88.0, 214.0, 25.0, 402.0, 450_000), (91.0, 219.0, 24.0, 405.0, 400_000),
            (90.0, 221.0, 26.0, 399.0, None))):
        card = CardFactory(node=NodeFactory(owner=users["bob"], name=f"rig-4090-{i + 1}",
                                            region="eu-central"),
                           first_seen_at=timezone.now() - timedelta(days=3))
        ListingFactory(card=card, is_listed=price is not None, price_per_hour_micros=price or 0)
        marketplace.card_verification_publish(
            card_id=card.pk, status="verified", tokens_per_s=loaded, reference_spec="RTX 4090",
            model="Qwen/Qwen3-27B", concurrency=32, single_tokens_per_s=single,
            power_idle_w=idle, power_loaded_w=busy)
        cards.append(card)
    RentalFactory(card=cards[0], renter=users["alice"], price_per_hour_micros=450_000,
                  started_at=timezone.now() - timedelta(hours=30),
                  stopped_at=timezone.now() - timedelta(hours=20))
    return cards[0].pk


def _payout_destination(users, made):
    from billing import services as billing

    return billing.payout_destination_set(
        provider=users["bob"], method="bank", holder_name="Bob Builder",
        iban="DE89 3704 0044 0532 0130 00", bic="COBADEFFXXX").pk


DATA = {
    "verified_card": lambda users, made: _node(users, made, flagged=False),
    "flagged_card": lambda users, made: _node(users, made, flagged=True),
    "node": None,  # the verified card's machine: see make_data
    "rentals": _rentals,
    "receipt": lambda users, made: _payment(users, card_number="4242424242424242").pk,
    "payment_to_confirm": lambda users, made: _payment(
        users, card_number="4000002500003155").gateway_ref,
    "api_key": _api_key,
    "worker": _worker,
    "model_price": _model_price,
    "activity": _activity,
    "alerts": _alerts,
    "served_traffic": _served_traffic,
    "payout_destination": _payout_destination,
    "engine_node": _engine_node,
    "owned_fleet": _owned_fleet,
}


def make_data(spec: Page, users) -> dict:
    from marketplace.models import Card

    made: dict = {}
    for name in spec.needs:
        made[name] = DATA[name](users, made)
    if "{node}" in spec.url:
        made["node"] = Card.objects.get(pk=made["verified_card"]).node_id
    return made


@pytest.fixture
def users(alice, bob, carol, fund, server_threads_closed):
    # server_threads_closed: the models page reads the routers' pool snapshot on routing.calls'
    # threads, whose connections must be closed before the test database is dropped.
    from tests.factories import UserFactory

    return {"alice": alice, "bob": bob, "carol": carol, "fund": fund,
            "staff": UserFactory(email="ops@example.com", is_staff=True, two_factor=True)}


def log_in(page, live_server, user) -> None:
    client = Client()
    client.force_login(user)
    page.context.add_cookies([{"name": "sessionid", "value": client.cookies["sessionid"].value,
                               "url": live_server.url}])


def open_page(page, spec: Page, url: str) -> None:
    response = page.goto(url)
    assert response is not None and response.status < 500, f"{url}: {response and response.status}"
    if spec.click:
        with page.expect_navigation():
            page.locator(spec.click).click()
    page.wait_for_load_state("load")


def blocking_violations(page, spec: Page) -> list[str]:
    from axe_playwright_python.sync_playwright import Axe

    context = {"exclude": [[selector] for selector in spec.exclude]} if spec.exclude else None
    results = Axe().run(page, context=context)
    return [f"{v['id']} ({v['impact']}): {v['help']}\n" + "\n".join(
                f"    {node['target']} {node['html'][:160]}" for node in v["nodes"][:8])
            for v in results.response["violations"] if v["impact"] in BLOCKING]


def horizontal_overflow(page) -> str | None:
    widths = page.evaluate("""() => ({page: document.documentElement.scrollWidth,
                                       viewport: window.innerWidth,
                                       wide: [...document.querySelectorAll('body *')]
                                         .filter(e => e.getBoundingClientRect().right
                                                      > window.innerWidth + 1
                                                      && !e.parentElement.closest('.table-scroll'))
                                         .slice(0, 5).map(e => e.outerHTML.slice(0, 120))})""")
    if widths["page"] <= widths["viewport"]:
        return None
    return f"{widths['page']} px wide in a {widths['viewport']} px viewport; wide: {widths['wide']}"


@pytest.mark.parametrize("spec", PAGES, ids=str)
def test_page_is_accessible_and_fits_a_phone(spec, page, live_server, users, screenshot_dir):
    from tests.e2e.conftest import VIEWPORT

    made = make_data(spec, users)
    url = spec.url.format(**made)
    if spec.user:
        log_in(page, live_server, users[spec.user])
    problems = []
    for viewport, suffix in ((VIEWPORT, ""), (PHONE, "-phone")):
        page.set_viewport_size(viewport)
        open_page(page, spec, url)
        width = f"{viewport['width']} px"
        problems += [f"[{width}] {v}" for v in blocking_violations(page, spec)]
        if (overflow := horizontal_overflow(page)) is not None:
            problems.append(f"[{width}] the page scrolls sideways: {overflow}")
        if spec.screenshot:
            page.screenshot(path=screenshot_dir / f"{spec.screenshot}{suffix}.png",
                            full_page=True)
    assert not problems, f"{spec}:\n" + "\n".join(problems)


def test_the_skip_link_comes_first_and_focus_is_visible(page, live_server):
    page.goto("/")
    page.keyboard.press("Tab")
    skip = page.locator(":focus")
    assert skip.inner_text() == "Skip to content"
    assert skip.evaluate("e => getComputedStyle(e).outlineStyle") == "solid"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    page.keyboard.press("Tab")  # the first link inside the page, with the site's focus ring
    ring = page.locator(":focus").evaluate(
        "e => [getComputedStyle(e).outlineStyle, getComputedStyle(e).outlineWidth]")
    assert ring == ["solid", "3px"]


def test_approve_and_not_now_stand_apart(page, live_server, users):
    made = make_data(Page("", needs=("payment_to_confirm",)), users)
    log_in(page, live_server, users["alice"])
    page.goto(f"/billing/test-gateway/{made['payment_to_confirm']}/")
    approve = page.locator("#approve").bounding_box()
    not_now = page.get_by_role("link", name="Not now").bounding_box()
    assert not_now["x"] - (approve["x"] + approve["width"]) >= 8


def test_opening_the_claims_keeps_the_dashboard_in_place(page, live_server, users):
    card = make_data(Page("", needs=("verified_card",)), users)["verified_card"]
    log_in(page, live_server, users["bob"])
    for viewport in (None, PHONE):
        if viewport:
            page.set_viewport_size(viewport)
        page.goto("/provider/")
        columns = page.locator(f"tr[data-card='{card}']").locator("xpath=../../thead//th")
        before = [columns.nth(i).bounding_box() for i in range(columns.count())]
        page_width = page.evaluate("document.documentElement.scrollWidth")
        page.locator(f"tr[data-card='{card}'] details.claims summary").click()
        expect_visible = page.locator(f"tr[data-card='{card}'] .claims-fields input").first
        assert expect_visible.is_visible()
        after = [columns.nth(i).bounding_box() for i in range(columns.count())]
        # (On a phone the click may scroll the table's region: compare from its first column.)
        assert ([(b["x"] - after[0]["x"], b["width"]) for b in after]
                == [(b["x"] - before[0]["x"], b["width"]) for b in before])
        assert page.evaluate("document.documentElement.scrollWidth") == page_width


def test_a_weak_password_shows_under_the_password_field(page, live_server):
    page.goto("/accounts/signup/")
    page.get_by_label("Email address").fill("dana@example.com")
    page.get_by_label("Password:", exact=True).fill("short")
    page.get_by_label("Password confirmation").fill("short")
    page.locator("main").get_by_role("button", name="Sign up").click()
    # Django writes a field's errors between its label and its input.
    error = page.get_by_text("This password is too short").bounding_box()
    password = page.locator("label[for=id_password1]").bounding_box()
    confirmation = page.locator("label[for=id_password2]").bounding_box()
    assert password["y"] < error["y"] < confirmation["y"]


def test_a_renter_sorts_by_served_speed_and_a_provider_opens_the_figures(page, live_server,
                                                                         users):
    made = make_data(Page("", needs=("verified_card", "flagged_card", "worker",
                                     "served_traffic")), users)
    page.goto("/")
    page.get_by_label("Sort").select_option("-served")
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url("**sort=-served**")
    first = page.locator("table.catalog tbody tr").first
    assert first.get_attribute("data-card") == str(made["verified_card"])
    assert "tok/s per stream" in first.locator("td.served").inner_text()
    page.locator(f"tr[data-card='{made['verified_card']}'] td.gpu a").click()
    served = page.locator("#served")
    assert served.locator("tr.window-total[data-window='hour']").is_visible()
    bands = served.locator("tr.band[data-window='hour'] td:nth-child(2)").all_inner_texts()
    assert bands == ["1", "2\u20138", "9\u201332"]

    log_in(page, live_server, users["bob"])
    page.goto("/provider/")
    details = page.locator("details.served-details[data-node]").filter(
        has_text="tok/s per stream")
    assert not details.locator("table.served").is_visible()
    details.locator("summary").click()
    assert details.locator("table.served").is_visible()
