"""Routing's answers to marketplace's hooks (marketplace cannot import routing): the panel on a
renter's rental page, the card's history of checks after verification on its rent page, and
the platform's price of the models cards were measured with."""

from django.conf import settings
from django.dispatch import receiver

from marketplace.signals import card_page_panels, platform_prices, rental_page_panels
from routing import selectors


@receiver(rental_page_panels)
def endpoint_panel(sender, *, rental, request, **kwargs):
    site = settings.RIGSHARE_PUBLIC_URL or request.build_absolute_uri("/").rstrip("/")
    return {"template": "routing/rental_endpoint.html",
            "context": selectors.rental_endpoint(rental, base_url=f"{site}/v1")}


@receiver(platform_prices)
def prices_of_engine_models(sender, *, engine_models, **kwargs):
    return selectors.platform_prices(engine_models)


@receiver(card_page_panels)
def checks_panel(sender, *, card, user, **kwargs):
    return {"template": "routing/checks_panel.html",
            "context": selectors.card_checks(card.node_id)}
