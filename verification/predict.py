"""What a node should serve, from first principles: its own measured bandwidth, VRAM and
compute, the model's architecture and weights, the engine and its layout. Pure: plain values.

One decode step of a batch of b sequences on a replica of `tp` cards reads every weight once
(once per `tokens_per_pass` tokens when the engine decodes speculatively) and does the work of
b tokens, so it takes

    t(b) = t_weights + STEP_MS + b * t_token,   output tokens/s = replicas * b / t(b)

    t_weights = weight bytes per card / card bandwidth / tokens_per_pass
    t_token   = COMPUTE * (2 * active parameters / (tp * card BF16 FLOP/s)), twice that for
                math not in FP8 + TOKEN_MS + TP_MS[PCIe generation] (tensor parallel only)
                + context * KV bytes per token / (tp * card bandwidth)

and only as many sequences decode at once as the KV cache holds beside the weights (and the
engine's own limit, where its command says one). This law (`Decode`) is what verification
calibrates on each card's yardstick (`calibrate`): the multipliers of t_weights and t_token
that meet what the card served, carried to the provider's model on the same card (serving.py).

The factors are fitted to the eight published fleet figures (FACTS.md: RTX PRO 6000 106 alone
and 1,342 at 32; 2x RTX 4090 94 and 435; 2x RTX 5090 152 and 1,318; H200 170 alone and 3,342
at 128), with each card's bandwidth and BF16 rate as a correct measurement reads them and the
27B at 8-bit weights. The fit reproduces all eight within 2.5% (tests/verification/
test_predict.py), but it is six factors for eight figures of four machines, and two of them
say something the figures cannot prove:

- FLEET_TOKENS_PER_PASS ~2.9: the fleet's engines got ~2.9 tokens per pass over the weights.
  No engine does that without multi-token prediction or speculative decoding; 8-bit weights
  are the only reading under which all four single-stream figures fit one bandwidth law at
  all (16-bit weights would need ~5.7 tokens a pass). An engine's own figure is measured from
  its metrics (loadtest.py); one that does not decode speculatively gets one token a pass.
- TP_MS: the per-token cost of tensor parallel over PCIe, 1.66 ms on Gen4 (the 4090 pair) and
  0.23 ms on Gen5 (the 5090 pair): one pair each, so a fit, not a law. No NVLink pair is
  published; NVLink is faster than either link, so its cost is taken as Gen5's at most.

`floor` is a last resort, only ever used to flag: the prediction with no speculative decoding,
twice the fleet's per-token costs (TOKEN_FLOOR_FACTOR: an engine built or tuned worse than the
fleet's), and the slower tensor-parallel cost where the link is not known. A node whose weights
fill more than half of the memory it gives the engine (MEMORY_STARVED) batches poorly: the
fleet saw two 24 GB replicas of the 27B lose to one tensor-parallel pair by 2-4x. Its floor
under load is no more than the smallest batching gain the fleet published (LOAD_GAIN_FLOOR:
the 4090 pair's 435 / 94 at 32) over its single-stream floor.
"""

import math
from dataclasses import dataclass

from marketplace import modelmath

FLEET_SOURCE = ("fitted to the published fleet figures (FACTS.md): RTX PRO 6000, 2x RTX 4090, "
                "2x RTX 5090, H200 serving a 27B model on vLLM")

# vLLM, fitted (see the module's docstring); each factor with what it stands for.
WEIGHT_PASS = 0.344  # share of a full pass over the weights per decoded token, one stream
# The tokens the published fleet's engines got per pass over the weights: its multi-token
# prediction head, as the fit reads it. An engine's own figure comes from its metrics.
FLEET_TOKENS_PER_PASS = 1 / WEIGHT_PASS
WEIGHT_PASS_FLOOR = 1.0  # no multi-token prediction: one token per pass
STEP_MS = 3.29  # fixed cost of a decode step (scheduling, launches, sampling)
COMPUTE = 0.848  # per-token FLOPs over the card's measured BF16 rate, FP8 weights (fitted)
# FP8 weights run their math in FP8, twice BF16's rate, on cards that have it (compute
# capability 8.9 or newer: every published machine); 16-bit weights, and 4-bit ones widened to
# 16 bits for their math (AWQ, GPTQ), or FP8 on older cards, take twice as long.
NON_FP8_MATH = 2.0
TOKEN_MS = 0.186  # per-token cost that is neither weights nor FLOPs (detokenise, stream out)
TP_MS = {4: 1.66, 5: 0.229}  # per token, tensor parallel over PCIe of this generation
TP_MS_UNKNOWN = max(TP_MS.values())
TP_MS_NVLINK = min(TP_MS.values())
TOKEN_FLOOR_FACTOR = 2.0  # the floor allows an engine twice the fleet's per-token cost
# Weights above this share of the memory the engine gets: the node is starved of KV cache.
MEMORY_STARVED = 0.5
# The smallest published gain of load over one stream: 2x RTX 4090, 435 / 94 at 32.
LOAD_GAIN_FLOOR = 435 / 94
LOAD_GAIN_AT = 32

# llama.cpp: no published figure to fit. One stream streams the weights from memory; its
# Metal and CUDA kernels reach roughly half to two thirds of the bandwidth bound (our
# estimate), and each step has vLLM's fixed costs too. Its parallel slots (LLAMACPP_SLOTS run
# at once) share a weight read; their math is counted where the card's rate is known.
LLAMACPP_BANDWIDTH_SHARE = 0.65
LLAMACPP_BANDWIDTH_SHARE_FLOOR = 0.45
LLAMACPP_SLOTS = 4

# vLLM's default share of each card, and what it keeps per card beside weights and KV: the
# same figures the catalog's "what fits" answers with.
GPU_MEMORY_UTILIZATION = modelmath.GPU_MEMORY_UTILIZATION
ACTIVATION_RESERVE_BYTES = modelmath.ACTIVATION_RESERVE_BYTES
# A correct STREAM method reads 81-96% of the spec (FACTS.md): where a card's bandwidth was not
# measured, its spec is taken at the low end.
SPEC_BANDWIDTH_SHARE = 0.81
SPEC_COMPUTE_SHARE = 0.7  # a dense GEMM's usual share of the datasheet rate
# What one of the platform's load-test requests holds in the KV cache: its 256-word prompt
# (about two tokens a word) and 128 output tokens (loadtest.py). Each decoded token reads the
# cache of its request so far (half of it on average), and the cache bounds the batch.
SEQUENCE_TOKENS = 640


@dataclass(frozen=True)
class Hardware:
    """One node as it serves: `cards` GPUs, each as measured (or spec), split into replicas of
    `tp` GPUs in tensor parallel (None: one replica over all of them)."""

    cards: int
    bandwidth_gbs: float  # per card, the slowest card's: tensor parallel waits for it
    vram_bytes: float  # per card
    bf16_tflops: float | None  # per card; None: unknown
    pcie_gen: int | None = None  # the PCIe link tensor parallel crosses (None: unknown)
    bandwidth_measured: bool = True
    unified_memory: bool = False
    nvlink: bool = False  # the cards are joined by NVLink: tensor parallel crosses it instead
    tp: int | None = None  # GPUs per replica (vLLM's --tensor-parallel-size)
    fp8_math: bool = True  # compute capability 8.9 or newer (False: older, or not known)

    @property
    def per_replica(self) -> int:
        return max(1, min(self.tp or self.cards, self.cards))

    @property
    def replicas(self) -> int:
        return max(1, self.cards // self.per_replica)


@dataclass(frozen=True)
class Decode:
    """One decode step as predicted: `busy` replicas, each decoding `batch` streams in a step
    of weights_s + step_s + batch x token_s seconds. Calibration (calibrate) scales the time
    to read the weights and each token's time by what a card measured."""

    busy: int
    batch: int
    weights_s: float
    step_s: float
    token_s: float

    def tps(self, weights: float = 1.0, tokens: float = 1.0) -> float:
        step = weights * self.weights_s + self.step_s + self.batch * tokens * self.token_s
        return self.busy * self.batch / step


@dataclass(frozen=True)
class Prediction:
    concurrency: int
    expected: float  # the fitted prediction for the engine as it runs
    floor: float  # what any sound set-up reaches at least: a last resort, only ever to flag
    batch: int  # sequences that decode at once on each replica (the KV cache's limit included)
    decode: Decode | None = None  # the law behind `expected`


def predict(hw: Hardware, arch: modelmath.Architecture, *, engine: str,
            quantization: str | None, concurrency: int,
            sequence_tokens: int = SEQUENCE_TOKENS, tokens_per_pass: float | None = None,
            weights_bytes: float | None = None, max_batch: int | None = None
            ) -> Prediction | None:
    """The engine's output tokens/s at `concurrency` streams. `tokens_per_pass`: tokens one
    stream gets per pass over the weights when the engine decodes speculatively (its metrics
    say; FLEET_TOKENS_PER_PASS for the published fleet); None: one. `weights_bytes`: the
    weights as the machine holds them (their files), in place of the size the architecture and
    quantization give. `max_batch`: the most sequences the engine runs at once on a replica
    (vLLM's --max-num-seqs, llama.cpp's --parallel) where it says. None when the weights' size
    is unknown or they do not fit the node."""
    weights = weights_bytes or modelmath.weight_bytes(arch, quantization)
    if weights_bytes and arch.params:
        active = weights_bytes * arch.active_params / arch.params
    else:
        active = modelmath.active_weight_bytes(arch, quantization)
    if not weights or not active or hw.cards < 1 or hw.bandwidth_gbs <= 0:
        return None
    tp, replicas = hw.per_replica, hw.replicas
    usable = tp * (hw.vram_bytes * GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE_BYTES)
    kv_room = usable - weights
    if kv_room <= 0:
        return None
    # Streams spread evenly over the replicas: the busiest replica sets the pace.
    per_replica = math.ceil(concurrency / replicas)
    busy = min(concurrency, replicas)
    kv_per_sequence = modelmath.kv_bytes_per_token(arch) * sequence_tokens
    batch = max(1, min(per_replica, int(kv_room // kv_per_sequence) if kv_per_sequence else
                       per_replica, max_batch or per_replica))
    bandwidth = hw.bandwidth_gbs * 1e9

    if hw.bf16_tflops:
        fp8 = modelmath.quantization_bits(quantization) == 8 and hw.fp8_math
        compute_s = (COMPUTE * (1 if fp8 else NON_FP8_MATH) * 2 * arch.active_params
                     / (tp * hw.bf16_tflops * 1e12))
    else:
        compute_s = 0.0  # unknown: the weights and fixed costs alone

    if engine == "llama.cpp":
        slots = min(batch, max_batch or LLAMACPP_SLOTS)

        def llamacpp(share: float) -> Decode:
            return Decode(busy, slots, active / (tp * bandwidth * share), STEP_MS / 1e3,
                          TOKEN_MS / 1e3 + compute_s)
        law = llamacpp(LLAMACPP_BANDWIDTH_SHARE)
        return Prediction(concurrency, law.tps(), llamacpp(LLAMACPP_BANDWIDTH_SHARE_FLOOR).tps(),
                          slots, law)

    kv_s = (sequence_tokens / 2) * modelmath.kv_bytes_per_token(arch) / (tp * bandwidth)
    weights_s = active / tp / bandwidth
    # A PCIe link not known: the slower one's cost.
    link = TP_MS_NVLINK if hw.nvlink else TP_MS.get(hw.pcie_gen, TP_MS_UNKNOWN)
    token_s = compute_s + TOKEN_MS / 1e3 + kv_s + (link / 1e3 if tp > 1 else 0)

    def law(b: int, weight_pass: float, token_factor: float = 1.0) -> Decode:
        return Decode(busy, b, weight_pass * weights_s, STEP_MS / 1e3, token_factor * token_s)

    expected = law(batch, 1 / max(1.0, tokens_per_pass or 1.0))
    floor = law(batch, WEIGHT_PASS_FLOOR, TOKEN_FLOOR_FACTOR).tps()
    if batch > 1 and weights > MEMORY_STARVED * usable:
        floor = min(floor, law(1, WEIGHT_PASS_FLOOR, TOKEN_FLOOR_FACTOR).tps()
                    * load_gain_floor(batch))
    value = expected.tps()
    if not hw.bf16_tflops and batch > 1:
        value = min(value, floor * LOAD_GAIN_FLOOR)  # no compute figure: stay modest
    return Prediction(concurrency, value, min(floor, value), batch, expected)


def calibrate(points: list[tuple[Decode, float]]) -> tuple[float, float] | None:
    """(weights, tokens): what the time to read the weights and each token's time are multiplied
    by for the decode law to meet what was measured at the fewest and the most streams of
    `points` ((law, measured tok/s) pairs, the same engine and card). The step's fixed cost is
    the engine's own and stays. Where the two do not tell the two times apart (one batch size,
    a measurement no time can meet), both are scaled alike at the most streams. None without a
    point."""
    points = sorted((p for p in points if p[1] > 0), key=lambda p: p[0].batch)
    if not points:
        return None
    (low, low_tps), (high, high_tps) = points[0], points[-1]
    spent_low = low.busy * low.batch / low_tps - low.step_s  # weights + batch x token, seconds
    spent_high = high.busy * high.batch / high_tps - high.step_s
    if high.batch > low.batch and low.weights_s > 0 and high.token_s > 0:
        # weights_s x w + batch x token_s x t = spent, at both batch sizes
        det = low.weights_s * high.batch * high.token_s - high.weights_s * low.batch * low.token_s
        if det:
            w = (spent_low * high.batch * high.token_s - spent_high * low.batch * low.token_s) / det
            t = (low.weights_s * spent_high - high.weights_s * spent_low) / det
            if w > 0 and t > 0:
                return w, t
    scale = max(spent_high, 0.0) / (high.weights_s + high.batch * high.token_s)
    return max(scale, 0.05), max(scale, 0.05)


def load_gain_floor(batch: int) -> float:
    """LOAD_GAIN_FLOOR at LOAD_GAIN_AT streams, growing linearly in log2 of the batch from 1
    at one stream, and no further beyond."""
    if batch <= 1:
        return 1.0
    share = min(1.0, math.log2(batch) / math.log2(LOAD_GAIN_AT))
    return 1 + (LOAD_GAIN_FLOOR - 1) * share


def hardware_from_spec(*, cards: int, spec_bandwidth_gbs: float, vram_bytes: float,
                       spec_tflops: float | None, pcie_gen: int | None = None,
                       nvlink: bool = False, unified_memory: bool = False) -> Hardware:
    """Hardware for a node whose probes did not run: its spec at a measurement's low end."""
    return Hardware(cards=cards, bandwidth_gbs=spec_bandwidth_gbs * SPEC_BANDWIDTH_SHARE,
                    vram_bytes=vram_bytes,
                    bf16_tflops=spec_tflops * SPEC_COMPUTE_SHARE if spec_tflops else None,
                    pcie_gen=pcie_gen, nvlink=nvlink, bandwidth_measured=False,
                    unified_memory=unified_memory)
