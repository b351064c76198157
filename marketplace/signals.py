"""Hooks for the apps above marketplace, which marketplace must not import. Only optional page
panels go through here; the agent protocol calls every app in plain sight (agentapi)."""

from django.dispatch import Signal

# Extra panels on a card's rent page: receivers get `card` and `user` and return
# {"template": ..., "context": {...}} or None.
card_page_panels = Signal()
