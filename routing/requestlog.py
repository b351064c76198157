"""Request log rows, written off the request path: outcomes are buffered in memory and a task
on the event loop writes them in one INSERT per batch (every FLUSH_S, or sooner when BATCH
rows wait). A crash loses at most the last FLUSH_S of log rows, never money: charges are
written by settle itself."""

import asyncio
import logging
from datetime import timedelta

from django.db import transaction
from django.db.utils import DataError, IntegrityError
from django.utils import timezone

from routing import served
from routing.models import RequestLog

log = logging.getLogger(__name__)

FLUSH_S = 1.0
BATCH = 500
MAX_BUFFERED = 50_000  # a database that stays away must not eat the process's memory

_rows: list[dict] = []  # RequestLog fields
_wake: dict = {}  # event loop -> (Event, flusher task)
dropped = 0
writing = 0  # batches taken from the buffer and not yet written


def add(outcome, latency_s: float) -> None:
    global dropped
    if len(_rows) >= MAX_BUFFERED:
        dropped += 1
        return
    # Plain values here; the model instances are made in the writing thread (~0.1 ms each
    # on the event loop otherwise).
    _rows.append(dict(
        request_id=outcome.request_id,
        created_at=timezone.now() - timedelta(seconds=latency_s),
        user_id=outcome.user_id, api_key_id=outcome.key_id, endpoint=outcome.endpoint,
        model=_text(outcome.model, 200),
        deployment_id=outcome.worker.deployment_id if outcome.worker else None,
        stream=outcome.stream, status=outcome.status, error_code=_text(outcome.error_code, 64),
        attempts=outcome.attempts, prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens, estimated=outcome.estimated,
        ttft_ms=None if outcome.ttft_s is None else round(outcome.ttft_s * 1000, 3),
        latency_ms=round(latency_s * 1000, 3), concurrency=outcome.concurrency))
    loop = asyncio.get_running_loop()
    wake = _wake.get(loop)
    if wake is None or wake[1].done():
        event = asyncio.Event()
        wake = _wake[loop] = (event, loop.create_task(_flusher(event)))
    if len(_rows) >= BATCH:
        wake[0].set()


def _text(value: str, limit: int) -> str:
    """What PostgreSQL can hold of a client's string: no NUL, within the column."""
    return value.replace("\x00", "\ufffd")[:limit]


def write(rows: list[dict]) -> None:
    """One INSERT for the batch, and what it adds to its deployments' live figures
    (routing/served.py), in one transaction; if the database refuses a row of it, each row on
    its own, so a bad row never costs the others theirs. A database that is away fails the
    whole batch."""
    try:
        with transaction.atomic():
            RequestLog.objects.bulk_create([RequestLog(**row) for row in rows],
                                           batch_size=BATCH)
            served.traffic_record(rows)
        return
    except (DataError, IntegrityError):
        pass
    for row in rows:
        try:
            with transaction.atomic():
                RequestLog.objects.create(**row)
                served.traffic_record([row])
        except (DataError, IntegrityError) as exc:
            log.error("request log: row %s not written: %s", row.get("request_id"), exc)


async def flush() -> int:
    from routing import calls

    global writing
    if not _rows:
        return 0
    batch = _rows[:]
    del _rows[:len(batch)]
    writing += 1
    try:
        await calls.run(write, batch)
    except Exception:
        log.exception("request log: %d rows not written", len(batch))
        return 0
    finally:
        writing -= 1
    return len(batch)


async def _flusher(event: asyncio.Event) -> None:
    while True:
        try:
            await asyncio.wait_for(event.wait(), FLUSH_S)
        except TimeoutError:
            pass
        event.clear()
        await flush()
