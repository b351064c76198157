"""Thin Celery tasks: each calls one service. Scheduled in config/celery.py."""

from celery import shared_task

from marketplace import alerts, services


@shared_task(acks_late=True)
def nodes_mark_offline() -> int:
    return len(services.nodes_mark_offline())


@shared_task(acks_late=True)
def nodes_refresh_reliability() -> int:
    return len(services.nodes_refresh_reliability())


@shared_task(acks_late=True)
def rentals_end_due() -> int:
    return services.rentals_end_due()


@shared_task(acks_late=True)
def rentals_charge() -> int:
    return services.rentals_charge()


@shared_task(acks_late=True)
def heartbeats_flush() -> int:
    return services.heartbeats_flush()


@shared_task(acks_late=True, autoretry_for=(OSError,), retry_backoff=True, max_retries=5)
def alert_email(alert_id: int) -> bool:
    return alerts.alert_email_send(alert_id)
