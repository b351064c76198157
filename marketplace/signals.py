"""Hooks for the apps above marketplace, which marketplace must not import. Only optional page
panels, and the platform's per-token price shown beside a card's cost, go through here; the
agent protocol calls every app in plain sight (agentapi)."""

from django.dispatch import Signal

# Extra panels on a card's rent page: receivers get `card` and `user` and return
# {"template": ..., "context": {...}} or None.
card_page_panels = Signal()
# Extra panels on a renter's rental page: receivers get `rental` and `request` and return the
# same shape (routing's: the rented card as the renter's own endpoint).
rental_page_panels = Signal()
# The platform's own per-token price of the models cards were measured with, beside each card's
# cost per 1M tokens: receivers get `engine_models` (a set of the model ids engines report) and
# return {engine model id: costs.PlatformPrice}. Which public model an engine id serves is
# routing's mapping; without an answer a card says "no platform price".
platform_prices = Signal()
