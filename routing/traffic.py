"""What served traffic says about a deployment: the arithmetic of the live figures. Pure: plain
values in, plain values out; routing/services.py reads and writes the rows.

Each /v1 request, as the request log writes it, adds to one bucket per time span (five minutes,
an hour) of its deployment and concurrency band: its count, its errors, and for a stream that
delivered enough tokens its decode time (first token to last) and its time to first token, in a
fixed histogram. A window's figures are sums of its buckets, so the figures of the last hour and
the last day are computed from a few dozen rows per deployment, never from the request log.

Decode speed is per stream and excludes the time to the first token: an engine that queues
requests because it is full delivers each running stream at the speed it has at its running
concurrency, and its queue shows in the TTFT, not in the decode speed. A request's band is the
platform's count of requests in flight to the deployment while it ran (the most it saw), so a
busy engine is judged at a concurrency at least as high as the one it ran at: never slower than
it is.
"""

from dataclasses import dataclass, field
from datetime import datetime, timedelta

FIVE_MINUTES = 300
HOUR = 3600
SPANS = (FIVE_MINUTES, HOUR)
# The figures' windows, and the span of bucket each is summed from.
WINDOWS = {"hour": (timedelta(hours=1), FIVE_MINUTES), "day": (timedelta(days=1), HOUR)}
# A stream counts for decode speed and TTFT only with this many completion tokens: the speed of
# two tokens is noise.
MIN_DECODE_TOKENS = 16
# Upper bounds (ms) of the TTFT histogram's bins; the last bin holds everything slower.
TTFT_BOUNDS_MS = (100, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000, 10000)
TTFT_BINS = len(TTFT_BOUNDS_MS) + 1
SUMS = ("requests", "errors", "streams", "decode_tokens", "decode_ms")
HIST = tuple(f"ttft_{i}" for i in range(TTFT_BINS))
COLUMNS = SUMS + HIST


def bands(levels) -> tuple[int, ...]:
    """The concurrency bands, by their lowest concurrency: one per level verification measures
    (1, 8, 32: bands 1, 2-8, 9-32) and one beyond the highest (33 and more)."""
    levels = sorted({int(x) for x in levels if int(x) >= 1}) or [1]
    return tuple([1] + [lo + 1 for lo in levels])


def band_of(concurrency: int, band_starts: tuple[int, ...]) -> int:
    concurrency = max(1, int(concurrency))
    return max(b for b in band_starts if b <= concurrency)


def band_top(band: int, band_starts: tuple[int, ...]) -> int | None:
    """The highest concurrency in a band; None for the last (open) one."""
    later = [b for b in band_starts if b > band]
    return min(later) - 1 if later else None


def band_label(band: int, band_starts: tuple[int, ...]) -> str:
    top = band_top(band, band_starts)
    if top is None:
        return f"{band}+"
    return str(band) if top == band else f"{band}\u2013{top}"


def ttft_bin(ttft_ms: float) -> int:
    for i, bound in enumerate(TTFT_BOUNDS_MS):
        if ttft_ms <= bound:
            return i
    return len(TTFT_BOUNDS_MS)


def bucket_start(moment: datetime, span_s: int) -> datetime:
    epoch = moment.timestamp()
    return datetime.fromtimestamp(epoch - epoch % span_s, tz=moment.tzinfo)


def is_error(status: int) -> bool:
    """A failure of the worker's: the platform's 5xx for it (unreachable, broke, timed out)."""
    return status >= 500


@dataclass(frozen=True)
class Served:
    """One request as the request log holds it, with what the figures need."""
    deployment_id: int
    at: datetime  # when it was sent
    status: int
    concurrency: int
    stream: bool
    completion_tokens: int
    ttft_ms: float | None
    latency_ms: float


def deltas(rows: list[Served], band_starts: tuple[int, ...]) -> dict[tuple, list[int | float]]:
    """What a batch of requests adds to each bucket: {(deployment, span, start, band): sums in
    COLUMNS' order}."""
    out: dict[tuple, list] = {}
    for row in rows:
        band = band_of(row.concurrency, band_starts)
        add = [1, int(is_error(row.status)), 0, 0, 0.0] + [0] * TTFT_BINS
        decoded = row.completion_tokens - 1
        if (row.stream and row.ttft_ms is not None and row.status == 200
                and row.completion_tokens >= MIN_DECODE_TOKENS
                and row.latency_ms > row.ttft_ms):
            add[2], add[3], add[4] = 1, decoded, row.latency_ms - row.ttft_ms
            add[len(SUMS) + ttft_bin(row.ttft_ms)] = 1
        for span in SPANS:
            key = (row.deployment_id, span, bucket_start(row.at, span), band)
            have = out.get(key)
            out[key] = add[:] if have is None else [a + b for a, b in zip(have, add, strict=True)]
    return out


@dataclass
class Sums:
    """A window's sums for one band (or all bands together)."""
    requests: int = 0
    errors: int = 0
    streams: int = 0
    decode_tokens: int = 0
    decode_ms: float = 0.0
    hist: list[int] = field(default_factory=lambda: [0] * TTFT_BINS)

    def add(self, values) -> None:
        """`values` in COLUMNS' order."""
        self.requests += int(values[0])
        self.errors += int(values[1])
        self.streams += int(values[2])
        self.decode_tokens += int(values[3])
        self.decode_ms += float(values[4])
        self.hist = [a + int(b) for a, b in zip(self.hist, values[len(SUMS):], strict=True)]

    def merge(self, other: "Sums") -> None:
        self.add([other.requests, other.errors, other.streams, other.decode_tokens,
                  other.decode_ms, *other.hist])

    @property
    def tokens_per_s(self) -> float | None:
        """Decode tokens/s per stream, weighted by tokens."""
        return self.decode_tokens / (self.decode_ms / 1000) if self.decode_ms > 0 else None

    def ttft_ms(self, share: float) -> float | None:
        return percentile(self.hist, share)

    def figures(self) -> dict:
        tps, p50, p95 = self.tokens_per_s, self.ttft_ms(0.5), self.ttft_ms(0.95)
        return {"requests": self.requests, "errors": self.errors, "streams": self.streams,
                "error_pct": round(100 * self.errors / self.requests, 2) if self.requests
                else None,
                "tokens_per_s": None if tps is None else round(tps, 1),
                "ttft_p50_ms": None if p50 is None else round(p50),
                "ttft_p95_ms": None if p95 is None else round(p95)}


def percentile(hist: list[int], share: float) -> float | None:
    """The `share` quantile of the histogram: linear within its bin (the first bin from 0, the
    open last bin reads as its lower bound twice over at most)."""
    total = sum(hist)
    if total == 0:
        return None
    rank = share * total
    seen = 0
    for i, n in enumerate(hist):
        if n and seen + n >= rank:
            lo = TTFT_BOUNDS_MS[i - 1] if i > 0 else 0
            hi = TTFT_BOUNDS_MS[i] if i < len(TTFT_BOUNDS_MS) else lo * 2
            return lo + (hi - lo) * max(0.0, rank - seen) / n
        seen += n
    return float(TTFT_BOUNDS_MS[-1] * 2)


def window_figures(by_band: dict[int, Sums], band_starts: tuple[int, ...],
                   uptime_pct: float | None) -> dict:
    """A deployment's figures over one window: all traffic together, and per band."""
    total = Sums()
    for sums in by_band.values():
        total.merge(sums)
    return {**total.figures(), "uptime_pct": uptime_pct,
            "bands": [{"band": band, "label": band_label(band, band_starts),
                       **by_band[band].figures()} for band in sorted(by_band)]}


def uptime_pct(offline_s: float, window_s: float) -> float:
    return round(100 * max(0.0, 1 - offline_s / window_s), 2) if window_s > 0 else 0.0
