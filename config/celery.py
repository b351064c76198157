import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("rigshare")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# The one schedule: Celery beat runs it in production; `manage.py run_schedule` runs the same
# entries in-process where there is no broker (the demo).
app.conf.beat_schedule = {
    "nodes-mark-offline": {"task": "marketplace.tasks.nodes_mark_offline", "schedule": 5.0},
    "heartbeats-flush": {"task": "marketplace.tasks.heartbeats_flush", "schedule": 5.0},
    "nodes-refresh-reliability": {
        "task": "marketplace.tasks.nodes_refresh_reliability", "schedule": 60.0},
    "rentals-end-due": {"task": "marketplace.tasks.rentals_end_due", "schedule": 15.0},
    "rentals-charge": {"task": "marketplace.tasks.rentals_charge", "schedule": 30.0},
    "holds-expire": {"task": "billing.tasks.holds_expire", "schedule": 60.0},
    "usage-drain": {"task": "billing.tasks.usage_drain", "schedule": 5.0},
    "ledger-check": {"task": "billing.tasks.ledger_check", "schedule": 3600.0},
    "verification-advance": {"task": "verification.tasks.verification_advance",
                             "schedule": 5.0},
    "deployments-check-health": {"task": "routing.tasks.deployments_check_health",
                                 "schedule": 10.0},
    "pool-changes-trim": {"task": "routing.tasks.pool_changes_trim", "schedule": 60.0},
    "served-figures-refresh": {"task": "routing.tasks.served_figures_refresh",
                               "schedule": 60.0},
    "checks-run": {"task": "routing.tasks.checks_run", "schedule": 60.0},
    "verification-sweep": {"task": "verification.tasks.verification_sweep", "schedule": 15.0},
    "verification-weekly": {"task": "verification.tasks.verification_weekly",
                            "schedule": 3600.0},
}
