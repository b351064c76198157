"""Thin Celery tasks for billing, scheduled in config/celery.py."""

import logging

from celery import shared_task

from billing import selectors, usage

log = logging.getLogger(__name__)


@shared_task(acks_late=True)
def holds_expire() -> int:
    return usage.holds_expire()


@shared_task(acks_late=True)
def usage_drain() -> int:
    return usage.drain()


@shared_task(acks_late=True)
def ledger_check() -> int:
    problems = selectors.ledger_problems()
    for problem in problems:
        log.error("ledger check: %s", problem)
    return len(problems)
