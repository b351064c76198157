"""Hooks for the apps above marketplace, which marketplace must not import. Only optional page
panels go through here; the agent protocol calls every app in plain sight (agentapi)."""

from django.dispatch import Signal

# Extra panels on a card's rent page: receivers get `card` and `user` and return
# {"template": ..., "context": {...}} or None.
card_page_panels = Signal()
# Extra panels on a renter's rental page: receivers get `rental` and `request` and return the
# same shape (routing's: the rented card as the renter's own endpoint).
rental_page_panels = Signal()
