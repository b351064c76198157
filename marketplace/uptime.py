"""Reliability arithmetic from hourly heartbeat counts (no ORM)."""

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

HOUR_S = 3600


def hour_floor(moment: datetime) -> datetime:
    return moment.replace(minute=0, second=0, microsecond=0)


def credited_seconds(heartbeats: int, interval_s: int) -> int:
    """Each heartbeat vouches for one interval of uptime; an hour cannot hold more than an hour."""
    return min(heartbeats * interval_s, HOUR_S)


def reliability_pct(credited_s: int, window_s: float) -> Decimal:
    if window_s <= 0:
        return Decimal("0.00")
    share = min(Decimal(credited_s) / Decimal(window_s), Decimal(1))
    return (share * 100).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)


@dataclass(frozen=True)
class HourBar:
    hour: datetime
    pct: Decimal  # share of that hour covered by heartbeats


def hour_bars(counts: dict[datetime, int], *, start: datetime, end: datetime, interval_s: int,
              not_before: datetime) -> list[HourBar]:
    """One bar per hour in [start, end); the current hour is judged by the part that has passed,
    and hours before `not_before` (enrolment) are left out rather than shown as downtime."""
    bars = []
    hour = hour_floor(start)
    while hour < end:
        if hour + timedelta(hours=1) > not_before:
            span_start = max(hour, not_before)
            span_end = min(hour + timedelta(hours=1), end)
            span = (span_end - span_start).total_seconds()
            credited = credited_seconds(counts.get(hour, 0), interval_s)
            bars.append(HourBar(hour, reliability_pct(credited, span)))
        hour += timedelta(hours=1)
    return bars


def offline_seconds(changes: list[tuple[datetime, str]], *, status_at_start: str,
                    start: datetime, end: datetime) -> int:
    """Seconds of [start, end) during which the node was offline, given its status at `start`
    and its status changes (time, new status) after it, oldest first."""
    total = 0.0
    status, since = status_at_start, start
    for at, new_status in changes:
        if at >= end:
            break
        if at <= start:
            status = new_status
            continue
        if status == "offline":
            total += (at - since).total_seconds()
        status, since = new_status, at
    if status == "offline":
        total += (end - since).total_seconds()
    return int(total)
