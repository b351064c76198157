"""The usage journal: what an inference request delivered, kept where it outlives a PostgreSQL
outage and a server process that dies, until the request's settle has landed in the ledger.

Delivered tokens are billed exactly once, whatever fails in between:
- The proxy records a request's usage as it goes: at its first token, then every
  CHECKPOINT_S, and finally (`final`) before the response's last bytes leave. Then it
  settles and forgets the record.
- A settle that fails (the database away) leaves the final record. `drain` settles every
  final record once the database answers again: a Celery task every few seconds.
- A hold that expires is settled at its recorded usage. A record that is only a checkpoint
  is billed as estimated: the process died mid-stream. A hold is released only when nothing
  at all was recorded for it.
- Settle is idempotent by request id, so a record settled twice is billed once.

Records live in one Redis hash (Redis must persist: appendonly, docs/operations.md). When
Redis is away too, a record goes to a spool directory on the server's own disk. The server
process moves the spool back to Redis once Redis answers, as does `drain` on the same host.
Without REDIS_URL (the zero-setup demo), the spool is the journal.
"""

import itertools
import json
import logging
import os
import re
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from billing import metering
from billing.models import Hold
from config.redis import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

KEY = "rigshare:usage"  # request id -> the record's JSON
# Request id -> unix time: holds to give back whose request delivered nothing, but whose reserve
# or release could not be confirmed (the database went away in the middle of it).
RELEASES = "rigshare:usage:releases"
CHECKPOINT_S = 2.0  # a stream's usage is recorded at least this often while it runs
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Record:
    hold: metering.HoldInfo
    usage: metering.Usage
    worker: metering.Worker | None
    final: bool  # the request is over: this is all it delivered
    at: float  # unix time it was written

    def dumps(self) -> str:
        h, u, w = self.hold, self.usage, self.worker
        return json.dumps({
            "hold": [h.hold_id, h.request_id, h.amount_micros, h.user_id, h.price.price_id,
                     h.price.input_per_mtok, h.price.output_per_mtok],
            "usage": [u.prompt_tokens, u.completion_tokens, u.estimated],
            "worker": [w.provider_id, w.reference] if w else None,
            "final": self.final, "at": self.at}, separators=(",", ":"))

    @classmethod
    def loads(cls, text: str | bytes) -> "Record":
        data = json.loads(text)
        hold_id, request_id, amount, user_id, price_id, per_in, per_out = data["hold"]
        worker = data["worker"]
        return cls(metering.HoldInfo(hold_id, request_id, amount, user_id,
                                     metering.Price(price_id, per_in, per_out)),
                   metering.Usage(*data["usage"]),
                   metering.Worker(*worker) if worker else None, data["final"], data["at"])


# --- writing and forgetting (the request path, on routing.calls' journal threads) ---

def record(*, hold: metering.HoldInfo, usage: metering.Usage,
           worker: metering.Worker | None, final: bool) -> bool:
    """Keep the request's usage so far; False only if neither Redis nor the disk took it."""
    entry = Record(hold, usage, worker, final, time.time())
    text = entry.dumps()
    if settings.REDIS_URL:
        try:
            redis_client().hset(KEY, hold.request_id, text)
            if _spool.maybe_full:
                _spool_flush()
            return True
        except REDIS_ERRORS:
            log.warning("usage journal: Redis away, %s spooled to disk", hold.request_id)
    try:
        _spool_write(hold.request_id, text, sync=final)
        return True
    except OSError:
        log.exception("usage journal: %s recorded nowhere: %s", hold.request_id, text)
        return False


def forget(request_id: str) -> None:
    """The request is settled: its record goes. A record left behind is harmless (settling
    it again is a no-op), so a failure here is only logged."""
    if settings.REDIS_URL:
        try:
            redis_client().hdel(KEY, request_id)
        except REDIS_ERRORS:
            log.warning("usage journal: could not forget %s (Redis away)", request_id)
    if _spool.maybe_full or not settings.REDIS_URL:
        _spool_path(request_id).unlink(missing_ok=True)


def recorded(request_ids: list[str]) -> dict[str, Record]:
    """The records kept for these requests. Raises REDIS_ERRORS when Redis cannot say: the
    caller must then assume usage may exist."""
    found: dict[str, Record] = {}
    if settings.REDIS_URL and request_ids:
        texts = redis_client().hmget(KEY, request_ids)
        for request_id, text in zip(request_ids, texts, strict=True):
            if text is not None:
                found[request_id] = Record.loads(text)
    for request_id in request_ids:
        path = _spool_path(request_id)
        if request_id not in found and path.exists():
            try:
                found[request_id] = Record.loads(path.read_text())
            except (OSError, ValueError):
                log.exception("usage journal: unreadable spool file %s", path)
    return found


def release_later(request_id: str) -> None:
    """The request delivered nothing, and whether its hold exists or was given back is not
    known: `drain` gives it back once the database answers. Without Redis, the hold expires
    into a release (nothing is recorded for it) instead."""
    if not settings.REDIS_URL:
        return
    try:
        redis_client().hset(RELEASES, request_id, str(time.time()))
    except REDIS_ERRORS:
        log.warning("usage journal: Redis away; %s's hold is given back when it expires",
                    request_id)


# --- settling what was recorded (Celery) ---

def drain(*, limit: int = 5000) -> int:
    """Settle every final record; drop records whose hold is already closed (settled or
    released by the request itself). Returns how many requests it billed."""
    _spool_flush()
    _releases(limit)
    records = _all_records(limit)
    if not records:
        return 0
    status = dict(Hold.objects.filter(request_id__in=list(records))
                  .values_list("request_id", "status"))
    billed = 0
    for request_id, entry in records.items():
        state = status.get(request_id)
        if state == Hold.Status.PENDING and entry.final:
            billed += _settle(entry)
        elif state is None:
            log.error("usage journal: %s has no hold; its record is dropped: %s",
                      request_id, entry.dumps())
            forget(request_id)
        elif state != Hold.Status.PENDING:
            if state != Hold.Status.SETTLED and entry.usage.completion_tokens:
                log.error("usage journal: %s was %s with usage recorded: %s", request_id,
                          state, entry.dumps())
            forget(request_id)
    return billed


def _releases(limit: int) -> None:
    if not settings.REDIS_URL:
        return
    client = redis_client()
    pending = [field.decode() for field, _ in
               itertools.islice(client.hscan_iter(RELEASES, count=500), limit)]
    if not pending:
        return
    held = set(Hold.objects.filter(request_id__in=pending, status=Hold.Status.PENDING)
               .values_list("request_id", flat=True))
    for request_id in pending:
        if request_id in held and not recorded([request_id]):
            metering.release(request_id=request_id)
        # No hold (its reserve never committed), or already closed: nothing to give back.
        client.hdel(RELEASES, request_id)


def holds_expire(*, now: datetime | None = None) -> int:
    """Close holds whose request never settled (a crashed server, a database outage longer
    than the request): settled at the usage recorded for them, released only when nothing
    was. While the journal cannot be read, nothing expires."""
    now = now or timezone.now()
    due = list(Hold.objects.filter(status=Hold.Status.PENDING, expires_at__lte=now)
               .values_list("request_id", flat=True)[:1000])
    if not due:
        return 0
    try:
        records = recorded(due)
    except REDIS_ERRORS:
        log.warning("usage journal unreadable: %d expired holds wait for it", len(due))
        return 0
    closed = 0
    for request_id in due:
        entry = records.get(request_id)
        if entry is None:
            closed += metering.release(request_id=request_id, expired=True, now=now)
            continue
        if not entry.final:  # the server died mid-stream: what it had delivered by then
            entry = replace(entry, usage=replace(entry.usage, estimated=True))
        closed += _settle(entry, now=now)
    return closed


def _settle(entry: Record, now: datetime | None = None) -> int:
    try:
        metering.settle(hold=entry.hold, usage=entry.usage, worker=entry.worker, now=now)
    except metering.MeteringError:
        log.exception("usage journal: settle of %s refused; record dropped: %s",
                      entry.hold.request_id, entry.dumps())
    forget(entry.hold.request_id)
    return 1


def _all_records(limit: int) -> dict[str, Record]:
    found: dict[str, Record] = {}
    if settings.REDIS_URL:
        for request_id, text in redis_client().hscan_iter(KEY, count=500):
            found[request_id.decode()] = Record.loads(text)
            if len(found) >= limit:
                return found
    else:
        for path in _spool_dir().glob("*.json"):
            try:
                found[path.stem] = Record.loads(path.read_text())
            except (OSError, ValueError):
                continue
    return found


# --- the spool: records Redis could not take, on this host's disk ---

class _Spool:
    maybe_full = True  # this process has not looked yet (an earlier one may have spooled)


_spool = _Spool()


def _spool_dir() -> Path:
    return Path(settings.RIGSHARE_USAGE_SPOOL_DIR)


def _spool_path(request_id: str) -> Path:
    return _spool_dir() / f"{_SAFE.sub('_', request_id)}.json"


def _spool_write(request_id: str, text: str, *, sync: bool) -> None:
    directory = _spool_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = _spool_path(request_id)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    with open(temporary, "w") as out:
        out.write(text)
        if sync:
            out.flush()
            os.fsync(out.fileno())
    os.replace(temporary, path)
    _spool.maybe_full = True


def _spool_flush() -> None:
    """Move spooled records into Redis: a final record replaces whatever Redis holds for the
    request; a checkpoint never replaces anything (Redis may hold a later one)."""
    if not settings.REDIS_URL:
        return
    _spool.maybe_full = False
    directory = _spool_dir()
    if not directory.is_dir():
        return
    client = redis_client()
    for path in directory.glob("*.json"):
        try:
            text = path.read_text()
            entry = Record.loads(text)
        except (OSError, ValueError):
            continue
        try:
            if entry.final:
                client.hset(KEY, entry.hold.request_id, text)
            else:
                client.hsetnx(KEY, entry.hold.request_id, text)
        except REDIS_ERRORS:
            _spool.maybe_full = True
            return
        path.unlink(missing_ok=True)
