"""What a model weighs and what its KV cache costs, from its `config.json` fields. Pure: no ORM.

Verification predicts serving speed from it (the weights read per decoded token, the sequences
that fit beside the weights), and a catalog question such as "does this card hold this model at
this context" is the same arithmetic.

KV bytes per token = 2 (K and V) x layers that keep a per-token cache x KV heads x head dim x
bytes per element (FACTS.md; Llama-3.1-8B at BF16: 131,072 bytes). Hybrid models (Mamba or
linear-attention layers beside full attention) keep per-token KV only in their attention
layers, so the layer types are read, never assumed.
"""

import re
from dataclasses import dataclass

# Bits stored per weight, scales and zero points included, by the quantization names engines
# and agents report (vLLM's --quantization / --dtype words, llama.cpp's GGUF file types).
# GGUF figures are llama.cpp's own bits-per-weight for each type; AWQ/GPTQ 4-bit with a group
# of 128 carries a 16-bit scale and zero per group: 4 + 32/128 = 4.25.
BITS_PER_WEIGHT = {
    "fp32": 32.0, "float32": 32.0,
    "bf16": 16.0, "bfloat16": 16.0, "fp16": 16.0, "float16": 16.0, "f16": 16.0, "half": 16.0,
    "auto": 16.0,
    "fp8": 8.0, "fp8_e4m3": 8.0, "fp8-dynamic": 8.0, "w8a8": 8.0, "int8": 8.0,
    "compressed-tensors": 8.0, "modelopt": 8.0,
    "awq": 4.25, "awq-int4": 4.25, "awq_marlin": 4.25, "gptq": 4.25, "gptq-int4": 4.25,
    "gptq_marlin": 4.25, "int4": 4.25, "w4a16": 4.25, "bitsandbytes": 4.5,
    "nvfp4": 4.5, "mxfp4": 4.25,
    "q8_0": 8.5, "q6_k": 6.56, "q5_k_m": 5.69, "q5_k_s": 5.54, "q5_0": 5.5,
    "q4_k_m": 4.85, "q4_k_s": 4.58, "q4_0": 4.5, "iq4_xs": 4.25, "q3_k_m": 3.91,
    "q2_k": 2.96,
}
DEFAULT_DTYPE_BITS = 16.0  # a checkpoint that names no quantization ships 16-bit weights


@dataclass(frozen=True)
class Architecture:
    """The fields of a model's config.json that size it. `params` is the total parameter
    count; `active_params` what one token runs through (less than params only for MoE)."""

    params: float
    active_params: float
    layers: int
    kv_layers: int  # layers that keep a per-token KV cache (full or sliding attention)
    kv_heads: int
    head_dim: int
    hidden_size: int | None = None
    source: str = ""

    @property
    def hybrid(self) -> bool:
        return self.kv_layers < self.layers


def quantization_bits(quantization: str | None) -> float | None:
    """Bits per weight for a reported quantization name; None for a name we do not know."""
    key = (quantization or "").strip().lower()
    if not key:
        return DEFAULT_DTYPE_BITS
    if key in BITS_PER_WEIGHT:
        return BITS_PER_WEIGHT[key]
    for name, bits in BITS_PER_WEIGHT.items():  # "awq-4bit-g128", "Q4_K_M.gguf"
        if len(name) > 2 and name in key:
            return bits
    return None


def weight_bytes(arch: Architecture, quantization: str | None) -> float | None:
    bits = quantization_bits(quantization)
    return None if bits is None else arch.params * bits / 8


def active_weight_bytes(arch: Architecture, quantization: str | None) -> float | None:
    """Weights one decoded token reads (all of them for a dense model)."""
    bits = quantization_bits(quantization)
    return None if bits is None else arch.active_params * bits / 8


def kv_bytes_per_token(arch: Architecture, kv_bytes_per_element: float = 2.0) -> float:
    return 2 * arch.kv_layers * arch.kv_heads * arch.head_dim * kv_bytes_per_element


# --- reading config.json -----------------------------------------------------------------------

_KV_LAYER_TYPES = {"full_attention", "attention", "sliding_attention", "global", "local",
                   "hybrid_attention"}


def from_config(config: dict, *, params: float | None = None,
                active_params: float | None = None, source: str = "") -> Architecture:
    """An Architecture from a Hugging Face config.json (multimodal configs keep the language
    model's fields under `text_config`). Raises ValueError when a field it needs is missing."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    merged = {**config, **text}
    try:
        layers = int(merged["num_hidden_layers"])
        hidden = int(merged["hidden_size"])
        heads = int(merged["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json lacks {exc}") from None
    kv_heads = int(merged.get("num_key_value_heads") or heads)
    head_dim = int(merged.get("head_dim") or hidden // heads)
    kinds = merged.get("layer_types")
    if isinstance(kinds, list) and kinds:
        kv_layers = sum(1 for kind in kinds if str(kind) in _KV_LAYER_TYPES)
    elif merged.get("full_attention_interval"):
        kv_layers = layers // int(merged["full_attention_interval"])
    else:
        kv_layers = layers
    if params is None:
        params, estimated_active = _params_from_config(merged, layers, hidden, heads, kv_heads,
                                                       head_dim)
        active_params = active_params or estimated_active
    return Architecture(params=float(params), active_params=float(active_params or params),
                        layers=layers, kv_layers=kv_layers, kv_heads=kv_heads,
                        head_dim=head_dim, hidden_size=hidden, source=source)


def _params_from_config(c: dict, layers, hidden, heads, kv_heads, head_dim
                        ) -> tuple[float, float]:
    """Total and active parameters of a decoder from its shapes: embeddings (twice unless
    tied), attention projections and the gated MLP (per expert for MoE) in every layer.
    Linear-attention layers are counted like attention ones: their projections are of the
    same size to within a few per cent of the whole."""
    vocab = int(c.get("vocab_size") or 0)
    embed = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if experts:
        per_expert = 3 * hidden * int(c.get("moe_intermediate_size")
                                      or c.get("intermediate_size") or 0)
        routed = int(c.get("num_experts_per_tok") or 1)
        shared = 3 * hidden * int(c.get("shared_expert_intermediate_size") or 0)
        total = embed + layers * (attention + experts * per_expert + shared)
        active = embed + layers * (attention + routed * per_expert + shared)
        return float(total), float(active)
    mlp = 3 * hidden * int(c.get("intermediate_size") or 4 * hidden)
    total = embed + layers * (attention + mlp)
    return float(total), float(total)


_SIZE = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)[bB](?![A-Za-z])")
_ACTIVE = re.compile(r"(?<![A-Za-z0-9.])[aA](\d+(?:\.\d+)?)[bB](?![A-Za-z])")


def params_from_name(model_id: str) -> tuple[float, float] | None:
    """(total, active) parameters from the size a model's name states ("Llama-3.1-8B", "30B-A3B"),
    the convention of nearly every open checkpoint; None when it states none."""
    name = model_id.rsplit("/", 1)[-1]
    active = _ACTIVE.search(name)
    stripped = _ACTIVE.sub("", name)
    sizes = [float(m.group(1)) for m in _SIZE.finditer(stripped)]
    if not sizes:
        return None
    total = max(sizes) * 1e9
    return total, (float(active.group(1)) * 1e9 if active else total)
