"""What a simulated card serves: any model, any weights, any layout, any number of streams.

A profile's own curve (profiles.py) is what its machine serves its own model at. This module is
the rest of that machine's world: the same card serving another model, the platform's yardstick
or a renter's choice, from the card's `Character`. The platform never reads these figures; it
only measures them through the engine, as it would a real machine.

One decode step of b streams on a replica of `tp` cards reads every weight once (once per
`tokens_per_pass` tokens when the engine decodes speculatively) and does b tokens' work:

    t(b) = weights / (tp x decode bandwidth) / tokens_per_pass + step
           + b x (2 x active parameters / (tp x compute) + token + tensor parallel
                  + context x KV bytes per token / (tp x decode bandwidth))
    output tokens/s = replicas x b / t(b), b the busiest replica's streams

and no more streams decode at once than its KV cache holds. The same law as
verification/predict.py, on purpose: it is how decoding works. What differs is what the platform
cannot know: each card's own decode bandwidth and compute (its `Character`), fitted to the
published fleet figures where there are some (FACTS.md), estimated elsewhere.

Standard library, the agent's modules and marketplace's pure model arithmetic (modelmath: bytes
of weights and KV, which are facts of the model, not a judgment of the card).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from marketplace import modelmath


@dataclass(frozen=True)
class Character:
    """How engines run on one kind of card."""

    # Share of the card's spec bandwidth at which decoding reads the weights.
    decode_share: float
    # Share of the card's spec dense BF16 rate that a decoded token's math reaches; FP8
    # weights run their math in FP8 at twice that on cards that have it (compute capability
    # 8.9 or newer). 4-bit weights (AWQ, GPTQ) are widened to 16 bits for their math.
    compute_share: float
    step_ms: float = 3.3  # fixed cost of one decode step: scheduling, launches, sampling
    token_ms: float = 0.2  # per token and neither weights nor math: detokenise, stream out
    fp8_math: bool = True
    # llama.cpp on this card: its share of the bandwidth, and its math per token (TFLOPS),
    # which is what its parallel slots share.
    llamacpp_share: float = 0.6
    llamacpp_tflops: float | None = None


# The four published machines: `decode_share` and `compute_share` solved so that the 27B at
# 8-bit weights, decoding 3.0 tokens a pass (SPEC_TOKENS_PER_PASS), serves exactly what the fleet
# published alone and under load (FACTS.md: RTX PRO 6000 106 and 1,342 at 32; 2x RTX 4090 94
# and 435; 2x RTX 5090 152 and 1,318; H200 170 and 3,342 at 128). tests/fleetsim/test_physics.py
# holds them to it. The RTX 3090 is an ESTIMATE: the 4090's character on an older card without
# FP8 math. The Mac is an ESTIMATE (no published figure): llama.cpp on Metal reads its weights at
# ~70% of its 546 GB/s, its slots sharing ~6 TFLOPS of matmul (about a third of the 40-core
# GPU's FP16 rate).
CHARACTER: dict[str, Character] = {
    "h200": Character(decode_share=0.806, compute_share=0.544),
    "rtx-pro-6000": Character(decode_share=0.886, compute_share=0.463),
    "rtx-5090": Character(decode_share=0.927, compute_share=0.561),
    "rtx-4090": Character(decode_share=0.841, compute_share=0.692),
    "rtx-3090": Character(decode_share=0.82, compute_share=0.70, fp8_math=False),
    "m4-max": Character(decode_share=0.7, compute_share=0.0, llamacpp_share=0.7,
                        llamacpp_tflops=6.0),
}
# Per token, tensor parallel over PCIe of this generation, and over NVLink.
TP_MS = {3: 3.4, 4: 1.7, 5: 0.25}
NVLINK_TP_MS = 0.12
# Tokens per pass over the weights when the fleet's engines decode with the checkpoint's
# multi-token-prediction head: OUR ESTIMATE (three draft tokens, two accepted on average).
SPEC_TOKENS_PER_PASS = 3.0
# What the load test's requests hold in the KV cache at once: a few hundred prompt tokens and
# their answer.
REQUEST_TOKENS = 640
# Share of the compute rate prefill reaches (large matmuls).
PREFILL_MFU = 0.5


@dataclass(frozen=True)
class Layout:
    """How the engine spreads the cards: replicas of `tp` cards in tensor parallel."""

    gpus: int
    tp: int

    @property
    def replicas(self) -> int:
        return max(1, self.gpus // self.tp)


def kv_tokens(card_memory_bytes: float, layout: Layout, weights_bytes: float, *,
              utilization: float = modelmath.GPU_MEMORY_UTILIZATION,
              kv_bytes_per_token: float) -> int:
    """Tokens of KV cache each replica holds beside its weights."""
    room = layout.tp * (card_memory_bytes * utilization
                        - modelmath.ACTIVATION_RESERVE_BYTES) - weights_bytes
    if room <= 0 or kv_bytes_per_token <= 0:
        return 0
    return int(room / kv_bytes_per_token)


def aggregate_tps(character: Character, *, bandwidth_gbs: float, bf16_tflops: float | None,
                  arch: modelmath.Architecture, quantization: str, engine: str,
                  layout: Layout, streams: int, pcie_gen: int | None = None,
                  nvlink: bool = False, tokens_per_pass: float | None = None,
                  kv_capacity: int | None = None) -> float:
    """Output tokens/s of the whole engine with `streams` requests decoding."""
    if streams <= 0:
        return 0.0
    active = modelmath.active_weight_bytes(arch, quantization) or 0.0
    kv_token = modelmath.kv_bytes_per_token(arch)
    tp, replicas = layout.tp, layout.replicas
    busy = min(streams, replicas)
    batch = math.ceil(streams / replicas)
    if kv_capacity:
        batch = max(1, min(batch, kv_capacity // REQUEST_TOKENS))
    if engine == "llama.cpp":
        bandwidth = bandwidth_gbs * character.llamacpp_share * 1e9
        weights_s = active / (tp * bandwidth)
        math_s = (2 * arch.active_params / (character.llamacpp_tflops * 1e12)
                  if character.llamacpp_tflops else 0.0)
        step = weights_s + character.step_ms / 1e3 + batch * (math_s + character.token_ms / 1e3)
        return busy * batch / step
    bandwidth = bandwidth_gbs * character.decode_share * 1e9
    bits = modelmath.quantization_bits(quantization) or modelmath.DEFAULT_DTYPE_BITS
    rate = (bf16_tflops or 0) * character.compute_share * 1e12
    if bits == 8 and character.fp8_math:
        rate *= 2
    math_s = 2 * arch.active_params / (tp * rate) if rate else 0.0
    link_s = 0.0
    if tp > 1:
        link_s = (NVLINK_TP_MS if nvlink else TP_MS.get(pcie_gen or 4, TP_MS[4])) / 1e3
    kv_s = (REQUEST_TOKENS / 2) * kv_token / (tp * bandwidth)
    weights_s = active / (tp * bandwidth) / max(1.0, tokens_per_pass or 1.0)
    step = (weights_s + character.step_ms / 1e3
            + batch * (math_s + character.token_ms / 1e3 + link_s + kv_s))
    return busy * batch / step


def prefill_tps(character: Character, *, bf16_tflops: float | None,
                arch: modelmath.Architecture, layout: Layout, engine: str) -> float:
    """Uncached prompt tokens a second (one prompt: a replica's cards)."""
    if engine == "llama.cpp" or not bf16_tflops:
        tflops = character.llamacpp_tflops or 4.0
    else:
        tflops = bf16_tflops * layout.tp
    return round(tflops * 1e12 * PREFILL_MFU / (2 * arch.active_params), 1)


def curve_levels(max_streams: int) -> tuple[int, ...]:
    """Where a curve is sampled: powers of two up to the engine's limit (interpolated between)."""
    levels, n = [], 1
    while n < max_streams:
        levels.append(n)
        n *= 2
    return (*levels, max_streams)
