"""What every judgment shares: a finding, its severities and the thresholds. Pure."""

from dataclasses import dataclass, field

OK, WARNING, MISMATCH, NOT_MEASURED = "ok", "warning", "mismatch", "not_measured"

THRESHOLDS = {
    # measured / spec below these: mismatch, warning. Bandwidth: STREAM kernels reach 81-96% of
    # spec (FACTS.md), so 75% and 85%.
    "bandwidth": (0.75, 0.85),
    # Dense GEMMs reach ~70-80% of a datasheet's peak (a real H200 is expected at >= 600 of its
    # 989 TFLOPS), so 75/85% would flag honest datacenter cards: 60% and 70%.
    "compute": (0.60, 0.70),
    # measured tokens/s / the expectation of the best basis (peers, reference, calibrated
    # prediction): the provider's model and the platform's yardstick alike
    "serving": (0.70, 0.85),
    # usable VRAM / claimed or reported VRAM below this: mismatch (drivers keep ~2-5%)
    "vram": 0.85,
    # host<->device copy / what the reported link carries below this: mismatch
    "host_device": 0.5,
    # power limit / the spec's default limit below these: mismatch (a card capped to 3/4 of its
    # power cannot deliver what it is sold as), warning
    "power": (0.75, 0.9),
}


@dataclass(frozen=True)
class Finding:
    metric: str
    severity: str
    claimed: str
    expected: str
    measured: str  # "" when nothing was measured
    message: str
    basis: str = ""  # what `expected` stands on: spec, peers, reference, calibrated, ...
    details: dict = field(default_factory=dict, compare=False)


def ratio_severity(ratio: float, kind: str) -> str:
    mismatch, warning = THRESHOLDS[kind]
    return MISMATCH if ratio < mismatch else WARNING if ratio < warning else OK
