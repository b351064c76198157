"""Verification's hooks into marketplace (which cannot import it)."""

from django.db import transaction
from django.dispatch import receiver

from marketplace.signals import card_page_panels, heartbeat_recorded
from verification import selectors, services
from verification.models import VerificationRun


@receiver(heartbeat_recorded)
def start_and_hand_out_jobs(sender, *, node_id, first_report, hardware_changed, **kwargs):
    """A new node or changed hardware starts a run; pending probe jobs go in the reply."""
    if first_report or hardware_changed:
        trigger = (VerificationRun.Trigger.ENROLMENT if first_report
                   else VerificationRun.Trigger.HARDWARE_CHANGE)
        transaction.on_commit(lambda: services.run_start(node_id=node_id, trigger=trigger))
    return services.jobs_for_node(node_id)


@receiver(card_page_panels)
def verification_panel(sender, *, card, user, **kwargs):
    return {"template": "verification/panel.html",
            "context": selectors.card_panel(card, user)}
