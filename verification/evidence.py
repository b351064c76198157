"""Reads that gather what a run's serving is judged by (serving.py): the fleet's peers on the
provider's model and on the yardstick, the published reference, the first-principles
predictions for this node's hardware as its probes measured it, and the fleet's calibration on
the yardstick. Plain values out; the judging itself is pure (evaluate.py, serving.py).
"""

import re
import statistics
from dataclasses import replace
from datetime import datetime, timedelta

from django.db.models import Count, Q
from django.utils import timezone

from marketplace import engine_config, modelmath
from marketplace import selectors as marketplace_selectors
from marketplace.model_data import architecture_for
from marketplace.models import Card, Node
from verification import evaluate as ev
from verification import predict
from verification import yardstick as ys
from verification.findings import OK, WARNING
from verification.models import Finding, Measurement, VerificationRun
from verification.spec_data import SERVING_REFERENCE

Status = VerificationRun.Status
Yardstick = VerificationRun.YardstickState
PEER_WINDOW = timedelta(days=30)  # a peer's measurement older than this is no longer evidence
# Weights tried, heaviest first, when neither the agent nor the model's files say how the model
# is quantized: the heaviest that fits gives the lowest floor. A guess: it only ever flags.
_ASSUMED_QUANTIZATIONS = ("bf16", "fp8", "awq")
FP8_MATH_CC = (8, 9)  # compute capability from which a card runs FP8 math natively


def serving(run: VerificationRun, cards: list[Card], node_level: dict, by_index: dict,
            specs: list[ev.Spec]) -> dict:
    """The serving part of every card's Evidence (the engine serves the node as a whole)."""
    names = {card.name for card in cards}
    gpu = names.pop() if len(names) == 1 else None
    spec = ev.spec_for(gpu, specs) if gpu else None
    count = len(cards)
    label = (spec.name if spec else gpu or "mixed GPUs")
    label = f"{count}x {label}" if count > 1 else label
    evidence = {"peer_label": label, "reference_label": label,
                "supervised": bool(run.served.get("supervised")),
                "yardstick": yardstick(run, cards, by_index, gpu, spec, label)}
    served = {int(k.split("@")[1]): m.value for k, m in node_level.items()
              if k.startswith("tps@") and m.value > 0}
    if not served:
        return evidence | {"served_tps": {}, "serving_note": (
            run.error or "the engine was not reachable from Rigshare")[:200]}
    engine, quantization = served_as(run)
    evidence["served_tps"] = served
    if gpu:
        evidence["peer_tps"] = peer_tps(run.node, gpu, count, run.model, engine, quantization)
    if spec:
        evidence["reference_tps"] = reference(spec, count, run.model)
    per_pass = node_level.get("spec_tokens_per_pass")
    predicted, note = predicted_model(run, cards, by_index, spec, engine, quantization,
                                      sorted(served), per_pass.value if per_pass else None)
    return evidence | {"predicted": predicted, "prediction_note": note}


def served_as(run: VerificationRun) -> tuple[str, str]:
    """(engine kind, quantization) of the model the run load-tested, as the engine described it
    then ("" where unsaid); the node's word now for a run older than that record."""
    entry = run.served or next((m for m in run.node.engine_served or []
                                if m.get("id") == run.model), {})
    return entry.get("engine") or "", (entry.get("quantization") or "").strip().lower()


# --- peers on the provider's model -----------------------------------------------------------

def _candidates(node: Node, gpu: str, count: int, statuses=Card.SERVING_JUDGED):
    """Other nodes with `count` present cards, all this GPU and of these verdicts, not held out."""
    present = Q(cards__present=True)
    return (Node.objects.exclude(pk=node.pk)
            .filter(needs_review=False, uuid_conflict=False, credential_revoked_at__isnull=True)
            .annotate(n=Count("cards", filter=present),
                      alike=Count("cards", filter=present & Q(
                          cards__name=gpu, cards__verification_status__in=statuses)))
            .filter(n=count, alike=count))


def peer_tps(node: Node, gpu: str, count: int, model: str, engine: str, quantization: str,
             now: datetime | None = None) -> dict[int, tuple[float, ...]]:
    """Tokens/s by concurrency of the fleet's verified peers: other nodes with `count` present
    cards, all this GPU and judged to serve as they should (verified, or serving verified: an
    Apple Silicon machine has no probes), not held out, whose latest run within PEER_WINDOW
    served this model on the same engine and quantization (where both say)."""
    now = now or timezone.now()
    latest: dict[int, VerificationRun] = {}
    for run in (VerificationRun.objects
                .filter(node__in=_candidates(node, gpu, count), status=Status.DONE,
                        finished_at__gte=now - PEER_WINDOW)
                .select_related("node").only("pk", "node_id", "model", "served",
                                             "node__engine_served")
                .order_by("node_id", "-finished_at", "-pk")):
        if run.node_id not in latest:  # each peer's latest run, and only if it served this model
            latest[run.node_id] = run if run.model == model else None
    runs = [run.pk for run in latest.values()
            if run is not None and _alike(served_as(run), (engine, quantization))]
    return _levels(runs, "tps@")


def _levels(runs: list[int], prefix: str) -> dict[int, tuple[float, ...]]:
    by_level: dict[int, list[float]] = {}
    for metric, value in Measurement.objects.filter(run_id__in=runs, card__isnull=True,
                                                    metric__startswith=prefix, value__gt=0
                                                    ).values_list("metric", "value"):
        by_level.setdefault(int(metric.split("@")[1]), []).append(value)
    return {level: tuple(sorted(values)) for level, values in by_level.items()}


def _alike(theirs: tuple[str, str], ours: tuple[str, str]) -> bool:
    return all(not a or not b or a == b for a, b in zip(theirs, ours, strict=True))


def reference(spec: ev.Spec | None, count: int, model: str) -> dict[int, float]:
    if spec is None:
        return {}
    for ref in SERVING_REFERENCE:
        if ref["gpu"] == spec.name and ref["count"] == count and ref["model"] == model:
            return dict(ref["tps"])
    return {}


# --- the provider's model from first principles ------------------------------------------------

def predicted_model(run, cards, by_index, spec, engine, quantization, levels,
                    tokens_per_pass) -> tuple[dict[int, ev.Floor], str]:
    """The first-principles prediction for the run's model at each measured concurrency, and
    what it rests on. Its law (`decode`, which the card's calibration scales) only where the
    model's size is known; with weights whose format is guessed, only a floor."""
    arch, weights_bytes, size = model_size(run, quantization)
    if arch is None:
        return {}, ""
    tp, max_batch = _layout(run, cards, arch, quantization)
    hw = hardware(cards, by_index, spec, tp=tp)
    if hw is None:
        return {}, ""
    engine = engine if engine in modelmath.ENGINES else (
        "llama.cpp" if hw.unified_memory or modelmath.engine_for(quantization).kind
        == "llama.cpp" else "vllm")
    known = bool(quantization) or weights_bytes is not None
    quantizations = [quantization] if known else list(_ASSUMED_QUANTIZATIONS)
    for quant in quantizations:
        found = {}
        for level in levels:
            p = predict.predict(hw, arch, engine=engine, quantization=quant or None,
                                concurrency=level, tokens_per_pass=tokens_per_pass,
                                weights_bytes=None if quant else weights_bytes,
                                max_batch=max_batch)
            if p is None:
                break
            found[level] = ev.Floor(expected=p.expected, floor=p.floor,
                                    decode=p.decode if known else None)
        else:
            bandwidth = (f"its measured {hw.bandwidth_gbs:,.0f} GB/s" if hw.bandwidth_measured
                         else f"its spec's {hw.bandwidth_gbs:,.0f} GB/s (not measured)")
            if hw.cards > 1:
                split = (f"{hw.cards} cards in tensor parallel" if hw.replicas == 1 else
                         f"{hw.replicas} replicas of {hw.per_replica} card(s)")
                bandwidth = f"{split} at {bandwidth} each"
            weights = (quant if known and quant else "the weights' bytes on disk" if known
                       else f"{quant}, the heaviest weights that fit")
            return found, f"from {bandwidth} and {size} ({weights})"
    return {}, ""


def model_size(run: VerificationRun, quantization: str
               ) -> tuple[modelmath.Architecture | None, float | None, str]:
    """(architecture, weights' bytes as stored, what the size rests on) of the run's model: the
    platform's registry, else the config.json and weights the agent read beside the engine,
    else the size its name states; (None, None, "") where nothing says."""
    arch = architecture_for(run.model)
    files = (run.served or {}).get("files") or {}
    weights = files.get("weights_bytes")
    if arch is not None:
        return arch, weights, "the model's architecture"
    config = files.get("config") or {}
    params = files.get("params") or (weights * 8 / modelmath.quantization_bits(quantization)
                                     if weights and quantization
                                     and modelmath.quantization_bits(quantization) else None)
    with_layers = bool(config.get("num_hidden_layers") and config.get("hidden_size")
                       and config.get("num_attention_heads"))
    if with_layers:
        try:
            arch = modelmath.from_config(config, params=params)
            return arch, weights, f"its config.json ({files.get('source') or 'the agent'})"
        except ValueError:
            pass
    if params:
        return (modelmath.Architecture(params=float(params), active_params=float(params),
                                       layers=0, kv_layers=0, kv_heads=0, head_dim=0),
                weights, f"its {params / 1e9:.3g}B parameters ({files.get('source') or ''})")
    named = modelmath.params_from_name(run.model)
    if named is not None:
        return (modelmath.Architecture(params=named[0], active_params=named[1], layers=0,
                                       kv_layers=0, kv_heads=0, head_dim=0),
                weights, f"the {named[0] / 1e9:g}B parameters its name states")
    return None, None, ""


_TP = re.compile(r"^(--tensor-parallel-size|-tp)(?:=(\d+))?$")
_DP = re.compile(r"^(--data-parallel-size|-dp)(?:=(\d+))?$")
_SEQS = re.compile(r"^(--max-num-seqs|--parallel|-np)(?:=(\d+))?$")


def _flags(argv: list[str]) -> dict[str, int]:
    """The layout flags of an engine command: tensor and data parallel, sequences at once."""
    found = {}
    for i, word in enumerate(argv):
        for name, pattern in (("tp", _TP), ("dp", _DP), ("seqs", _SEQS)):
            match = pattern.match(word)
            if match:
                value = match.group(2) or (argv[i + 1] if i + 1 < len(argv) else "")
                if value.isdigit() and int(value) > 0:
                    found[name] = int(value)
    return found


def command_layout(config: dict) -> tuple[int | None, int | None]:
    """(GPUs per replica, sequences at once) of an engine configuration as the platform hands
    it over (EngineConfig.to_json())."""
    figures = config.get("figures") or {}
    flags = _flags(list(config.get("argv") or []))
    return figures.get("gpus_per_replica"), flags.get("seqs")


def _layout(run, cards, arch, quantization) -> tuple[int | None, int | None]:
    """(GPUs per replica, sequences at once) of the provider's engine: what its command says
    (the agent runs it), else what the platform would run it with, else (all of them, not
    known)."""
    flags = _flags((run.served or {}).get("argv") or [])
    tp = flags.get("tp") or (max(1, len(cards) // flags["dp"]) if flags.get("dp") else None)
    if tp or flags.get("seqs"):
        return tp, flags.get("seqs")
    if modelmath.quantization_bits(quantization) is None or arch.layers == 0:
        return None, None
    inputs = marketplace_selectors.node_engine_inputs_for(run.node, model=run.model,
                                                          quantization=quantization)
    config = engine_config.compute(**{**inputs, "arch": arch})
    if not config.runnable:
        return None, None
    return command_layout(config.to_json())


def hardware(cards, by_index, spec, *, tp: int | None = None) -> predict.Hardware | None:
    """The node as the prediction sees it: each card's own measurements where the probes made
    them (the slowest card sets the pace of tensor parallel), else its spec."""
    probes = [by_index.get(card.index) or {} for card in cards]
    bandwidths = [(p.get("bandwidth") or {}).get("best_gbs") for p in probes]
    tflops = [(p.get("matmul") or {}).get("best_tflops") for p in probes]
    memories = [_card_memory(card, probe) for card, probe in zip(cards, probes, strict=True)]
    vram = min(memories) if memories and all(memories) else (
        spec.memory_gb * 2**30 if spec else None)
    gens = [card.pcie_gen_max for card in cards]
    pcie = min(gens) if all(gens) else None
    nvlink = engine_config.nvlink_joined(card.nvlink_links for card in cards)
    fp8 = all(_cc(card.compute_capability) >= FP8_MATH_CC for card in cards)
    if vram is None:
        return None
    if all(bandwidths):
        return predict.Hardware(cards=len(cards), bandwidth_gbs=min(bandwidths), vram_bytes=vram,
                                bf16_tflops=min(tflops) if all(tflops) else (
                                    spec.bf16_tflops * predict.SPEC_COMPUTE_SHARE
                                    if spec and spec.bf16_tflops else None),
                                pcie_gen=pcie, nvlink=nvlink, tp=tp, fp8_math=fp8,
                                unified_memory=bool(spec and spec.unified_memory))
    if spec is None:
        return None
    return replace(predict.hardware_from_spec(
        cards=len(cards), spec_bandwidth_gbs=spec.bandwidth_gbs, vram_bytes=vram,
        spec_tflops=spec.bf16_tflops, pcie_gen=pcie, nvlink=nvlink,
        unified_memory=spec.unified_memory), tp=tp, fp8_math=fp8)


def _cc(text: str) -> tuple[int, int]:
    found = re.fullmatch(r"(\d+)\.(\d+)", text or "")
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _card_memory(card: Card, probe: dict) -> float | None:
    """What a card holds: what it reports, never more than its VRAM test could allocate (a
    spoofed NVML size must not buy KV cache the card lacks)."""
    sizes = [card.memory_total_mib * 2**20] if card.memory_total_mib else []
    free = (probe.get("vram") or {}).get("free_bytes")
    if free:
        sizes.append(free + predict.ACTIVATION_RESERVE_BYTES)
    return min(sizes) if sizes else None


# --- the yardstick ------------------------------------------------------------------------------

def workload(node: Node, cards: list[Card]) -> ys.Workload | None:
    return ys.workload_for(memory_mib=[c.memory_total_mib for c in cards if c.memory_total_mib],
                           cuda=node.has_nvidia or any(c.compute_capability for c in cards))


def yardstick_run(run: VerificationRun) -> VerificationRun | None:
    """The run whose yardstick this node is judged by: this one where it served it, else the
    node's latest that did, since its hardware last changed and within PEER_WINDOW (a rented
    machine keeps its renter's engine; its last yardstick stands)."""
    if run.yardstick_state == Yardstick.DONE:
        return run
    node = run.node
    since = max(filter(None, (node.hardware_changed_at, timezone.now() - PEER_WINDOW)))
    return (VerificationRun.objects.filter(node=node, yardstick_state=Yardstick.DONE,
                                           created_at__gte=since)
            .exclude(pk=run.pk).order_by("-created_at", "-pk").first())


def yardstick(run: VerificationRun, cards: list[Card], by_index: dict, gpu: str | None,
              spec: ev.Spec | None, label: str) -> ev.Yardstick:
    work = workload(run.node, cards)
    if work is None:
        return ev.Yardstick(note="no yardstick fits its cards")
    source = yardstick_run(run)
    measured = {}
    if source is not None and source.yardstick == work.key:
        measured = {int(metric.split("@")[1]): value for metric, value in
                    source.measurements.filter(card__isnull=True, metric__startswith="ytps@",
                                               value__gt=0).values_list("metric", "value")}
    config = (source.yardstick_config if source else run.yardstick_config) or {}
    tp, max_batch = command_layout(config) if config else (None, None)
    if not config:
        tp, max_batch = command_layout(yardstick_config(run.node, work).to_json())
    hw = hardware(cards, by_index, spec, tp=tp)
    predicted = {}
    if hw is not None:
        for level in ys.LEVELS:
            p = predict.predict(hw, work.arch, engine=work.engine,
                                quantization=work.quantization, concurrency=level,
                                max_batch=max_batch)
            if p is not None:
                predicted[level] = p.decode
    reference_hw = ys.reference_hardware(spec, len(cards), tp=tp, measured=hw) if spec else None
    ratio, machines = fleet_ratio(work.key, exclude_node=run.node_id)
    return ev.Yardstick(
        label=work.label, measured=measured, note=(run.yardstick_note or "")[:200],
        predicted=predicted,
        peers=yardstick_peer_tps(run.node, gpu, len(cards), work.key) if gpu else {},
        peer_label=label,
        reference=ys.reference_tps(work, gpu=spec.name, count=len(cards),
                                   hardware=reference_hw) if reference_hw else {},
        reference_label=label, fleet_ratio=ratio, fleet_machines=machines)


def yardstick_config(node: Node, work: ys.Workload) -> engine_config.EngineConfig:
    """The engine command that serves the yardstick on this node (the platform's, with no
    override: the same for every machine of its kind)."""
    inputs = marketplace_selectors.node_engine_inputs_for(node, model=work.model,
                                                          quantization=work.quantization)
    # Served as the provider's engine is (HTTPS with the agent's certificate, or not): the
    # address the platform calls keeps its scheme, and its pinned certificate, across the
    # switch.
    inputs["tls"] = inputs.get("tls", False) and node.engine_encrypted
    return engine_config.compute(**inputs)


def _latest_yardsticks(key: str, now=None, **filters) -> list[int]:
    """Each node's latest run within PEER_WINDOW that served this yardstick and passed it."""
    now = now or timezone.now()
    latest: dict[int, int] = {}
    for run_id, node_id in (VerificationRun.objects
                            .filter(yardstick=key, yardstick_state=Yardstick.DONE,
                                    status=Status.DONE, finished_at__gte=now - PEER_WINDOW,
                                    **filters)
                            .order_by("node_id", "-finished_at", "-pk")
                            .values_list("pk", "node_id")):
        latest.setdefault(node_id, run_id)
    passed = set(Finding.objects.filter(run_id__in=list(latest.values()), metric="yardstick",
                                        severity__in=(OK, WARNING))
                 .values_list("run_id", flat=True))
    return [run_id for run_id in latest.values() if run_id in passed]


def yardstick_peer_tps(node: Node, gpu: str, count: int, key: str) -> dict[int, tuple[float, ...]]:
    """Tokens/s by concurrency of the other machines with this GPU and count that served the
    same yardstick and passed it."""
    candidates = _candidates(node, gpu, count, statuses=Card.ROUTABLE)
    return _levels(_latest_yardsticks(key, node__in=candidates), "ytps@")


def fleet_ratio(key: str, *, exclude_node: int | None = None) -> tuple[dict[int, float], int]:
    """The fleet's measured over predicted on this yardstick, by concurrency (the median over
    the machines that passed it), and how many machines it stands on."""
    runs = [r for r in _latest_yardsticks(key) if r]
    rows = (Finding.objects.filter(run_id__in=runs, metric="yardstick")
            .exclude(run__node_id=exclude_node).values_list("run_id", "details"))
    by_run = {run_id: (details or {}).get("ratio") or {} for run_id, details in rows}
    by_level: dict[int, list[float]] = {}
    for ratios in by_run.values():
        for level, value in ratios.items():
            by_level.setdefault(int(level), []).append(float(value))
    return ({level: statistics.median(values) for level, values in by_level.items()},
            len(by_run))
