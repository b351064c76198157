"""Geometry for the site's server-rendered SVG bar charts (no ORM, no JavaScript): cost and
earnings per day, and a machine's hourly uptime. Here, the lowest app, so every page can use
the one module."""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Protocol


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    title: str
    css: str = ""


@dataclass(frozen=True)
class BarChart:
    width: int
    height: int
    bars: list[Bar]
    first_label: str
    last_label: str
    max_label: str = ""


def days_ending(last: date, count: int) -> list[date]:
    return [last - timedelta(days=i) for i in range(count - 1, -1, -1)]


def cost_per_day_chart(days: list[date], cost_by_day: dict[date, int], *, fmt=str,
                       width: int = 600, height: int = 120) -> BarChart:
    """One bar per day, oldest on the left; heights scale to the most expensive day. A day with
    any cost gets a visible bar; a day without one gets none. `fmt` writes micros for people."""
    slot = width / max(len(days), 1)
    top = max((cost_by_day.get(d, 0) for d in days), default=0)
    bars = []
    for i, day in enumerate(days):
        cost = cost_by_day.get(day, 0)
        if cost <= 0 or top <= 0:
            continue
        h = max(cost * (height - 2) / top, 2)
        bars.append(Bar(x=round(i * slot + 1, 2), y=round(height - h, 2),
                        width=round(max(slot - 2, 1), 2), height=round(h, 2),
                        title=f"{day:%Y-%m-%d}: {fmt(cost)}"))
    return BarChart(width=width, height=height, bars=bars,
                    first_label=f"{days[0]:%b %d}" if days else "",
                    last_label=f"{days[-1]:%b %d}" if days else "",
                    max_label=fmt(top) if top > 0 else "")


class Hour(Protocol):
    hour: datetime
    pct: Decimal  # share of the hour the machine was up


def uptime_chart(bars: Sequence[Hour], *, slots: int = 48, width: int = 480,
                 height: int = 60) -> BarChart:
    """Hourly bars, height = share of the hour covered by heartbeats. Bars keep one width and
    end at the right edge ("now"), so a machine that joined an hour ago shows one thin bar."""
    slots = max(slots, len(bars), 1)
    slot = width / slots
    out = []
    for i, bar in enumerate(bars, start=slots - len(bars)):
        h = float(bar.pct) / 100 * (height - 2)
        css = "up" if bar.pct >= Decimal("99") else "partial" if bar.pct > 0 else "down"
        out.append(Bar(x=round(i * slot + 1, 2), y=round(height - max(h, 2), 2),
                       width=round(max(slot - 2, 1), 2), height=round(max(h, 2), 2), css=css,
                       title=f"{bar.hour:%Y-%m-%d %H:00} UTC: {bar.pct}% up"))
    return BarChart(width=width, height=height, bars=out, first_label=f"{slots} h ago",
                    last_label="now")
