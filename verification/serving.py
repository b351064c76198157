"""Serving, judged: the platform's yardstick against what this hardware serves it at, then the
provider's own model against an expectation calibrated on that yardstick. Pure: plain values.

Every machine whose agent runs its engine also serves the yardstick, one workload the platform
chooses per class of machine (yardstick.py), so every GPU and count has peers on it from its
second machine on, and a basis from its first. What the card measures on the yardstick against
what first principles predict for its hardware (predict.py) is the card's own calibration: how
much longer or shorter than predicted its engine takes to read its weights and to do each
token's work (predict.calibrate). Applied to the prediction for the provider's model, it gives
what this card should serve that model at, whatever the model, and however few machines serve
it.

The yardstick's expectation, best first (`basis`):
1. peers: the median of the fleet's machines with the same GPU and count on the same workload,
   each of which passed its own yardstick;
2. reference: the published figure of this GPU and count (spec_data.SERVING_REFERENCE) carried
   over to the yardstick by the prediction (yardstick.reference_tps);
3. calibrated: the prediction for this hardware times what the fleet's machines measured over
   what was predicted for them on this workload;
4. prediction: the prediction alone, where the fleet has nothing to calibrate on yet.

The provider's model, best first:
1. peers on this model (same GPU, count, engine and quantization);
2. reference: the published figure for this hardware and model;
3. calibrated: the prediction for this model on this hardware times this card's calibration
   (its own yardstick where it served one; else what its hardware is expected to serve the
   yardstick at);
4. floor: what any sound set-up reaches (predict.py), only ever to flag.

Peers far below the best basis after them are a slow pack, not a yardstick: set aside, so two
slow machines with only each other are both judged against the calibrated expectation. One or
two peers cannot raise the expectation above the other bases either.

A serving judgment can pass (ok, warning) only where this machine served the yardstick and the
yardstick passed: a card whose own engine could not be checked (an engine its provider runs by
hand, a yardstick that did not load) is judged "not judged" unless it is far below, which flags.
"""

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from verification.findings import (
    MISMATCH,
    NOT_MEASURED,
    OK,
    THRESHOLDS,
    WARNING,
    Finding,
    ratio_severity,
)
from verification.predict import Decode, calibrate

# Peers: any validated peer is evidence; from this many on, their median stands on its own.
PEERS = {"min": 1, "robust": 3}
_RANK = {MISMATCH: 0, WARNING: 1, OK: 2}


@dataclass(frozen=True)
class Floor:
    """The first-principles prediction at one concurrency: `expected` for the engine as it runs,
    `floor` what any sound set-up reaches, and the decode law behind `expected`, which a card's
    calibration scales (predict.Prediction)."""

    expected: float
    floor: float
    decode: Decode | None = None


@dataclass(frozen=True)
class Yardstick:
    """The platform's workload on this machine, and every basis to judge it by."""

    label: str = ""  # "Llama-3.1-8B at fp8 on vLLM"
    measured: dict[int, float] = field(default_factory=dict)  # tok/s by concurrency
    note: str = ""  # why it was not served, when it was not
    # On this machine's hardware, the decode law at each concurrency (its tok/s: .tps()).
    predicted: dict[int, Decode] = field(default_factory=dict)
    peers: dict[int, tuple[float, ...]] = field(default_factory=dict)
    peer_label: str = ""  # "2x RTX 4090"
    reference: dict[int, float] = field(default_factory=dict)
    reference_label: str = ""
    fleet_ratio: dict[int, float] = field(default_factory=dict)  # measured / predicted
    fleet_machines: int = 0  # how many machines the ratio stands on


@dataclass(frozen=True)
class Expectation:
    value: float
    basis: str  # peers, reference, calibrated, prediction, floor
    text: str  # "1,248 tok/s by 3 RTX PRO 6000 peers on this model"


@dataclass(frozen=True)
class Bases:
    """Every basis at one concurrency, best first where it exists; `anchor` is the best that
    is not peers: what a peer group must come near to count."""

    peers: tuple[float, ...] = ()
    reference: float | None = None
    calibrated: float | None = None
    prediction: float | None = None
    floor: float | None = None

    @property
    def anchor(self) -> float | None:
        return self.reference or self.calibrated or self.prediction or self.floor


def _peers_text(n: int, label: str) -> str:
    peers = f"peer{'s' if n > 1 else ''}"
    if label[:1].isdigit():  # "2x RTX 4090": a machine of several cards
        return f"{n} {peers} with {label}"
    return f"{n} {label} {peers}" if label else f"{n} {peers}"


def expectation(bases: Bases, texts: dict[str, str], peer_label: str, on_what: str
                ) -> tuple[Expectation | None, str]:
    """The best basis at one concurrency, and a note on the peers set aside ("" if none).
    `texts`: how each basis is named, by basis ("{v}" takes its value)."""
    note = ""
    if bases.peers:
        median, n = statistics.median(bases.peers), len(bases.peers)
        anchor = bases.anchor
        if anchor and median < THRESHOLDS["serving"][0] * anchor:
            note = (f"its {n} peer{'s' if n > 1 else ''} serve{'' if n > 1 else 's'} "
                    f"{median:,.0f} tok/s themselves, far below the "
                    f"{'published figure' if bases.reference else 'expectation'} "
                    f"({anchor:,.0f}): not used as a yardstick")
        else:
            others = [v for v in (bases.reference, bases.calibrated, bases.prediction) if v]
            value = min(median, max(others)) if n < PEERS["robust"] and others else median
            return Expectation(value, "peers", f"{median:,.0f} tok/s by "
                               f"{_peers_text(n, peer_label)} {on_what}"), note
    for basis in ("reference", "calibrated", "prediction", "floor"):
        value = getattr(bases, basis)
        if value and basis in texts:
            return Expectation(value, basis, texts[basis].format(v=f"{value:,.0f}")), note
    return None, note


@dataclass(frozen=True)
class Judged:
    severity: str
    ratio: float
    level: int
    served: float
    expectation: Expectation


def judge(measured: dict[int, float], expect: Callable[[int], tuple[Expectation | None, str]]
          ) -> tuple[Judged | None, list[str]]:
    """Judged at one stream and at the highest concurrency with an expectation; the worse
    decides (among equals, the highest concurrency: the capacity). Also the notes."""
    levels = sorted(measured)
    notes: list[str] = []
    found = []
    for level in levels:
        exp, note = expect(level)
        if note and note not in notes:
            notes.append(note)
        if exp is not None and exp.value > 0:
            found.append((level, exp))
    if not found:
        return None, notes
    chosen = {found[0][0]: found[0][1], found[-1][0]: found[-1][1]}
    judged = [Judged(ratio_severity(measured[level] / exp.value, "serving"),
                     measured[level] / exp.value, level, measured[level], exp)
              for level, exp in chosen.items()]
    return min(judged, key=lambda j: (_RANK[j.severity], -j.level)), notes


def _sentence(j: Judged, extra: str) -> str:
    return {OK: f"{j.served:,.0f} tokens/s at {j.level} concurrent requests, {j.ratio:.0%} of "
                f"its expectation: {j.expectation.text}{extra}.",
            WARNING: f"{j.served:,.0f} tokens/s at {j.level} concurrent requests, only "
                     f"{j.ratio:.0%} of its expectation: {j.expectation.text}{extra}.",
            MISMATCH: f"far below its expectation: {j.served:,.0f} tokens/s at {j.level} "
                      f"concurrent requests, {j.ratio:.0%} of {j.expectation.text}{extra}."
            }[j.severity]


# --- the yardstick ---------------------------------------------------------------------------

def yardstick_bases(y: Yardstick, level: int) -> Bases:
    law = y.predicted.get(level)
    predicted = law.tps() if law else None
    ratio = y.fleet_ratio.get(level)
    return Bases(peers=y.peers.get(level, ()), reference=y.reference.get(level),
                 calibrated=predicted * ratio if predicted and ratio else None,
                 prediction=predicted)


def _yardstick_texts(y: Yardstick) -> dict[str, str]:
    machines = f"{y.fleet_machines} machine{'s' if y.fleet_machines != 1 else ''}"
    return {"reference": "{v} tok/s for " + (y.reference_label or "this hardware")
                         + ", carried over from its published figures",
            "calibrated": "{v} tok/s predicted for this hardware, calibrated on what "
                          f"{machines} of the fleet serve it at",
            "prediction": "{v} tok/s predicted from this hardware (first principles)"}


def judge_yardstick(y: Yardstick) -> Finding | None:
    if not y.label and not y.measured:
        return None
    if not y.measured:
        return Finding("yardstick", NOT_MEASURED, "", "", "",
                       f"The yardstick ({y.label or 'the platform workload'}) was not served: "
                       f"{y.note or 'the machine did not switch to it'}.", basis="none")
    texts = _yardstick_texts(y)
    j, notes = judge(y.measured, lambda level: expectation(
        yardstick_bases(y, level), texts, y.peer_label, "on the yardstick"))
    details = {"levels": {str(level): _row(y.measured.get(level), yardstick_bases(y, level))
                          for level in sorted(y.measured)},
               "ratio": {str(level): round(y.measured[level] / y.predicted[level].tps(), 4)
                         for level in sorted(y.measured) if level in y.predicted},
               "peers": max((len(v) for v in y.peers.values()), default=0)}
    extra = f" ({'; '.join(notes)})" if notes else ""
    if j is None:
        top = max(y.measured)
        return Finding("yardstick", NOT_MEASURED, "", "no basis",
                       f"{y.measured[top]:,.0f} tok/s @{top}",
                       f"Serves the yardstick ({y.label}) at {y.measured[top]:,.0f} tokens/s at "
                       f"{top} concurrent requests; there is no basis to judge it{extra}.",
                       basis="none", details=details)
    details["basis"] = j.expectation.basis
    return Finding("yardstick", j.severity, "",
                   f"{j.expectation.value:,.0f} tok/s @{j.level} ({j.expectation.basis})",
                   f"{j.served:,.0f} tok/s @{j.level}",
                   (f"On the yardstick ({y.label}): " + _sentence(j, extra))[:500],
                   basis=j.expectation.basis, details=details)


def calibration(y: Yardstick) -> tuple[tuple[float, float] | None, bool]:
    """What this card does with the prediction for it: the multipliers of the time to read the
    weights and of each token's time (predict.calibrate) that meet what it measured on its own
    yardstick (True), else what its hardware is expected to serve the yardstick at (False: an
    expectation, not a measurement). None where there is neither."""
    if y.measured:
        points = [(y.predicted[level], tps) for level, tps in y.measured.items()
                  if level in y.predicted]
        return calibrate(points), True
    texts = _yardstick_texts(y)
    points = []
    for level, law in y.predicted.items():
        exp, _ = expectation(yardstick_bases(y, level), texts, y.peer_label, "")
        if exp is not None:
            points.append((law, exp.value))
    return calibrate(points), False


def _row(measured: float | None, bases: Bases, predicted: Floor | None = None) -> dict:
    """Every basis at one concurrency, for the rent page's plot and table."""
    row = {"measured": measured} if measured is not None else {}
    if bases.peers:
        row["peers"], row["peer_count"] = statistics.median(bases.peers), len(bases.peers)
    for name in ("reference", "calibrated"):
        if getattr(bases, name):
            row[name] = round(getattr(bases, name), 1)
    if predicted is not None:
        row["predicted"], row["floor"] = round(predicted.expected, 1), round(predicted.floor, 1)
    elif bases.prediction:
        row["predicted"] = round(bases.prediction, 1)
    return row


# --- the provider's model --------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    """The provider's model on this machine, and the bases to judge it by."""

    measured: dict[int, float] = field(default_factory=dict)  # tok/s by concurrency
    note: str = ""  # why it was not load-tested, when it was not
    peers: dict[int, tuple[float, ...]] = field(default_factory=dict)
    peer_label: str = ""
    reference: dict[int, float] = field(default_factory=dict)
    reference_label: str = ""
    predicted: dict[int, Floor] = field(default_factory=dict)  # on this hardware, uncalibrated
    prediction_note: str = ""  # "from its measured 1,613 GB/s and the model's architecture"
    # The agent runs the engine: the platform can switch it to the yardstick and back.
    supervised: bool = False


def serving_bases(m: Model, cal: tuple[float, float] | None, level: int) -> Bases:
    predicted = m.predicted.get(level)
    law = predicted.decode if predicted else None
    return Bases(peers=m.peers.get(level, ()), reference=m.reference.get(level),
                 calibrated=law.tps(*cal) if law and cal else None,
                 floor=predicted.floor if predicted else None)


def _serving_texts(m: Model, own: bool) -> dict[str, str]:
    note = f" {m.prediction_note}" if m.prediction_note else ""
    on = "its own yardstick" if own else "what its hardware is expected to serve the yardstick at"
    label = f" for {m.reference_label}" if m.reference_label else ""
    return {"reference": "{v} tok/s published" + label + " on this model",
            "calibrated": "{v} tok/s predicted" + note + ", calibrated on " + on,
            "floor": "at least {v} tok/s predicted" + note}


def _why_not_judged(m: Model, y: Yardstick, yardstick: Finding | None, basis: str) -> str:
    """Why this judgment cannot pass a card, or "" when it can."""
    if not m.supervised:
        return ("its provider runs the engine by hand, so Rigshare cannot serve its yardstick "
                "on this machine")
    if not y.measured:
        return f"the yardstick was not served ({y.note or 'the machine did not switch to it'})"
    if yardstick is None or yardstick.severity not in (OK, WARNING):
        return "its yardstick could not be judged"
    if basis == "floor":
        return ("neither the engine nor the agent says the weights' format, and a floor says "
                "only what is far too slow")
    return ""


def judge_serving(m: Model, y: Yardstick, yardstick: Finding | None) -> Finding:
    if not m.measured:
        return Finding("serving", NOT_MEASURED, "", "", "", "Serving was not measured: "
                       f"{m.note or 'the engine was not load-tested'}.")
    cal, own = calibration(y)
    texts = _serving_texts(m, own)
    j, notes = judge(m.measured, lambda level: expectation(
        serving_bases(m, cal, level), texts, m.peer_label, "on this model"))
    details = {"levels": {str(level): _row(m.measured[level], serving_bases(m, cal, level),
                                           m.predicted.get(level))
                          for level in sorted(m.measured)},
               "peers": max((len(v) for v in m.peers.values()), default=0),
               "calibration": ({"weights": round(cal[0], 4), "tokens": round(cal[1], 4),
                                "on": "yardstick" if own else "hardware"} if cal else {})}
    extra = f" ({'; '.join(notes)})" if notes else ""
    if j is None:
        top = max(m.measured)
        served = m.measured[top]
        why = ("no verified peer serves this model on the same hardware, there is no published "
               "figure for it, and the model's size is not known")
        return Finding("serving", NOT_MEASURED, "", "no basis", f"{served:,.0f} tok/s @{top}",
                       f"Serves {served:,.0f} tokens/s at {top} concurrent requests; not judged: "
                       f"{why}{extra}.", basis="none", details=details)
    details["basis"] = j.expectation.basis
    expected = f"{j.expectation.value:,.0f} tok/s @{j.level} ({j.expectation.basis})"
    measured = f"{j.served:,.0f} tok/s @{j.level}"
    why = _why_not_judged(m, y, yardstick, j.expectation.basis)
    if why and j.severity != MISMATCH:
        return Finding("serving", NOT_MEASURED, "", expected, measured,
                       (f"Serves {j.served:,.0f} tokens/s at {j.level} concurrent requests, "
                        f"{j.ratio:.0%} of {j.expectation.text}{extra}; not judged: "
                        f"{why}.")[:500], basis=j.expectation.basis, details=details)
    return Finding("serving", j.severity, "", expected, measured,
                   ("Serves " + _sentence(j, extra))[:500], basis=j.expectation.basis,
                   details=details)
