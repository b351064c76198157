"""Routing's hook into marketplace (which cannot import it)."""

from django.dispatch import receiver

from marketplace.signals import heartbeat_recorded
from routing import services


@receiver(heartbeat_recorded)
def sync_deployments(sender, *, node_id, **kwargs):
    services.deployments_sync(node_id=node_id)
    return []
