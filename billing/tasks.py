"""Thin Celery tasks for billing, scheduled in config/celery.py."""

import logging

from celery import shared_task

from billing import metering, selectors

log = logging.getLogger(__name__)


@shared_task(acks_late=True)
def holds_expire() -> int:
    return metering.holds_expire()


@shared_task(acks_late=True)
def ledger_check() -> int:
    problems = selectors.ledger_problems()
    for problem in problems:
        log.error("ledger check: %s", problem)
    return len(problems)
