"""Measurements + reference spec + claims -> findings. Pure: no ORM, plain values in and out.

Every threshold lives in THRESHOLDS below, and every finding carries what was claimed, what was
expected, what was measured, and a sentence a renter understands.
"""

from dataclasses import dataclass, field

OK, WARNING, MISMATCH = "ok", "warning", "mismatch"

THRESHOLDS = {
    # measured / spec below these: mismatch, warning. Bandwidth: STREAM kernels reach 81-96% of
    # spec (FACTS.md), so 75% and 85%.
    "bandwidth": (0.75, 0.85),
    # Dense GEMMs reach ~70-80% of a datasheet's peak (a real H200 is expected at >= 600 of its
    # 989 TFLOPS), so 75/85% would flag honest datacenter cards: 60% and 70%.
    "compute": (0.60, 0.70),
    # measured tokens/s under load / what this hardware serves elsewhere (fleet reference)
    "serving": (0.70, 0.85),
    # usable VRAM / claimed or reported VRAM below this: mismatch (drivers keep ~2-5%)
    "vram": 0.85,
    # host<->device copy / what the reported link carries below this: mismatch
    "host_device": 0.5,
    # power limit / default limit below these: mismatch (a card capped to 3/4 of its power
    # cannot deliver what it is sold as), warning
    "power": (0.75, 0.9),
}
# Effective host<->device GB/s per PCIe lane by generation (~80% of the raw rate).
PCIE_GBS_PER_LANE = {1: 0.2, 2: 0.4, 3: 0.8, 4: 1.6, 5: 3.2, 6: 6.4}


@dataclass(frozen=True)
class Spec:
    name: str
    memory_gb: int
    bandwidth_gbs: int
    bf16_tflops: int | None
    pcie_gen: int | None
    compute_capability: str
    bus_width_bits: int | None
    sm_count: int | None
    nvml_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Evidence:
    """What is known of one card after a run."""

    reported_name: str
    reported_memory_mib: int | None
    claimed_model: str = ""
    claimed_vram_gb: int | None = None
    probe: dict | None = None  # this GPU's part of the agent's probe result
    wsl: bool = False
    other_nodes_with_uuid: tuple[int, ...] = ()
    # engine under load, for the node as a whole: concurrency -> output tokens/s
    served_tps: dict[int, float] = field(default_factory=dict)
    # what the same hardware and model serve in published fleet measurements (by concurrency)
    reference_tps: dict[int, float] = field(default_factory=dict)
    prefix_cache_speedup: float | None = None
    context_accepted: bool | None = None


@dataclass(frozen=True)
class Finding:
    metric: str
    severity: str
    claimed: str
    expected: str
    measured: str
    message: str


def spec_for(name: str, specs: list[Spec]) -> Spec | None:
    for spec in specs:
        if name in spec.nvml_names or name == spec.name:
            return spec
    return None


def _ratio_severity(ratio: float, kind: str) -> str:
    mismatch, warning = THRESHOLDS[kind]
    return MISMATCH if ratio < mismatch else WARNING if ratio < warning else OK


def _gb(mib: float) -> str:
    return f"{mib / 1024:.0f} GB"


def evaluate(ev: Evidence, spec: Spec | None, specs: list[Spec]) -> list[Finding]:
    probe = ev.probe or {}
    facts = probe.get("facts") or {}
    found = [_identity(ev, spec, specs, facts)]
    found += [_vram(ev, spec, probe), _bandwidth(spec, probe, facts), _compute(spec, probe)]
    found += [_pcie(spec, probe, facts), _power(facts), _virtualisation(ev, facts)]
    found += [_uuid(ev), _serving(ev), _prefix_cache(ev), _context(ev)]
    return [f for f in found if f is not None]


def _identity(ev: Evidence, spec: Spec | None, specs: list[Spec], facts: dict) -> Finding:
    if spec is None:
        return Finding("identity", OK, ev.claimed_model or ev.reported_name, "no reference spec",
                       ev.reported_name, f"Rigshare has no reference spec for the "
                       f"{ev.reported_name}: it is verified by measurement alone.")
    seen = {"compute capability": (facts.get("compute_capability_cuda"),
                                   spec.compute_capability),
            "SMs": (facts.get("sm_count"), spec.sm_count),
            "bus width": (facts.get("memory_bus_width_bits"), spec.bus_width_bits)}
    wrong = {k: (got, want) for k, (got, want) in seen.items()
             if got not in (None, "") and want not in (None, "") and str(got) != str(want)}
    claimed = ev.claimed_model or ev.reported_name
    if ev.claimed_model and spec_for(ev.claimed_model, specs) not in (None, spec):
        wrong["model"] = (ev.reported_name, ev.claimed_model)
    if not wrong:
        return Finding("identity", OK, claimed, spec.name, ev.reported_name,
                       f"The card is the {spec.name} it says it is (compute capability, SM "
                       "count and memory bus match).")
    cc, sms = facts.get("compute_capability_cuda"), facts.get("sm_count")
    looks_like = next((s.name for s in specs if s is not spec and s.compute_capability == cc
                       and (sms is None or s.sm_count == sms)), None)
    detail = ", ".join(f"{k} {got} (expected {want})" for k, (got, want) in wrong.items())
    guess = f" It behaves like an {looks_like}." if looks_like else ""
    return Finding("identity", MISMATCH, claimed, spec.name, detail,
                   f"Reports itself as an {spec.name}, but the GPU itself says otherwise: "
                   f"{detail}.{guess}")


def _vram(ev: Evidence, spec: Spec | None, probe: dict) -> Finding | None:
    vram = probe.get("vram")
    promised_mib = max(filter(None, [ev.reported_memory_mib,
                                     (ev.claimed_vram_gb or 0) * 1024]), default=None)
    claimed = f"{ev.claimed_vram_gb} GB" if ev.claimed_vram_gb else (
        _gb(ev.reported_memory_mib) if ev.reported_memory_mib else "")
    if not vram or promised_mib is None:
        return Finding("vram", OK, claimed, "", "not measured",
                       "Memory capacity was not tested on this hardware.")
    usable_mib = vram.get("free_bytes", 0) / 2**20
    if not vram.get("pattern_ok", True):
        return Finding("vram", MISMATCH, claimed, "pattern read back intact",
                       "pattern corrupted", "Memory returned different data than was written: "
                       "the card has memory errors.")
    if usable_mib < THRESHOLDS["vram"] * promised_mib:
        return Finding("vram", MISMATCH, claimed, _gb(promised_mib), _gb(usable_mib),
                       f"Promises {_gb(promised_mib)} of memory but only {_gb(usable_mib)} "
                       "could be allocated.")
    return Finding("vram", OK, claimed, _gb(promised_mib), _gb(usable_mib),
                   f"{_gb(usable_mib)} of memory allocated and checked.")


def _bandwidth(spec: Spec | None, probe: dict, facts: dict) -> Finding:
    measured = (probe.get("bandwidth") or {}).get("best_gbs")
    expected = spec.bandwidth_gbs if spec else facts.get("theoretical_bandwidth_gbs")
    basis = "spec" if spec else "the card's own memory clock and bus width"
    if not measured or not expected:
        return Finding("bandwidth", OK, "", f"{expected or '?'} GB/s", "not measured",
                       "Memory bandwidth was not measured on this hardware.")
    ratio = measured / expected
    severity = _ratio_severity(ratio, "bandwidth")
    text = {OK: f"Memory bandwidth {measured:,.0f} GB/s, {ratio:.0%} of {basis}: as expected.",
            WARNING: f"Memory bandwidth {measured:,.0f} GB/s is only {ratio:.0%} of {basis}.",
            MISMATCH: f"Memory bandwidth {measured:,.0f} GB/s is far below {basis} "
                      f"({expected:,.0f} GB/s): {ratio:.0%}."}[severity]
    return Finding("bandwidth", severity, "", f"{expected:,.0f} GB/s", f"{measured:,.0f} GB/s",
                   text)


def _compute(spec: Spec | None, probe: dict) -> Finding:
    measured = (probe.get("matmul") or {}).get("best_tflops")
    expected = spec.bf16_tflops if spec else None
    if not measured:
        return Finding("compute", OK, "", f"{expected or '?'} TFLOPS", "not measured",
                       "BF16 compute was not measured on this hardware.")
    if not expected:
        return Finding("compute", OK, "", "no reference", f"{measured:,.0f} TFLOPS",
                       f"BF16 matmul runs at {measured:,.0f} TFLOPS (no published figure to "
                       "compare with).")
    ratio = measured / expected
    severity = _ratio_severity(ratio, "compute")
    text = {OK: f"BF16 compute {measured:,.0f} TFLOPS, {ratio:.0%} of spec: as expected.",
            WARNING: f"BF16 compute {measured:,.0f} TFLOPS is only {ratio:.0%} of spec.",
            MISMATCH: f"BF16 compute {measured:,.0f} TFLOPS is far below spec "
                      f"({expected:,.0f}): {ratio:.0%}."}[severity]
    return Finding("compute", severity, "", f"{expected:,.0f} TFLOPS", f"{measured:,.0f} TFLOPS",
                   text)


def _pcie(spec: Spec | None, probe: dict, facts: dict) -> Finding | None:
    gen, width = facts.get("pcie_gen_max"), facts.get("pcie_width_max")
    if not gen or not width:
        return None
    capable = spec.pcie_gen if spec and spec.pcie_gen else gen
    link = f"Gen{gen} x{width}"
    expected = f"Gen{capable} x16"
    copy = probe.get("host_device") or {}
    h2d = copy.get("h2d_gbs")
    carries = PCIE_GBS_PER_LANE.get(gen, 0) * width
    if width <= 4 or (h2d and carries and h2d < THRESHOLDS["host_device"] * carries):
        measured = f"{link}, {h2d:.1f} GB/s" if h2d else link
        return Finding("pcie", MISMATCH, "", expected, measured,
                       f"The card sits on a {link} link ({measured}): loading models and "
                       "moving data will be very slow.")
    if gen < capable or width < 16:
        return Finding("pcie", WARNING, "", expected, link,
                       f"The card runs on a {link} link, below the {expected} it supports.")
    return Finding("pcie", OK, "", expected, link + (f", {h2d:.1f} GB/s" if h2d else ""),
                   f"PCIe {link} as the card supports.")


def _power(facts: dict) -> Finding | None:
    limit, default = facts.get("power_limit_w"), facts.get("power_default_limit_w")
    if not limit or not default:
        return None
    severity = _ratio_severity(limit / default, "power")
    if severity != OK:
        return Finding("power", severity, "", f"{default} W", f"{limit} W",
                       f"The power limit is set to {limit} W, below the card's default "
                       f"{default} W: it will run slower under load.")
    return Finding("power", OK, "", f"{default} W", f"{limit} W", "Power limit at default.")


def _virtualisation(ev: Evidence, facts: dict) -> Finding | None:
    mode = facts.get("virtualization_mode")
    if ev.wsl:
        return Finding("virtualisation", WARNING, "", "bare metal", "WSL2",
                       "Runs under Windows (WSL2), which has been seen to serve far slower "
                       "than the hardware allows.")
    if mode:
        kind = {1: "passthrough", 2: "vGPU"}.get(mode, f"mode {mode}")
        return Finding("virtualisation", WARNING, "", "bare metal", kind,
                       f"Runs virtualised ({kind}).")
    return None


def _uuid(ev: Evidence) -> Finding | None:
    if not ev.other_nodes_with_uuid:
        return None
    nodes = ", ".join(f"#{n}" for n in ev.other_nodes_with_uuid)
    return Finding("uuid", MISMATCH, "", "a UUID of its own", f"also on node {nodes}",
                   f"This GPU's UUID is also reported by node {nodes}: one GPU cannot be in "
                   "two machines, so at least one of them is spoofed.")


def _serving(ev: Evidence) -> Finding | None:
    common = sorted(set(ev.served_tps) & set(ev.reference_tps))
    if not common:
        return None
    level = max(common)
    served, reference = ev.served_tps[level], ev.reference_tps[level]
    ratio = served / reference
    severity = _ratio_severity(ratio, "serving")
    text = {OK: f"Serves {served:,.0f} tokens/s at {level} concurrent requests, "
                f"{ratio:.0%} of what this hardware serves elsewhere.",
            WARNING: f"Serves {served:,.0f} tokens/s at {level} concurrent requests, only "
                     f"{ratio:.0%} of what this hardware serves elsewhere.",
            MISMATCH: f"Serves far below what its hardware predicts: {served:,.0f} tokens/s at "
                      f"{level} concurrent requests where the same hardware serves "
                      f"{reference:,.0f} ({ratio:.0%})."}[severity]
    return Finding("serving", severity, "", f"{reference:,.0f} tok/s @{level}",
                   f"{served:,.0f} tok/s @{level}", text)


def _prefix_cache(ev: Evidence) -> Finding | None:
    if ev.prefix_cache_speedup is None:
        return None
    works = ev.prefix_cache_speedup >= 2
    return Finding("prefix_cache", OK if works else WARNING, "", "a repeated prefix is faster",
                   f"{ev.prefix_cache_speedup:.1f}x faster",
                   "Prefix caching works: a repeated long prompt starts much faster."
                   if works else "Prefix caching does not seem to work: a repeated long "
                   "prompt is no faster (follow-up turns will be slow).")


def _context(ev: Evidence) -> Finding | None:
    if ev.context_accepted is None:
        return None
    return Finding("context", OK if ev.context_accepted else MISMATCH, "",
                   "accepts its advertised context", "accepted" if ev.context_accepted
                   else "refused", "Accepts a request at its advertised context length."
                   if ev.context_accepted else "Refuses a request at the context length it "
                   "advertises.")


def verdict(findings: list[Finding]) -> str:
    """flagged when anything is a mismatch; verified otherwise (warnings are shown, not flags)."""
    return "flagged" if any(f.severity == MISMATCH for f in findings) else "verified"
