from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST, require_safe

from billing import charts
from billing.pricing import format_usd, format_usd_exact, micros_to_usd, usd_to_micros
from billing.selectors import wallet_balance
from marketplace import alerts, costs, earnings, model_data, modelmath, selectors, services
from marketplace.agent_wheel import agent_wheel
from marketplace.filters import CARD_SIZES, CatalogFilterForm, VramToolForm
from marketplace.forms import (
    BreakEvenForm,
    EngineOverrideForm,
    ListingForm,
    NodeForm,
    RentForm,
)
from marketplace.models import Card, Node, Rental
from marketplace.signals import card_page_panels, rental_page_panels

CATALOG_PAGE_SIZE = 25


def catalog(request):
    form = CatalogFilterForm(request.GET, strict=False)
    page = None
    if form.is_valid():
        page = selectors.catalog_page(form.filters(), sort=form.sort_name(),
                                      cursor=form.page_cursor(),
                                      size=CATALOG_PAGE_SIZE)
        _with_platform_prices(page.cards)
    query = request.GET.copy()
    query.pop("cursor", None)
    fit = getattr(form, "fit", None)
    return render(request, "marketplace/catalog.html", {
        "form": form, "page": page, "choices": selectors.catalog_choices(),
        "query": query.urlencode(), "known_models": model_data.known_models(),
        "fit_query": urlencode(fit.query()) if fit else "",
    }, status=200 if page is not None else 400)


def _with_platform_prices(cards) -> None:
    """Each card's `platform_price`: what the platform's API charges for the model it was
    measured with (None: no platform price), read for all of them at once."""
    prices = selectors.platform_prices({card.verified_model for card in cards})
    for card in cards:
        card.platform_price = prices.get(card.verified_model)


# /tools/vram lists this many of the cheapest listed cards that fit, and links to the rest.
TOOL_CARDS = 10


@require_safe
def vram_tool(request):
    """What fits: for a model, its weights and a context, each common card size's weights, KV
    cache, longest context and concurrent sequences, and the listed cards that run it. Public:
    it shows what the catalog shows to anyone."""
    form = VramToolForm(request.GET or VramToolForm.DEFAULTS)
    rows, page = [], None
    if form.is_valid():
        fit = form.fit
        rows = [(size, modelmath.plan(fit.arch, quantization=fit.quantization,
                                      context=fit.context, vram_bytes=size.mib * 2**20,
                                      engine=fit.engine))
                for size in CARD_SIZES]
        page = selectors.catalog_page({"min_vram_mib": fit.min_vram_mib}, sort="price",
                                      size=TOOL_CARDS)
    fit = getattr(form, "fit", None)
    return render(request, "marketplace/vram_tool.html", {
        "form": form, "rows": rows, "page": page, "fit": fit,
        "known_models": model_data.known_models(),
        "fit_query": urlencode(fit.query()) if fit else "",
        "layout": modelmath.vllm_layout(fit.arch, fit.engine)
        if fit and fit.engine.kind == "vllm" else None,
        "kv_per_token": modelmath.kv_bytes_per_token(
            fit.arch, modelmath.kv_element_bytes(fit.arch, fit.engine)) if fit else None,
        "gpu_memory_utilization_pct": round(100 * modelmath.GPU_MEMORY_UTILIZATION),
        "vllm_reserve": modelmath.ACTIVATION_RESERVE_BYTES,
        "llamacpp_reserve": modelmath.LLAMACPP_RESERVE_BYTES,
    }, status=200 if fit else 400)


def card_detail(request, card_id: int):
    try:
        card = selectors.card_for_rent_page(card_id)
    except Card.DoesNotExist:
        raise Http404("No such card.") from None
    listing = card.listing
    is_owner = request.user.is_authenticated and card.node.owner_id == request.user.pk
    if not listing.is_listed and not is_owner:
        raise Http404("This card is not for rent.")
    rental = selectors.card_active_rental(card.pk)
    my_rental = rental is not None and rental.renter_id == request.user.pk
    _with_platform_prices([card])
    bars = selectors.node_uptime_bars(card.node)
    panels = [panel for _, panel in card_page_panels.send(sender=Card, card=card,
                                                           user=request.user) if panel]
    return render(request, "marketplace/card_detail.html", {
        "card": card, "node": card.node, "listing": listing, "is_owner": is_owner,
        "rental": rental, "my_rental": my_rental,
        "low_balance": my_rental and selectors.balance_is_low(request.user, [rental]),
        "rent_form": RentForm(), "uptime_chart": charts.uptime_chart(bars),
        "uptime_bars": bars, "panels": panels,
    })


@login_required
@require_POST
def card_rent(request, card_id: int):
    form = RentForm(request.POST)
    if not form.is_valid():
        for errors in form.errors.values():
            for error in errors:
                messages.error(request, error)
        return redirect("marketplace:card_detail", card_id=card_id)
    try:
        rental = services.rental_start(renter=request.user, card_id=card_id,
                                       hours=form.hours_or_none(),
                                       accept_flagged=form.cleaned_data["accept_flagged"])
    except services.RentalRefused as exc:
        messages.error(request, str(exc))
        return redirect("marketplace:card_detail", card_id=card_id)
    messages.success(request, f"You are renting {rental.card.name}. Rental #{rental.pk} started.")
    return redirect("marketplace:rentals")


@login_required
def rentals(request):
    rows = list(selectors.rentals_of(request.user))
    active = [r for r in rows if r.is_active]
    return render(request, "marketplace/rentals.html", {
        "active": active, "past": [r for r in rows if not r.is_active],
        "balance_micros": wallet_balance(request.user.pk),
        "low_balance": selectors.balance_is_low(request.user, active),
    })


@login_required
def rental_detail(request, rental_id: int):
    """The renter's own rental: what it costs so far and, from the apps above, the card as
    the renter's dedicated endpoint. Nobody else's rental is found."""
    rental = get_object_or_404(selectors.rentals_of(request.user), pk=rental_id)
    panels = [panel for _, panel in rental_page_panels.send(sender=Rental, rental=rental,
                                                             request=request) if panel]
    return render(request, "marketplace/rental_detail.html", {
        "rental": rental, "card": rental.card, "node": rental.card.node, "panels": panels,
        "low_balance": rental.is_active and selectors.balance_is_low(request.user, [rental]),
    })


@login_required
@require_http_methods(["GET", "HEAD", "POST"])
def rental_stop(request, rental_id: int):
    """GET asks to confirm (with what the rental has cost so far); POST stops it."""
    if request.method != "POST":
        rental = get_object_or_404(selectors.rentals_of(request.user), pk=rental_id)
        if not rental.is_active:
            return redirect("marketplace:rental_detail", rental_id=rental.pk)
        return render(request, "marketplace/rental_stop.html", {"rental": rental})
    try:
        rental = services.rental_stop(rental_id=rental_id, renter=request.user)
    except Rental.DoesNotExist:
        raise Http404("No such rental.") from None
    messages.success(request, f"Rental #{rental.pk} stopped.")
    return redirect("marketplace:rentals")


# --- provider pages ---

@login_required
def provider_dashboard(request):
    nodes = list(selectors.provider_nodes(request.user))
    conflicts = selectors.open_uuid_conflicts([node.pk for node in nodes])
    cards = [card for node in nodes for card in node.cards.all()]
    usage = selectors.card_utilization(cards)
    hints = selectors.price_hints([card.name for card in cards], provider=request.user)
    earned = {row["node"].pk: row for row in earnings.provider_earnings(request.user)["by_machine"]
              if row["node"] is not None}
    _with_platform_prices(cards)
    for node in nodes:
        node.conflicts_held_elsewhere = [c for c in conflicts if c.node_id == node.pk]
        node.conflicts_held_here = [c for c in conflicts if c.incumbent_id == node.pk]
        node.earned = earned.get(node.pk)
        for card in node.cards.all():
            card.usage, card.price_hint = usage[card.pk], hints.get(card.name)
            card.owning = _owning_summary(card, usage[card.pk])
            listing = card.listing
            card.listing_form = ListingForm(prefix=f"card{card.pk}", initial={
                "is_listed": listing.is_listed,
                "price_per_hour": micros_to_usd(listing.price_per_hour_micros).normalize()
                if listing.price_per_hour_micros else None,
                "claimed_gpu_model": listing.claimed_gpu_model,
                "claimed_vram_gb": listing.claimed_vram_gb,
                "description": listing.description,
            })
    return render(request, "marketplace/provider_dashboard.html", {
        "nodes": nodes, "tokens": selectors.provider_enrolment_tokens(request.user)[:20],
        "alerts": list(request.user.provider_alerts.filter(read_at__isnull=True)
                       .select_related("node")[:5]),
        "offline_after_s": settings.RIGSHARE_HEARTBEAT_INTERVAL_S
        * settings.RIGSHARE_OFFLINE_AFTER_MISSED,
    })


@login_required
@require_POST
def machine_add(request):
    row, token = services.enrolment_token_create(owner=request.user)
    platform = settings.RIGSHARE_PUBLIC_URL or request.build_absolute_uri("/").rstrip("/")
    wheel = agent_wheel()
    url = platform + reverse("marketplace:agent_download", args=[wheel.filename])
    # Rendered in the POST's own response, never stored: reloading cannot show it again.
    return render(request, "marketplace/machine_add.html", {
        "token_row": row, "token": token, "platform": platform, "agent": wheel,
        # pip checks the download against the URL's #sha256= before installing anything.
        "install_command": f'pip install "{url}#sha256={wheel.sha256}"',
    })


@require_safe
def agent_download(request, filename: str):
    """The node agent's wheel, for anyone: it holds no secret, and the provider's machine that
    fetches it with pip has no session. Only the current version is served."""
    wheel = agent_wheel()
    if filename != wheel.filename:
        raise Http404("No such agent version.")
    response = HttpResponse(wheel.data, content_type="application/octet-stream")
    response["Content-Disposition"] = f'attachment; filename="{wheel.filename}"'
    response["ETag"] = f'"{wheel.sha256}"'
    # The same name may carry new bytes after an upgrade of the platform: always revalidate.
    response["Cache-Control"] = "no-cache"
    return response


@login_required
@require_POST
def enrolment_revoke(request, token_id: int):
    if services.enrolment_token_revoke(owner=request.user, token_id=token_id):
        messages.success(request, "Enrolment token revoked.")
    else:
        messages.error(request, "That token is not yours, or it is already used or revoked.")
    return redirect("marketplace:provider")


@login_required
def node_edit(request, node_id: int):
    node = get_object_or_404(Node, pk=node_id, owner=request.user)
    form = NodeForm(request.POST or None, instance=node)
    if request.method == "POST" and form.is_valid():
        services.node_update(owner=request.user, node_id=node.pk,
                             name=form.cleaned_data["name"], region=form.cleaned_data["region"])
        messages.success(request, "Machine updated.")
        return redirect("marketplace:provider")
    return _machine_page(request, node, form=form)


def _machine_page(request, node: Node, *, form=None, override_form=None, status: int = 200):
    """The provider's machine page: its name and region, and its engine configuration with
    the reasons, the command, and the overrides beside the computed values."""
    engine = selectors.node_engine(node)
    rows = {row.flag: row for row in engine.overrides}
    config = engine.config
    return render(request, "marketplace/node_edit.html", {
        "node": node, "form": form or NodeForm(instance=node), "engine": engine,
        "config": config, "process": selectors.node_engine_process(node),
        "flag_rows": [(flag, rows.get(flag.name)) for flag in config.flags] if config else [],
        "differences": [(flag, rows.get(flag.name)) for flag in config.differences()]
        if config else [],
        "override_form": override_form or EngineOverrideForm(engine=engine),
        "tls_required": settings.RIGSHARE_ENGINE_TLS_REQUIRED,
    }, status=status)


@login_required
@require_POST
def engine_override_set(request, node_id: int):
    """Set one flag of the node's engine command by hand; only its owner (staff: the admin)."""
    node = get_object_or_404(Node.objects.prefetch_related("cards"), pk=node_id,
                             owner=request.user)
    form = EngineOverrideForm(request.POST, engine=selectors.node_engine(node))
    if not form.is_valid():
        return _machine_page(request, node, override_form=form, status=400)
    try:
        services.engine_override_set(node_id=node.pk, owner=request.user, set_by=request.user,
                                     flag=form.cleaned_data["flag"],
                                     value=form.cleaned_data["value"],
                                     reason=form.cleaned_data["reason"])
    except services.MarketplaceError as exc:
        form.add_error("value", str(exc))
        return _machine_page(request, node, override_form=form, status=400)
    messages.success(request, f"{form.cleaned_data['flag']} set to "
                              f"{form.cleaned_data['value']} on {node.name}.")
    return redirect(reverse("marketplace:node_edit", args=[node.pk]) + "#engine")


@login_required
@require_POST
def engine_restart(request, node_id: int):
    """Ask the agent to restart the engine it runs; only the node's owner."""
    node = get_object_or_404(Node, pk=node_id, owner=request.user)
    if services.node_engine_restart_request(node_id=node.pk, owner=request.user):
        messages.success(request, "Restart asked: at its next heartbeat the agent drains the "
                                  "engine (the requests in flight finish) and restarts it.")
    else:
        messages.error(request, "This machine's agent does not run its engine: restart the "
                                "engine where you started it.")
    return redirect(reverse("marketplace:node_edit", args=[node.pk]) + "#engine-process")


@login_required
@require_POST
def engine_key_rotate(request, node_id: int):
    """Issue the machine a new engine key; only the node's owner."""
    node = get_object_or_404(Node, pk=node_id, owner=request.user)
    if services.node_engine_key_rotate(node_id=node.pk, owner=request.user):
        messages.success(request, "New engine key issued: the agent takes it at its next "
                                  "heartbeat. The platform goes on using the old key until "
                                  "the engine answers the new one.")
    return redirect(reverse("marketplace:node_edit", args=[node.pk]) + "#engine-key")


@login_required
@require_POST
def engine_override_clear(request, node_id: int):
    flag = request.POST.get("flag", "")
    get_object_or_404(Node, pk=node_id, owner=request.user)
    if services.engine_override_clear(node_id=node_id, owner=request.user, flag=flag):
        messages.success(request, f"{flag} is back to the computed value.")
    else:
        messages.error(request, f"{flag or 'That flag'} had no override on this machine.")
    return redirect(reverse("marketplace:node_edit", args=[node_id]) + "#engine")


@login_required
@require_POST
def node_revoke(request, node_id: int):
    if services.node_revoke(owner=request.user, node_id=node_id):
        messages.success(request, "Machine removed: its agent is refused from now on.")
    else:
        raise Http404("No such machine.")
    return redirect("marketplace:provider")


@login_required
@require_POST
def listing_update(request, card_id: int):
    card = get_object_or_404(Card, pk=card_id, node__owner=request.user)
    form = ListingForm(request.POST, prefix=f"card{card.pk}")
    if form.is_valid():
        data = form.cleaned_data
        try:
            services.listing_update(
                owner=request.user, card_id=card.pk, is_listed=data["is_listed"],
                price_per_hour_micros=usd_to_micros(data["price_per_hour"]),
                claimed_gpu_model=data["claimed_gpu_model"],
                claimed_vram_gb=data["claimed_vram_gb"], description=data["description"])
        except services.MarketplaceError as exc:
            messages.error(request, f"{card.name} #{card.number}: {exc}")
        else:
            messages.success(request, f"{card.name} #{card.number}: listing saved.")
    else:
        for field, errors in form.errors.items():
            label = form.fields[field].label if field in form.fields else ""
            for error in errors:
                messages.error(request, f"{card.name} #{card.number}: {label} {error}".strip())
    return redirect("marketplace:provider")


@login_required
@require_http_methods(["GET", "HEAD", "POST"])
def provider_alerts(request):
    """The provider's alerts, newest first; POST marks them all read."""
    if request.method == "POST":
        alerts.alerts_mark_read(owner=request.user)
        back = "dashboard" if request.POST.get("back") == "dashboard" else "alerts"
        return redirect("marketplace:provider" if back == "dashboard"
                        else "marketplace:provider_alerts")
    return render(request, "marketplace/provider_alerts.html", {
        "alerts": request.user.provider_alerts.select_related("node", "card")[:200]})


@login_required
def provider_earnings(request):
    data = earnings.provider_earnings(request.user)
    days = charts.days_ending(timezone.now().date(), 30)
    chart = charts.cost_per_day_chart(
        days, {r["day"]: r["total_micros"] for r in data["by_day"]}, fmt=format_usd)
    return render(request, "marketplace/provider_earnings.html", dict(data, chart=chart))


# --- what owning a card costs: the break-even calculator (docs/costs.md) ---

def _owning_summary(card: Card, usage: dict) -> dict | None:
    """The dashboard's line on owning the card, from the calculator's starting figures: where
    it breaks even serving at full concurrency against the platform's price, in the machine's
    country; None while a figure is missing (not verified yet, no list price)."""
    form = BreakEvenForm(_card_prefill(card, usage, card.platform_price))
    if not form.is_valid() or form.owning.api_micros_per_mtok is None:
        return None
    return {"country": costs.ELECTRICITY[form.cleaned_data["electricity"]].label,
            "break_even": costs.pct(form.owning.break_even())}


def _electricity_for(region: str) -> str:
    """The country whose average electricity price a machine starts from: its region's."""
    return "us" if region.lower().startswith("us") else costs.GERMANY.key


def _figure(value, places: int = 1) -> str:
    return "" if value is None else f"{round(value, places):g}"


def _calculator_prefill(*, single, loaded, concurrency, idle_w, loaded_w, gpu: str,
                        platform_price, price_micros, utilization, electricity: str) -> dict:
    """The calculator's fields as a GET form would carry them, from measured figures (None:
    not measured, left for the person to fill in)."""
    hardware = costs.LAUNCH_PRICES_USD.get(gpu)
    return {
        "tokens_per_s_single": _figure(single), "tokens_per_s_loaded": _figure(loaded),
        "concurrency": str(concurrency or 32), "idle_w": _figure(idle_w, 0),
        "loaded_w": _figure(loaded_w, 0), "system_w": str(costs.DEFAULT_SYSTEM_W),
        "electricity": electricity, "electricity_usd_per_kwh": "",
        "hardware_usd": "" if hardware is None else str(hardware),
        "amortization_months": str(costs.DEFAULT_AMORTIZATION_MONTHS),
        "api_usd_per_mtok": "" if platform_price is None else str(
            micros_to_usd(platform_price.output_micros_per_mtok).normalize()),
        "price_per_hour_usd": "" if not price_micros else str(
            micros_to_usd(price_micros).normalize()),
        "utilization_pct": "" if utilization is None or not price_micros
        else _figure(100 * utilization),
    }


def _card_prefill(card: Card, usage: dict, platform_price) -> dict:
    """A provider's card as the calculator starts from it: its own verified figures, its
    listing's price and the share of the last 30 days it was rented."""
    listing = getattr(card, "listing", None)
    return _calculator_prefill(
        single=card.verified_single_tokens_per_s, loaded=card.verified_tokens_per_s,
        concurrency=card.verified_concurrency, idle_w=card.power_idle_w,
        loaded_w=card.power_loaded_w, gpu=card.name, platform_price=platform_price,
        price_micros=listing.price_per_hour_micros if listing else None,
        utilization=usage["utilization_pct"] / 100, electricity=_electricity_for(
            card.node.region))


def _break_even_form(request, prefill: dict) -> tuple[BreakEvenForm, bool]:
    """The form bound to the prefilled figures, each one the request gives taken instead;
    and whether the request gave any (an error is then the person's to fix: a 400)."""
    asked = {name: value for name, value in request.GET.items()
             if name in BreakEvenForm.base_fields}
    return BreakEvenForm({**prefill, **asked}), bool(asked)


def _break_even_result(form: BreakEvenForm) -> dict:
    """What the page shows for a valid form: both ways of serving against the API price, per
    country, the curve as a chart and as a table, and a month of renting the card out."""
    owning = form.owning
    api = owning.api_micros_per_mtok
    full = f"{owning.concurrency} requests at once"
    ways = [(full, "loaded", False), ("one request at a time", "single", True)]
    curves = [(label, css, owning.curve(single=single)) for label, css, single in ways]
    marks = [(label, point, api) for label, _, single in ways
             if (point := owning.break_even(single=single)) is not None]
    keys = [*costs.ELECTRICITY, *(["custom"] if form.cleaned_data["electricity"] == "custom"
                                  else [])]
    places = []
    for key in keys:
        there = form.for_electricity(key)
        places.append({
            "label": costs.ELECTRICITY[key].label if key != "custom" else "Your price",
            "key": key, "micros_per_kwh": there.electricity_micros_per_kwh,
            "chosen": key == form.cleaned_data["electricity"],
            "loaded": costs.pct(there.break_even()),
            "single": costs.pct(there.break_even(single=True)),
            "full_loaded": there.cost_per_mtok(1), "full_single": there.cost_per_mtok(1, single=True),
        })
    return {
        "owning": owning, "full_label": full,
        "break_even": costs.pct(owning.break_even()),
        "break_even_single": costs.pct(owning.break_even(single=True)),
        "full_loaded": owning.cost_per_mtok(1), "full_single": owning.cost_per_mtok(1, single=True),
        "places": places,
        "chart": charts.cost_curve_chart(
            curves, line_micros=api, marks=marks, fmt=format_usd_exact,
            line_label=f"API price {format_usd_exact(api)} per 1M" if api else ""),
        "table": [(costs.pct(u), loaded, single) for (u, loaded), (_, single)
                  in zip(curves[0][2], curves[1][2], strict=True) if (u * 10).denominator == 1],
        "month": form.month(),
        "fixed_per_hour": costs.micros(owning.fixed_per_hour()),
    }


def _break_even_page(request, *, prefill: dict, context: dict, status: int = 200):
    form, asked = _break_even_form(request, prefill)
    result = _break_even_result(form) if form.is_valid() else None
    return render(request, "marketplace/break_even.html", {
        "form": form, "result": result, "asked": asked,
        "electricity": list(costs.ELECTRICITY.values()), "launch_prices": costs.LAUNCH_PRICES_USD,
        "system_w": costs.DEFAULT_SYSTEM_W, "months": costs.DEFAULT_AMORTIZATION_MONTHS,
        "fee_pct": settings.RIGSHARE_PLATFORM_FEE_BPS / 100, **context,
    }, status=400 if asked and not form.is_valid() else status)


@require_safe
def break_even_tool(request):
    """For someone deciding whether to buy a card: pick a GPU and the model it serves, and the
    calculator starts from the fleet's median verified figures for them. Public: the medians
    say nothing about any one provider."""
    offered = selectors.verified_gpu_models()
    gpu = request.GET.get("gpu") or (offered[0][0] if offered else "")
    model = request.GET.get("model") or next((m for g, m, _ in offered if g == gpu), "")
    figures = selectors.fleet_figures(gpu, model) if gpu and model else None
    price = selectors.platform_prices({model}).get(model) if figures else None
    prefill = _calculator_prefill(
        single=figures and figures.tokens_per_s_single,
        loaded=figures and figures.tokens_per_s_loaded,
        concurrency=figures and figures.concurrency, idle_w=figures and figures.power_idle_w,
        loaded_w=figures and figures.power_loaded_w, gpu=gpu, platform_price=price,
        price_micros=figures and figures.price_per_hour_micros,
        utilization=figures and figures.utilization, electricity=costs.GERMANY.key)
    picked = bool(request.GET.get("gpu") or request.GET.get("model"))
    return _break_even_page(request, prefill=prefill, context={
        "offered": offered, "gpus": sorted({name for name, _, _ in offered}), "gpu": gpu,
        "model": model, "figures": figures,
        "platform_price": price, "unknown_pick": picked and figures is None,
    }, status=400 if picked and figures is None else 200)


@login_required
@require_safe
def card_break_even(request, card_id: int):
    """The provider's own card: the calculator starts from its verified figures, its price
    and how much it was rented. Nobody else's card is found."""
    card = get_object_or_404(Card.objects.select_related("node", "listing"), pk=card_id,
                             node__owner=request.user)
    usage = selectors.card_utilization([card])[card.pk]
    price = selectors.platform_prices({card.verified_model}).get(card.verified_model)
    return _break_even_page(request, prefill=_card_prefill(card, usage, price), context={
        "card": card, "platform_price": price, "usage": usage,
    })
