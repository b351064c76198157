"""Routing's panel on a renter's rental page (marketplace cannot import routing)."""

from django.conf import settings
from django.dispatch import receiver

from marketplace.signals import rental_page_panels
from routing import selectors


@receiver(rental_page_panels)
def endpoint_panel(sender, *, rental, request, **kwargs):
    site = settings.RIGSHARE_PUBLIC_URL or request.build_absolute_uri("/").rstrip("/")
    return {"template": "routing/rental_endpoint.html",
            "context": selectors.rental_endpoint(rental, base_url=f"{site}/v1")}
