"""Geometry for the site's server-rendered SVG charts (no ORM, no JavaScript): cost and
earnings per day, a machine's hourly uptime, a card's cost per 1M tokens against its
utilization, and the rent page's verified figures (hardware against spec, tokens/s against
concurrency). Here, the lowest app with pages, so every page can use the one module."""

import math
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


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    title: str


def _path(points: Sequence[Point]) -> str:
    """An SVG path through the points in order: "M x,y L x,y ..."."""
    return " ".join(("M" if i == 0 else "L") + f"{p.x},{p.y}" for i, p in enumerate(points))


# --- a cost per 1M tokens against utilization (the break-even calculator) ---


@dataclass(frozen=True)
class Curve:
    label: str
    css: str
    path: str  # "M x,y L x,y ...": the points within the chart's height
    points: list[Point]
    key_y: float  # where its line and label stand in the key (top right)


@dataclass(frozen=True)
class Tick:
    at: float  # x for the utilization axis, y for the cost axis
    label: str


@dataclass(frozen=True)
class CostChart:
    width: int
    height: int
    left: int  # the plot's box
    top: int
    right: int
    bottom: int
    curves: list[Curve]
    x_ticks: list[Tick]
    y_ticks: list[Tick]
    line_y: float | None  # the API price's horizontal line
    line_label: str
    marks: list[Point]  # where a curve crosses it: the break-even points
    key_x: float  # the key's left edge: a sample of each curve's line, then its label


def cost_curve_chart(curves: Sequence[tuple[str, str, Sequence[tuple[float, int]]]], *,
                     line_micros: int | None, line_label: str = "",
                     marks: Sequence[tuple[str, float, int]] = (), fmt=str,
                     width: int = 600, height: int = 260) -> CostChart:
    """Cost per 1M tokens (y, micros) against utilization (x, 0..1) for each curve (label, css,
    points), the price to beat as a horizontal line, and a mark at each (label, utilization,
    cost). The cost grows without bound as utilization falls, so the axis stops at 2.5x the
    line or 1.25x the dearest curve's cost at full use, whichever is higher; a curve is drawn
    from its first point under that. `fmt` writes micros for people."""
    left, top, right, bottom = 64, 12, width - 12, height - 36
    at_full = [pts[-1][1] for _, _, pts in curves if pts]
    ceiling = max(2.5 * (line_micros or 0), 1.25 * max(at_full, default=0), 1)

    def x(u: float) -> float:
        return round(left + (right - left) * float(u), 1)

    def y(cost: float) -> float:
        return round(bottom - (bottom - top) * min(float(cost), ceiling) / ceiling, 1)

    drawn = []
    for n, (label, css, pts) in enumerate(curves):
        inside = [Point(x(u), y(c), f"{float(u):.0%} used: {fmt(c)} per 1M tokens ({label})")
                  for u, c in pts if c <= ceiling]
        drawn.append(Curve(label, css, _path(inside), inside, key_y=top + 8 + 16 * n))
    return CostChart(
        width=width, height=height, left=left, top=top, right=right, bottom=bottom,
        curves=drawn,
        x_ticks=[Tick(x(u / 100), f"{u}%") for u in (0, 25, 50, 75, 100)],
        y_ticks=[Tick(y(ceiling * k / 4), fmt(round(ceiling * k / 4))) for k in range(5)],
        line_y=y(line_micros) if line_micros else None, line_label=line_label,
        key_x=right - 210,
        marks=[Point(x(u), y(c), f"{label}: breaks even at {float(u):.0%} used, {fmt(c)} per "
                                 "1M tokens") for label, u, c in marks])


# --- the rent page's verified figures ---

@dataclass(frozen=True)
class HBar:
    label: str
    y: float
    measured_w: float
    spec_x: float | None  # where the spec's mark stands, None without a spec
    text: str
    css: str


@dataclass(frozen=True)
class HBarChart:
    width: int
    height: int
    label_w: int
    bars: list[HBar]


def measured_vs_spec(rows: list[tuple[str, float | None, float | None, str, str]], *,
                     width: int = 520, label_w: int = 150, row_h: int = 34) -> HBarChart:
    """rows: (label, measured, spec, unit, severity). Each bar is scaled to its own spec (or
    to its measurement when there is none), so GB/s and TFLOPS sit in one chart."""
    span = width - label_w - 10
    bars = []
    for i, (label, measured, spec, unit, severity) in enumerate(rows):
        if measured is None:
            continue
        top = max(measured, spec or 0) * 1.05
        text = f"{measured:,.0f} {unit}" + (f" of {spec:,.0f} ({measured / spec:.0%})"
                                            if spec else "")
        bars.append(HBar(label, i * row_h + 4, round(span * measured / top, 1),
                         round(label_w + span * spec / top, 1) if spec else None, text,
                         severity))
    return HBarChart(width, max(len(bars), 1) * row_h + 8, label_w, bars)


@dataclass(frozen=True)
class LineChart:
    width: int
    height: int
    measured: list[Point]
    reference: list[Point]  # the expectation the serving finding stands on, by concurrency
    x_ticks: list[Point]
    y_max_label: str
    path: str
    reference_label: str = ""  # what the expectation is: peers, published figure, floor


def tokens_vs_concurrency(measured: dict[int, float], reference: dict[int, float],
                          reference_label: str = "", *, width: int = 520, height: int = 180,
                          pad: int = 36) -> LineChart:
    """Output tokens/s against concurrent requests; the x axis is log2 (1, 8, 32, 128)."""
    levels = sorted(set(measured) | set(reference))
    if not levels:
        return LineChart(width, height, [], [], [], "", "", reference_label)
    top = max([*measured.values(), *reference.values(), 1]) * 1.1
    lo, hi = math.log2(levels[0]), math.log2(levels[-1])

    def x(level):
        return round(pad + (width - 2 * pad) * ((math.log2(level) - lo) / (hi - lo)
                                                if hi > lo else 0.5), 1)

    def y(tps):
        return round(height - pad - (height - 2 * pad) * tps / top, 1)

    points = [Point(x(k), y(v), f"{v:,.0f} tok/s at {k}") for k, v in sorted(measured.items())]
    refs = [Point(x(k), y(v), f"expected {v:,.0f} tok/s at {k} ({reference_label})")
            for k, v in sorted(reference.items())]
    ticks = [Point(x(k), height - pad + 14, str(k)) for k in levels]
    return LineChart(width, height, points, refs, ticks, f"{top / 1.1:,.0f} tok/s",
                     _path(points), reference_label)
