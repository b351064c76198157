"""Geometry for server-rendered SVG charts (no ORM, no JavaScript)."""

from dataclasses import dataclass
from decimal import Decimal

from marketplace.uptime import HourBar


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    css: str
    title: str


@dataclass(frozen=True)
class BarChart:
    width: int
    height: int
    bars: list[Bar]
    first_label: str
    last_label: str


def uptime_chart(bars: list[HourBar], *, slots: int = 48, width: int = 480,
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
