"""Measurements + reference spec + claims + fleet evidence -> findings. Pure: no ORM, plain values
in and out.

Every threshold lives in findings.THRESHOLDS. Every finding carries what was claimed, what was
expected, what was measured, and a sentence a renter understands. A check is `ok` only when
both sides of its comparison exist; with a side missing it is `not_measured`, with the reason.
Serving (the platform's yardstick and the provider's own model) is judged in serving.py.
"""

from dataclasses import dataclass, field

from verification import serving as judge
from verification.findings import (  # noqa: F401 (the names callers import from here)
    MISMATCH,
    NOT_MEASURED,
    OK,
    THRESHOLDS,
    WARNING,
    Finding,
    ratio_severity,
)
from verification.serving import Floor, Yardstick  # noqa: F401

# Effective host<->device GB/s per PCIe lane by generation (~80% of the raw rate).
PCIE_GBS_PER_LANE = {1: 0.2, 2: 0.4, 3: 0.8, 4: 1.6, 5: 3.2, 6: 6.4}
# The checks that measure the hardware itself: a card is "verified" only when one of them was
# made; with serving alone it is "serving verified".
HARDWARE_CHECKS = ("identity", "vram", "bandwidth", "compute")


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
    power_w: int | None = None

    @property
    def unified_memory(self) -> bool:
        """Apple Silicon: one memory for CPU and GPU, no CUDA, no NVML, no PCIe card."""
        return self.name.startswith("Apple ")


@dataclass(frozen=True)
class Evidence:
    """What is known of one card after a run."""

    reported_name: str
    reported_memory_mib: int | None
    claimed_model: str = ""
    claimed_vram_gb: int | None = None
    probe: dict | None = None  # this GPU's part of the agent's probe result
    probe_note: str = ""  # why there is no probe result, when there is none
    wsl: bool = False
    other_nodes_with_uuid: tuple[int, ...] = ()  # the nodes that hold this UUID before it
    uuid_repeated_on_node: bool = False  # two GPUs of this node report the same UUID
    # engine under load, for the node as a whole: concurrency -> output tokens/s
    served_tps: dict[int, float] = field(default_factory=dict)
    serving_note: str = ""  # why there is no load test, when there is none
    # the same GPU, count and model elsewhere in the fleet: concurrency -> peers' tokens/s
    peer_tps: dict[int, tuple[float, ...]] = field(default_factory=dict)
    peer_label: str = ""  # "RTX PRO 6000 Blackwell" or "2x RTX 4090"
    # what the same hardware and model serve in published fleet measurements (by concurrency)
    reference_tps: dict[int, float] = field(default_factory=dict)
    reference_label: str = ""
    # the first-principles prediction by concurrency, and what it was computed from
    predicted: dict[int, Floor] = field(default_factory=dict)
    prediction_note: str = ""
    prefix_cache_speedup: float | None = None
    context_accepted: bool | None = None
    # The agent runs the engine, so the platform can switch it to the yardstick and back.
    supervised: bool = False
    yardstick: Yardstick = field(default_factory=Yardstick)

    def model(self) -> judge.Model:
        return judge.Model(measured=self.served_tps, note=self.serving_note, peers=self.peer_tps,
                           peer_label=self.peer_label, reference=self.reference_tps,
                           reference_label=self.reference_label, predicted=self.predicted,
                           prediction_note=self.prediction_note, supervised=self.supervised)


def spec_for(name: str, specs: list[Spec]) -> Spec | None:
    for spec in specs:
        if name in spec.nvml_names or name == spec.name:
            return spec
    return None


def _gb(mib: float) -> str:
    return f"{mib / 1024:.0f} GB"


def evaluate(ev: Evidence, spec: Spec | None, specs: list[Spec]) -> list[Finding]:
    probe = ev.probe or {}
    facts = probe.get("facts") or {}
    found = [_identity(ev, spec, specs, facts)]
    found += [_vram(ev, spec, probe), _bandwidth(ev, spec, probe, facts), _compute(ev, spec, probe)]
    found += [_pcie(spec, probe, facts), _power(spec, facts), _virtualisation(ev, facts)]
    yardstick = judge.judge_yardstick(ev.yardstick)
    found += [_uuid(ev), yardstick, judge.judge_serving(ev.model(), ev.yardstick, yardstick)]
    found += [_prefix_cache(ev), _context(ev)]
    return [f for f in found if f is not None]


def _not_probed(ev: Evidence, what: str) -> str:
    why = ev.probe_note or "the probes did not run on this machine"
    return f"{what} was not measured: {why}."


def _identity(ev: Evidence, spec: Spec | None, specs: list[Spec], facts: dict) -> Finding:
    claimed = ev.claimed_model or ev.reported_name
    if spec is None:
        return Finding("identity", NOT_MEASURED, claimed, "no reference spec", "",
                       f"Rigshare has no reference spec for the {ev.reported_name}: its "
                       "identity cannot be checked, and it is verified by measurement alone.",
                       basis="none")
    wrong = {}
    if ev.claimed_model and spec_for(ev.claimed_model, specs) not in (None, spec):
        wrong["model"] = (ev.reported_name, ev.claimed_model)
    pairs = {"compute capability": (facts.get("compute_capability_cuda"),
                                    spec.compute_capability),
             "SM count": (facts.get("sm_count"), spec.sm_count),
             "memory bus width": (facts.get("memory_bus_width_bits"), spec.bus_width_bits)}
    compared = {k: v for k, v in pairs.items() if v[0] not in (None, "") and v[1] not in (None, "")}
    wrong |= {k: v for k, v in compared.items() if str(v[0]) != str(v[1])}
    if wrong:
        cc, sms = facts.get("compute_capability_cuda"), facts.get("sm_count")
        looks_like = next((s.name for s in specs if s is not spec and cc and
                           s.compute_capability == cc and (sms is None or s.sm_count == sms)),
                          None)
        detail = ", ".join(f"{k} {got} (expected {want})" for k, (got, want) in wrong.items())
        guess = f" It behaves like an {looks_like}." if looks_like else ""
        return Finding("identity", MISMATCH, claimed, spec.name, detail,
                       f"Reports itself as an {spec.name}, but the GPU itself says otherwise: "
                       f"{detail}.{guess}", basis="spec")
    if not compared:
        missing = [k for k, (got, want) in pairs.items() if want not in (None, "")]
        why = (f"the agent reported no {_words(missing, 'or')}" if missing else
               f"the {spec.name} has no compute capability, SM count or bus width to compare")
        return Finding("identity", NOT_MEASURED, claimed, spec.name, "",
                       f"Identity not checked: {why}.", basis="spec")
    names = _words(list(compared))
    measured = ", ".join(f"{k} {got}" for k, (got, _) in compared.items())
    return Finding("identity", OK, claimed, spec.name, measured,
                   f"The card is the {spec.name} it says it is: its {names} "
                   f"{'match' if len(compared) > 1 else 'matches'} the spec.", basis="spec")


def _words(items: list[str], last: str = "and") -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + f" {last} " + items[-1]


def _vram(ev: Evidence, spec: Spec | None, probe: dict) -> Finding:
    vram = probe.get("vram")
    promised_mib = max(filter(None, [ev.reported_memory_mib,
                                     (ev.claimed_vram_gb or 0) * 1024]), default=None)
    claimed = f"{ev.claimed_vram_gb} GB" if ev.claimed_vram_gb else (
        _gb(ev.reported_memory_mib) if ev.reported_memory_mib else "")
    if spec is not None and spec.unified_memory and not vram:
        return _unified_memory(ev, spec, promised_mib, claimed)
    if not vram:
        return Finding("vram", NOT_MEASURED, claimed, _gb(promised_mib) if promised_mib else "",
                       "", _not_probed(ev, "Memory capacity"))
    if promised_mib is None:
        free = _gb(vram.get("free_bytes", 0) / 2**20)
        return Finding("vram", NOT_MEASURED, "", "", free,
                       f"{free} of memory allocated, but neither the machine nor the listing "
                       "says how much it should have.")
    usable_mib = vram.get("free_bytes", 0) / 2**20
    if not vram.get("pattern_ok", True):
        return Finding("vram", MISMATCH, claimed, "pattern read back intact",
                       "pattern corrupted", "Memory returned different data than was written: "
                       "the card has memory errors.", basis="claim")
    if usable_mib < THRESHOLDS["vram"] * promised_mib:
        return Finding("vram", MISMATCH, claimed, _gb(promised_mib), _gb(usable_mib),
                       f"Promises {_gb(promised_mib)} of memory but only {_gb(usable_mib)} "
                       "could be allocated.", basis="claim")
    return Finding("vram", OK, claimed, _gb(promised_mib), _gb(usable_mib),
                   f"{_gb(usable_mib)} of memory allocated and checked.", basis="claim")


def _unified_memory(ev: Evidence, spec: Spec, promised_mib: float | None,
                    claimed: str) -> Finding:
    """Apple Silicon shares one memory between CPU and GPU: the size it reports must be one the
    chip is made with; only an allocation test would measure it."""
    most = spec.memory_gb * 1024
    if promised_mib and promised_mib > most * 1.02:
        return Finding("vram", MISMATCH, claimed, f"at most {spec.memory_gb} GB",
                       _gb(promised_mib), f"Claims {_gb(promised_mib)} of unified memory, "
                       f"but an {spec.name} is made with at most {spec.memory_gb} GB.",
                       basis="spec")
    size = f" ({_gb(promised_mib)}, within what an {spec.name} is made with)" \
        if promised_mib else ""
    return Finding("vram", NOT_MEASURED, claimed, f"at most {spec.memory_gb} GB", "",
                   f"Unified memory size as the machine reports it{size}; not measured: "
                   f"{(ev.probe_note or 'the probes did not run on this machine')}.",
                   basis="spec")


def _bandwidth(ev: Evidence, spec: Spec | None, probe: dict, facts: dict) -> Finding:
    measured = (probe.get("bandwidth") or {}).get("best_gbs")
    theoretical = facts.get("theoretical_bandwidth_gbs")
    expected = spec.bandwidth_gbs if spec else theoretical
    basis = "spec" if spec else "the card's own memory clock and bus width"
    if not measured:
        return Finding("bandwidth", NOT_MEASURED, "",
                       f"{expected:,.0f} GB/s" if expected else "", "",
                       _not_probed(ev, "Memory bandwidth"), basis="spec" if spec else "")
    if not expected:
        return Finding("bandwidth", NOT_MEASURED, "", "", f"{measured:,.0f} GB/s",
                       f"Memory bandwidth measured at {measured:,.0f} GB/s, but there is "
                       "nothing to compare it with: no reference spec, and the agent reported "
                       "no memory clock or bus width.")
    ratio = measured / expected
    severity = ratio_severity(ratio, "bandwidth")
    text = {OK: f"Memory bandwidth {measured:,.0f} GB/s, {ratio:.0%} of {basis}: as expected.",
            WARNING: f"Memory bandwidth {measured:,.0f} GB/s is only {ratio:.0%} of {basis}.",
            MISMATCH: f"Memory bandwidth {measured:,.0f} GB/s is far below {basis} "
                      f"({expected:,.0f} GB/s): {ratio:.0%}."}[severity]
    return Finding("bandwidth", severity, "", f"{expected:,.0f} GB/s", f"{measured:,.0f} GB/s",
                   text, basis="spec" if spec else "clock")


def _compute(ev: Evidence, spec: Spec | None, probe: dict) -> Finding:
    measured = (probe.get("matmul") or {}).get("best_tflops")
    expected = spec.bf16_tflops if spec else None
    if not measured:
        return Finding("compute", NOT_MEASURED, "",
                       f"{expected:,.0f} TFLOPS" if expected else "", "",
                       _not_probed(ev, "BF16 compute"), basis="spec" if expected else "")
    if not expected:
        whose = f"the {spec.name}" if spec else "this card"
        return Finding("compute", NOT_MEASURED, "", "no published figure",
                       f"{measured:,.0f} TFLOPS",
                       f"BF16 matmul runs at {measured:,.0f} TFLOPS; no dense BF16 figure is "
                       f"published for {whose} to compare it with.")
    ratio = measured / expected
    severity = ratio_severity(ratio, "compute")
    text = {OK: f"BF16 compute {measured:,.0f} TFLOPS, {ratio:.0%} of spec: as expected.",
            WARNING: f"BF16 compute {measured:,.0f} TFLOPS is only {ratio:.0%} of spec.",
            MISMATCH: f"BF16 compute {measured:,.0f} TFLOPS is far below spec "
                      f"({expected:,.0f}): {ratio:.0%}."}[severity]
    return Finding("compute", severity, "", f"{expected:,.0f} TFLOPS", f"{measured:,.0f} TFLOPS",
                   text, basis="spec")


def _pcie(spec: Spec | None, probe: dict, facts: dict) -> Finding | None:
    gen, width = facts.get("pcie_gen_max"), facts.get("pcie_width_max")
    if not gen or not width:
        return None  # no PCIe card (Apple Silicon) or no probe: nothing to say
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
                       "moving data will be very slow.", basis="spec")
    if gen < capable or width < 16:
        return Finding("pcie", WARNING, "", expected, link,
                       f"The card runs on a {link} link, below the {expected} it supports.",
                       basis="spec")
    return Finding("pcie", OK, "", expected, link + (f", {h2d:.1f} GB/s" if h2d else ""),
                   f"PCIe {link} as the card supports.", basis="spec")


def _power(spec: Spec | None, facts: dict) -> Finding | None:
    """The power limit against the spec's default, never against the agent's own word for its
    default: a card capped at 300 W that calls 300 W its default is still capped."""
    limit, said = facts.get("power_limit_w"), facts.get("power_default_limit_w")
    if spec is None or spec.unified_memory:
        return None if spec is not None or not limit else Finding(
            "power", NOT_MEASURED, "", "", f"{limit} W",
            f"The power limit is {limit} W; with no reference spec there is no default to "
            "compare it with.")
    if not spec.power_w:
        return None
    if not limit:
        return Finding("power", NOT_MEASURED, "", f"{spec.power_w} W", "",
                       "The power limit was not reported, so it could not be compared with the "
                       f"{spec.name}'s default {spec.power_w} W.", basis="spec")
    severity = ratio_severity(limit / spec.power_w, "power")
    own = (f" The machine calls {said} W its default; the {spec.name}'s is {spec.power_w} W."
           if said and abs(said - spec.power_w) > 0.1 * spec.power_w else "")
    if severity != OK:
        return Finding("power", severity, "", f"{spec.power_w} W", f"{limit} W",
                       f"The power limit is set to {limit} W, below the {spec.name}'s default "
                       f"{spec.power_w} W: it will run slower under load.{own}", basis="spec")
    return Finding("power", OK, "", f"{spec.power_w} W", f"{limit} W",
                   f"Power limit {limit} W, at the {spec.name}'s default or above.{own}",
                   basis="spec")


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
    if ev.uuid_repeated_on_node:
        return Finding("uuid", MISMATCH, "", "a UUID of its own", "repeated on this machine",
                       "Two GPUs of this machine report the same UUID: one GPU is counted "
                       "twice, so the report is spoofed.")
    if not ev.other_nodes_with_uuid:
        return None
    nodes = ", ".join(f"#{n}" for n in ev.other_nodes_with_uuid)
    return Finding("uuid", MISMATCH, "", "a UUID of its own", f"also on node {nodes}",
                   f"This GPU's UUID was reported earlier by node {nodes}, which still reports "
                   "it: one GPU cannot be in two machines, so this one is kept out until the "
                   "conflict is gone.")


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


def verdict(findings) -> str:
    """flagged: any mismatch. verified: its serving was judged against what its hardware should
    serve (its own yardstick passed) and a hardware check was made. serving_verified: the same
    with no hardware check (Apple Silicon has no probes). not_judged: measured, never flagged,
    but its serving could not be judged (an engine run by hand, a model of unknown size, no
    engine to measure). unverified: nothing was measured."""
    if any(f.severity == MISMATCH for f in findings):
        return "flagged"
    hardware = any(f.metric in HARDWARE_CHECKS and f.severity in (OK, WARNING) for f in findings)
    serving = next((f for f in findings if f.metric == "serving"), None)
    if serving is not None and serving.severity in (OK, WARNING):
        return "verified" if hardware else "serving_verified"
    if hardware or (serving is not None and serving.measured):
        return "not_judged"
    return "unverified"
