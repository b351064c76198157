from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from billing import charts as billing_charts
from billing.pricing import format_usd, micros_to_usd, usd_to_micros
from billing.selectors import wallet_balance
from marketplace import charts, earnings, selectors, services
from marketplace.filters import CatalogFilterForm
from marketplace.forms import ListingForm, NodeForm, RentForm
from marketplace.models import Card, Node, Rental
from marketplace.signals import card_page_panels

CATALOG_PAGE_SIZE = 25


def catalog(request):
    form = CatalogFilterForm(request.GET, strict=False)
    page = None
    if form.is_valid():
        cards = selectors.cards_for_catalog(form.filters())
        page = Paginator(cards, CATALOG_PAGE_SIZE).get_page(form.cleaned_data.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
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
                                       hours=form.hours_or_none())
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
@require_POST
def rental_stop(request, rental_id: int):
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
    for node in nodes:
        node.conflicts_held_elsewhere = [c for c in conflicts if c.node_id == node.pk]
        node.conflicts_held_here = [c for c in conflicts if c.incumbent_id == node.pk]
        for card in node.cards.all():
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
        "offline_after_s": settings.RIGSHARE_HEARTBEAT_INTERVAL_S
        * settings.RIGSHARE_OFFLINE_AFTER_MISSED,
    })


@login_required
@require_POST
def machine_add(request):
    row, token = services.enrolment_token_create(owner=request.user)
    platform = settings.RIGSHARE_PUBLIC_URL or request.build_absolute_uri("/").rstrip("/")
    # Rendered in the POST's own response, never stored: reloading cannot show it again.
    return render(request, "marketplace/machine_add.html", {
        "token_row": row, "token": token, "platform": platform,
    })


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
            messages.error(request, f"{card.name} #{card.index}: {exc}")
        else:
            messages.success(request, f"{card.name} #{card.index}: listing saved.")
    else:
        for field, errors in form.errors.items():
            label = form.fields[field].label if field in form.fields else ""
            for error in errors:
                messages.error(request, f"{card.name} #{card.index}: {label} {error}".strip())
    return redirect("marketplace:provider")


@login_required
def provider_earnings(request):
    data = earnings.provider_earnings(request.user)
    days = billing_charts.days_ending(timezone.now().date(), 30)
    chart = billing_charts.cost_per_day_chart(
        days, {r["day"]: r["total_micros"] for r in data["by_day"]}, fmt=format_usd)
    return render(request, "marketplace/provider_earnings.html", dict(data, chart=chart))
