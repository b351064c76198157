"""Geometry for the rent page's server-rendered SVG charts (no ORM, no JavaScript)."""

from dataclasses import dataclass


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
class Point:
    x: float
    y: float
    label: str


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
    import math

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
    path = " ".join(("M" if i == 0 else "L") + f"{p.x},{p.y}" for i, p in enumerate(points))
    ticks = [Point(x(k), height - pad + 14, str(k)) for k in levels]
    return LineChart(width, height, points, refs, ticks, f"{top / 1.1:,.0f} tok/s", path,
                     reference_label)
