"""Verification's panel on the card's rent page (marketplace cannot import it)."""

from django.dispatch import receiver

from marketplace.signals import card_page_panels
from verification import selectors


@receiver(card_page_panels)
def verification_panel(sender, *, card, user, **kwargs):
    return {"template": "verification/panel.html",
            "context": selectors.card_panel(card, user)}
