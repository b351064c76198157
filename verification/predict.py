"""What a node should serve, from first principles: its own measured bandwidth, VRAM and
compute, the model's architecture, the engine and tensor parallelism. Pure: plain values.

One decode step of a batch of b sequences reads every weight once and does the work of b
tokens, so it takes

    t(b) = t_weights + b * t_token,   output tokens/s = b / t(b)

    t_weights = WEIGHT_PASS * (weight bytes per card / card bandwidth) + STEP_MS
    t_token   = COMPUTE * (2 * active parameters / (cards * card BF16 FLOP/s))
                + TOKEN_MS + TP_MS[PCIe generation] (tensor parallel only)
                + context * KV bytes per token / (cards * card bandwidth)

and only as many sequences decode at once as the KV cache holds beside the weights.

The factors are fitted to the eight published fleet figures (FACTS.md: RTX PRO 6000 106 alone
and 1,342 at 32; 2x RTX 4090 94 and 435; 2x RTX 5090 152 and 1,318; H200 170 alone and 3,342
at 128), with each card's bandwidth and BF16 rate as a correct measurement reads them and the
27B at 8-bit weights. The fit reproduces all eight within 2.5% (tests/verification/
test_predict.py), but it is six factors for eight figures of four machines, and two of them
say something the figures cannot prove:

- WEIGHT_PASS 0.344: one stream gets ~2.9 tokens per pass over the weights. No engine does
  that without multi-token prediction or speculative decoding; 8-bit weights are the only
  reading under which all four single-stream figures fit one bandwidth law at all (16-bit
  weights would need ~5.7 tokens a pass). A provider without speculative decoding serves
  about half as fast alone, honestly.
- TP_MS: the per-token cost of tensor parallel over PCIe, 1.66 ms on Gen4 (the 4090 pair) and
  0.23 ms on Gen5 (the 5090 pair): one pair each, so a fit, not a law. No NVLink pair is
  published; NVLink is faster than either link, so its cost is taken as Gen5's at most.

Verification therefore judges against `floor`, not `expected`: the prediction with no
speculative decoding (WEIGHT_PASS 1), twice the fleet's per-token costs (TOKEN_FLOOR_FACTOR:
an engine built or tuned worse than the fleet's), and the slower tensor-parallel cost where the
link is not known. A node whose weights fill more than half of the memory it gives the engine
(MEMORY_STARVED) batches poorly: the fleet saw two 24 GB replicas of the 27B lose to one
tensor-parallel pair by 2-4x. Its floor under load is no more than the smallest batching gain
the fleet published (LOAD_GAIN_FLOOR: the 4090 pair's 435 / 94 at 32) over its single-stream
floor. No published configuration falls below 85% of its floor; a card that does is far slower
than its hardware allows.
"""

import math
from dataclasses import dataclass

from marketplace import modelmath

FLEET_SOURCE = ("fitted to the published fleet figures (FACTS.md): RTX PRO 6000, 2x RTX 4090, "
                "2x RTX 5090, H200 serving a 27B model on vLLM")

# vLLM, fitted (see the module's docstring); each factor with what it stands for.
WEIGHT_PASS = 0.344  # share of a full pass over the weights per decoded token, one stream
WEIGHT_PASS_FLOOR = 1.0  # no multi-token prediction: one token per pass
STEP_MS = 3.29  # fixed cost of a decode step (scheduling, launches, sampling)
COMPUTE = 0.816  # per-token FLOPs over the card's measured BF16 rate (8-bit math runs ~2x)
TOKEN_MS = 0.183  # per-token cost that is neither weights nor FLOPs (detokenise, stream out)
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
# estimate), and its parallel slots share a weight read but batch poorly, so no gain is
# counted under load.
LLAMACPP_BANDWIDTH_SHARE = 0.65
LLAMACPP_BANDWIDTH_SHARE_FLOOR = 0.45

# vLLM's default share of each card, and what it keeps per card beside weights and KV: the
# same figures the catalog's "what fits" answers with.
GPU_MEMORY_UTILIZATION = modelmath.GPU_MEMORY_UTILIZATION
ACTIVATION_RESERVE_BYTES = modelmath.ACTIVATION_RESERVE_BYTES
# A correct STREAM method reads 81-96% of the spec (FACTS.md): where a card's bandwidth was not
# measured, its spec is taken at the low end.
SPEC_BANDWIDTH_SHARE = 0.81
SPEC_COMPUTE_SHARE = 0.7  # a dense GEMM's usual share of the datasheet rate
SEQUENCE_TOKENS = 2048  # a load-test request: a few hundred prompt tokens plus its output


@dataclass(frozen=True)
class Hardware:
    """One node as it serves: `cards` GPUs in tensor parallel, each as measured (or spec)."""

    cards: int
    bandwidth_gbs: float  # per card, the slowest card's: tensor parallel waits for it
    vram_bytes: float  # per card
    bf16_tflops: float | None  # per card; None: unknown
    pcie_gen: int | None = None  # the PCIe link tensor parallel crosses (None: unknown)
    bandwidth_measured: bool = True
    unified_memory: bool = False
    nvlink: bool = False  # the cards are joined by NVLink: tensor parallel crosses it instead


@dataclass(frozen=True)
class Prediction:
    concurrency: int
    expected: float  # the fitted prediction (a fleet-like engine set-up)
    floor: float  # what any sound set-up reaches at least: the basis of a judgment
    batch: int  # sequences that decode at once (the KV cache's limit included)


def predict(hw: Hardware, arch: modelmath.Architecture, *, engine: str,
            quantization: str | None, concurrency: int,
            sequence_tokens: int = SEQUENCE_TOKENS) -> Prediction | None:
    """None when the weights' size is unknown (a quantization name we cannot read) or they
    do not fit the node at all."""
    weights = modelmath.weight_bytes(arch, quantization)
    active = modelmath.active_weight_bytes(arch, quantization)
    if not weights or not active or hw.cards < 1 or hw.bandwidth_gbs <= 0:
        return None
    usable = hw.cards * (hw.vram_bytes * GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE_BYTES)
    kv_room = usable - weights
    if kv_room <= 0:
        return None
    kv_per_sequence = modelmath.kv_bytes_per_token(arch) * sequence_tokens
    batch = max(1, min(concurrency, int(kv_room // kv_per_sequence) if kv_per_sequence else
                       concurrency))
    bandwidth = hw.bandwidth_gbs * 1e9

    if engine == "llama.cpp":
        single = bandwidth * hw.cards / active
        return Prediction(concurrency, single * LLAMACPP_BANDWIDTH_SHARE,
                          single * LLAMACPP_BANDWIDTH_SHARE_FLOOR, batch)

    if hw.bf16_tflops:
        compute_s = COMPUTE * 2 * arch.active_params / (hw.cards * hw.bf16_tflops * 1e12)
    else:
        compute_s = 0.0  # unknown: the weights and fixed costs alone
    kv_s = (sequence_tokens / 2) * modelmath.kv_bytes_per_token(arch) / (hw.cards * bandwidth)
    weights_s = active / hw.cards / bandwidth

    def tokens_per_s(b: int, weight_pass: float, tp_ms: float, token_factor: float = 1.0
                     ) -> float:
        t_weights = weight_pass * weights_s + STEP_MS / 1e3
        t_token = token_factor * (compute_s + TOKEN_MS / 1e3 + kv_s
                                  + (tp_ms / 1e3 if hw.cards > 1 else 0))
        return b / (t_weights + b * t_token)

    # A PCIe link not known: the slower one's cost.
    tp = TP_MS_NVLINK if hw.nvlink else TP_MS.get(hw.pcie_gen, TP_MS_UNKNOWN)
    expected = tokens_per_s(batch, WEIGHT_PASS, tp)
    floor = tokens_per_s(batch, WEIGHT_PASS_FLOOR, tp, TOKEN_FLOOR_FACTOR)
    if batch > 1 and weights > MEMORY_STARVED * usable:
        floor = min(floor, tokens_per_s(1, WEIGHT_PASS_FLOOR, tp, TOKEN_FLOOR_FACTOR)
                    * load_gain_floor(batch))
    if not hw.bf16_tflops and batch > 1:
        expected = min(expected, floor * LOAD_GAIN_FLOOR)  # no compute figure: stay modest
    return Prediction(concurrency, expected, floor, batch)


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
