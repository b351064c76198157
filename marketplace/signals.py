"""Hooks for the apps above marketplace (verification, routing), which marketplace must not
import: they connect to these in their AppConfig.ready."""

from django.dispatch import Signal

# Sent after a heartbeat is stored, with node_id, first_report (the node's first heartbeat
# with GPUs) and hardware_changed. A receiver may return a list of jobs for the agent; the
# heartbeat reply carries them all.
heartbeat_recorded = Signal()

# Extra panels on a card's rent page: receivers get `card` and `user` and return
# {"template": ..., "context": {...}} or None.
card_page_panels = Signal()
