from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST, require_safe

from billing import charts
from billing.pricing import format_usd, micros_to_usd, usd_to_micros
from billing.selectors import wallet_balance
from marketplace import alerts, earnings, selectors, services
from marketplace.agent_wheel import agent_wheel
from marketplace.filters import CatalogFilterForm
from marketplace.forms import ListingForm, NodeForm, RentForm
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
    query = request.GET.copy()
    query.pop("cursor", None)
    return render(request, "marketplace/catalog.html", {
        "form": form, "page": page, "choices": selectors.catalog_choices(),
        "query": query.urlencode(),
    }, status=200 if page is not None else 400)


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
    for node in nodes:
        node.conflicts_held_elsewhere = [c for c in conflicts if c.node_id == node.pk]
        node.conflicts_held_here = [c for c in conflicts if c.incumbent_id == node.pk]
        node.earned = earned.get(node.pk)
        for card in node.cards.all():
            card.usage, card.price_hint = usage[card.pk], hints.get(card.name)
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
    return render(request, "marketplace/node_edit.html", {"node": node, "form": form})


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
