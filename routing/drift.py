"""Drift: a deployment whose served traffic decodes far below the speed it was verified at.
Pure: plain values in, plain values out; routing/served.py reads the rows and calls
verification for what follows (verification.services.served_drift_open).

The traffic of each concurrency band is compared with the verified speed per stream at the
band's highest concurrency (the level verification measured), where each stream is slowest: a
card is never judged slower than its band allows. "Far below" is verification's own serving
threshold (verification.findings.THRESHOLDS), and it takes MIN_STREAMS timed streams within
WINDOW to say it. The open band beyond the highest level is never judged (nothing was verified
there), nor a band while the engine itself reports more requests running than the band holds
(traffic the platform does not see shares it).

The speed is read by the platform's proxy, so a platform starved of CPU or of network reads
every card slow at once. Where the slow deployments belong to most of the providers judged
(COMMON_CAUSE), the cause is the platform's side, and no one is blamed for it.
"""

from dataclasses import dataclass
from datetime import timedelta

from routing import traffic

WINDOW = timedelta(minutes=10)
MIN_STREAMS = 20
# (share, providers): more than this share of the providers whose traffic was judged, and at
# least this many, all slow in one window: a cause they share, the platform's own side.
COMMON_CAUSE = (0.5, 3)


@dataclass(frozen=True)
class Drift:
    deployment_id: int
    band: int
    level: int
    served_tps: float  # decode tokens/s per stream over the window
    verified_tps: float  # per stream at `level`, as verified
    streams: int

    @property
    def ratio(self) -> float:
        return self.served_tps / self.verified_tps


def find(recent: dict[int, dict[int, traffic.Sums]], verified: dict[int, dict[int, float]],
         band_starts: tuple[int, ...], *, threshold: float,
         engine_running: dict[int, int] | None = None,
         owners: dict[int, int] | None = None,
         min_streams: int = MIN_STREAMS) -> list[Drift]:
    """The worst drifting band of each deployment. `recent`: {deployment: {band: sums}} over
    WINDOW; `verified`: {deployment: {level: aggregate output tokens/s at that level}};
    `owners`: {deployment: its provider}, to tell a common cause (none found then)."""
    out, judged = [], set()
    for deployment_id, by_band in recent.items():
        levels = verified.get(deployment_id) or {}
        running = (engine_running or {}).get(deployment_id) or 0
        worst = None
        for band, sums in by_band.items():
            level = traffic.band_top(band, band_starts)
            speed = sums.tokens_per_s
            if (level is None or level not in levels or not levels[level]
                    or sums.streams < min_streams or speed is None or running > level):
                continue
            judged.add(deployment_id)
            drift = Drift(deployment_id, band, level, round(speed, 2),
                          round(levels[level] / level, 2), sums.streams)
            if drift.ratio < threshold and (worst is None or drift.ratio < worst.ratio):
                worst = drift
        if worst is not None:
            out.append(worst)
    if owners is not None:
        share, at_least = COMMON_CAUSE
        slow = {owners.get(d.deployment_id) for d in out}
        if len(slow) >= at_least and len(slow) > share * len({owners.get(d) for d in judged}):
            return []
    return out
