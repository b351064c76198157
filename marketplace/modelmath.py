"""What a model weighs and what its KV cache costs, from its `config.json` fields, and what that
leaves on a card or a node under an engine's rules. Pure: no ORM, plain values in and out.

Verification predicts serving speed from it (the weights read per decoded token, the sequences
that fit beside the weights); the catalog's "runs this model at this context" filter and the
/tools/vram page ask `plan()` and `min_vram_bytes()` the same question: does one sequence of N
tokens fit, how long may one be, and how many of them fit at once. A node's engine command
(engine_config.py: vLLM's --max-model-len and --max-num-seqs, llama.cpp's -c) is sized with the
same layouts and cells.

KV bytes per token = 2 (K and V) x layers that keep a per-token cache x KV heads x head dim x
bytes per element (FACTS.md; Llama-3.1-8B at BF16: 131,072 bytes). Hybrid models (Mamba or
linear-attention layers beside full attention) keep per-token KV only in their attention
layers, so the layer types are read, never assumed; their linear-attention layers keep a state
of fixed size per sequence instead.

The engines do not hand out bytes but blocks, and keep memory for themselves:

- vLLM takes `gpu_memory_utilization` of each GPU (0.9 by default), keeps some of it for
  activations, CUDA graphs and the CUDA context, and cuts the rest into blocks of 16 tokens.
  On a hybrid model every block must also hold one linear-attention layer's state, so the
  attention block grows until its page is at least that state's size (vLLM's
  HybridAttentionMambaModelConfig / _align_hybrid_block_size: 16 x ceil(state / (16 x one
  token's page))): 528 tokens for Qwen3.5-4B, 784 for the 27B at a 16-bit KV cache, 1,568 at
  FP8. Layers are grouped (one group per 16 attention layers and one per 16 linear ones, as
  vLLM's _get_kv_cache_groups_uniform_page_size groups them); a sequence holds
  ceil(tokens / block) blocks in each attention group and, in each linear group, one block
  (two with prefix caching, --mamba-cache-mode align), plus one per speculative token.
  Sources: vllm/v1/kv_cache_interface.py (FullAttentionSpec and MambaSpec
  max_memory_usage_bytes), vllm/v1/core/kv_cache_utils.py (get_num_blocks,
  get_max_concurrency_for_kv_cache_config), vllm/model_executor/layers/mamba/mamba_utils.py
  (gated_delta_net_state_shape), vLLM PR #34489 (Qwen3.5's SSM state in float32, as its
  config.json's mamba_ssm_dtype says). docs/what-fits.md checks the rules against the
  figures vLLM printed for Qwen3.5 and Qwen3.8.
- llama.cpp allocates the KV cache for the whole context at start, rounded up to 256 cells,
  with K and V at its cache type (f16, q8_0, q4_0), and the recurrent state of a hybrid in
  F32, one per parallel slot; it takes no share of the card but needs compute buffers and
  the CUDA context beside the weights (LLAMACPP_RESERVE_BYTES, an estimate).
"""

import math
import re
from dataclasses import dataclass, field, replace

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
    "q4_k_m": 4.85, "q4_k_s": 4.58, "q4_1": 5.0, "q4_0": 4.5, "iq4_xs": 4.25, "q3_k_m": 3.91,
    "q2_k": 2.96,
}
DEFAULT_DTYPE_BITS = 16.0  # a checkpoint that names no quantization ships 16-bit weights


@dataclass(frozen=True)
class LinearAttention:
    """The per-sequence state of one linear-attention (Gated DeltaNet) layer, from config.json's
    `linear_*` fields: a convolution window over the projected keys, queries and values, and
    one key-by-value matrix per value head. Its size does not grow with the context."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    ssm_bytes: int = 2  # per element of the recurrent state: `mamba_ssm_dtype` float32 -> 4

    @property
    def conv_dim(self) -> int:
        return self.key_heads * self.key_head_dim * 2 + self.value_heads * self.value_head_dim


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
    heads: int | None = None  # attention (query) heads: what tensor parallelism must divide
    linear: LinearAttention | None = None  # the other layers' state, on a hybrid model
    # Full-attention layers of the multi-token-prediction head (`mtp_num_hidden_layers`): they
    # keep KV too, but only while the engine decodes speculatively with them.
    draft_layers: int = 0
    max_context: int | None = None  # `max_position_embeddings`
    dtype_bytes: int = 2  # the checkpoint's own dtype, which an "auto" KV cache takes

    @property
    def hybrid(self) -> bool:
        return self.kv_layers < self.layers

    @property
    def linear_layers(self) -> int:
        return self.layers - self.kv_layers if self.linear else 0


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

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
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
    linear = None
    if kv_layers < layers and merged.get("linear_num_value_heads"):
        linear = LinearAttention(
            key_heads=int(merged["linear_num_key_heads"]),
            value_heads=int(merged["linear_num_value_heads"]),
            key_head_dim=int(merged["linear_key_head_dim"]),
            value_head_dim=int(merged["linear_value_head_dim"]),
            conv_kernel=int(merged.get("linear_conv_kernel_dim") or 4),
            ssm_bytes=_DTYPE_BYTES.get(str(merged.get("mamba_ssm_dtype") or ""), 2))
    dtype = str(merged.get("dtype") or merged.get("torch_dtype") or "bfloat16")
    return Architecture(params=float(params), active_params=float(active_params or params),
                        layers=layers, kv_layers=kv_layers, kv_heads=kv_heads,
                        head_dim=head_dim, hidden_size=hidden, source=source, heads=heads,
                        linear=linear, draft_layers=int(merged.get("mtp_num_hidden_layers") or 0),
                        max_context=int(merged["max_position_embeddings"])
                        if merged.get("max_position_embeddings") else None,
                        dtype_bytes=_DTYPE_BYTES.get(dtype, 2))


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


# --- what fits: the engines' rules ---------------------------------------------------------------

GIB = 2**30
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of each GPU it takes
# Per GPU, what vLLM keeps beside the weights and the KV cache: the activations of its profiling
# run, CUDA graphs, the CUDA context and communication buffers. OUR ESTIMATE: vLLM measures it
# at start, and it moves with --max-num-batched-tokens and the graphs it captures.
ACTIVATION_RESERVE_BYTES = 2 * GIB
VLLM_BLOCK_TOKENS = 16  # a plain attention block, and the step a hybrid's block grows by
# vLLM gives each of a hybrid's layer groups as many layers as the smaller kind has, unless the
# larger has fewer than 1.5 times as many (then the larger's count): kv_cache_utils.py.
VLLM_GROUP_SPREAD = 1.5
LLAMACPP_CELL_PAD = 256  # llama.cpp allocates the context rounded up to this many cells
# Per GPU, what llama.cpp needs beside its weights, KV cache and recurrent state: compute
# buffers (with a 248k-token vocabulary, a 512-token batch's logits take ~0.5 GB), the output
# buffer and the CUDA context. OUR ESTIMATE, fitted on one published measurement (Qwen3.5-27B
# Q4_K_M on an RTX 4090 at 2K context) and checked on three others: docs/what-fits.md.
LLAMACPP_RESERVE_BYTES = 3.3 * GIB

# Bytes per cached K or V element, by the names each engine takes for its cache type.
KV_CACHE_BYTES = {
    "vllm": {"auto": None, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
             "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1},
    # GGML blocks of 32 values: q8_0 is 32 bytes plus a 16-bit scale, q4_0 16 plus the scale.
    "llama.cpp": {"f16": 2, "bf16": 2, "f32": 4, "q8_0": 34 / 32, "q4_0": 18 / 32},
}
# Weights only llama.cpp loads (GGUF file types); every other name is a vLLM checkpoint's.
# Q4_1: blocks of 32 weights, 16 bytes of 4-bit values plus a 16-bit scale and a 16-bit
# minimum, 20 bytes a block (ggml's block_q4_1): 5.0 bits a weight.
GGUF_TYPES = {"q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_0", "q4_k_m", "q4_k_s", "q4_1", "q4_0",
              "iq4_xs", "q3_k_m", "q2_k"}
ENGINES = ("vllm", "llama.cpp")


@dataclass(frozen=True)
class Engine:
    """The settings of a node's engine that decide its memory."""

    kind: str = "vllm"
    kv_cache_dtype: str = "auto"  # vLLM: auto (the model's dtype) or fp8; llama.cpp: f16, q8_0...
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    reserve_bytes: float = ACTIVATION_RESERVE_BYTES  # per GPU
    speculative_tokens: int = 0  # multi-token prediction's draft tokens per step (vLLM)
    # A hybrid's prefix caching (vLLM's --mamba-cache-mode align) keeps a second state block per
    # sequence. On by default: routing sends a conversation back to the worker that cached it.
    prefix_caching: bool = True


VLLM = Engine()
LLAMA_CPP = Engine(kind="llama.cpp", kv_cache_dtype="f16", gpu_memory_utilization=1.0,
                   reserve_bytes=LLAMACPP_RESERVE_BYTES, prefix_caching=False)


def engine_for(quantization: str | None, kv_cache_dtype: str | None = None) -> Engine:
    """The engine that loads these weights (GGUF files: llama.cpp; any other: vLLM), at its
    default settings and, if given, this KV cache type. Raises ValueError for a cache type that
    engine does not have."""
    base = LLAMA_CPP if (quantization or "").strip().lower() in GGUF_TYPES else VLLM
    if not kv_cache_dtype:
        return base
    dtype = kv_cache_dtype.strip().lower()
    if dtype not in KV_CACHE_BYTES[base.kind]:
        raise ValueError(f"{base.kind} has no '{kv_cache_dtype}' KV cache "
                         f"(it takes {', '.join(KV_CACHE_BYTES[base.kind])}).")
    return replace(base, kv_cache_dtype=dtype)


def kv_element_bytes(arch: Architecture, engine: Engine) -> float:
    try:
        size = KV_CACHE_BYTES[engine.kind][engine.kv_cache_dtype]
    except KeyError:
        raise ValueError(f"{engine.kind} has no '{engine.kv_cache_dtype}' KV cache.") from None
    return arch.dtype_bytes if size is None else size


def linear_state_bytes(arch: Architecture, *, gpus: int = 1, speculative_tokens: int = 0,
                       conv_bytes: float | None = None, ssm_bytes: float | None = None) -> float:
    """One linear-attention layer's state for one sequence on one of `gpus` GPUs: the convolution
    window (kernel - 1 inputs, plus one per draft token) and the recurrent matrices
    (gated_delta_net_state_shape); 0 on a model without such layers."""
    lin = arch.linear
    if lin is None:
        return 0.0
    conv = lin.conv_dim // gpus * (lin.conv_kernel - 1 + speculative_tokens)
    ssm = lin.value_heads // gpus * lin.key_head_dim * lin.value_head_dim
    return (conv * (arch.dtype_bytes if conv_bytes is None else conv_bytes)
            + ssm * (lin.ssm_bytes if ssm_bytes is None else ssm_bytes))


@dataclass(frozen=True)
class KvLayout:
    """How vLLM lays out one sequence's cache on each GPU: in blocks of `block_tokens` tokens,
    each `block_bytes` (one page in each of the layers that share a block id)."""

    block_tokens: int
    block_bytes: int
    attention_groups: int  # blocks a sequence takes per `block_tokens` of context
    state_blocks: int  # blocks a sequence takes whatever its length (linear-attention state)
    layers_per_group: int
    attention_layers: int  # the model's, plus the draft head's while it decodes
    state_bytes: float  # one linear layer's state, before vLLM pads it to a page

    def blocks_for(self, tokens: int) -> int:
        return self.attention_groups * -(-tokens // self.block_tokens) + self.state_blocks


def vllm_layout(arch: Architecture, engine: Engine = VLLM, gpus: int = 1) -> KvLayout:
    kv_heads = max(1, arch.kv_heads // gpus)
    token_page = int(2 * kv_heads * arch.head_dim * kv_element_bytes(arch, engine))
    attention = arch.kv_layers + (arch.draft_layers if engine.speculative_tokens else 0)
    block, state, state_blocks = VLLM_BLOCK_TOKENS, 0.0, 0
    groups, per_group = 1, attention
    if arch.linear is not None and arch.linear_layers:
        state = linear_state_bytes(arch, gpus=gpus, speculative_tokens=engine.speculative_tokens)
        step = VLLM_BLOCK_TOKENS * token_page
        block = VLLM_BLOCK_TOKENS * -(-int(state) // step)
        few, many = sorted((attention, arch.linear_layers))
        per_group = many if many < VLLM_GROUP_SPREAD * few else few
        groups = -(-attention // per_group)
        per_state = (2 if engine.prefix_caching else 1) + engine.speculative_tokens
        state_blocks = -(-arch.linear_layers // per_group) * per_state
    return KvLayout(block_tokens=block, block_bytes=block * token_page * per_group,
                    attention_groups=groups, state_blocks=state_blocks,
                    layers_per_group=per_group, attention_layers=attention, state_bytes=state)


def shard_problem(arch: Architecture, gpus: int, engine: Engine = VLLM) -> str | None:
    """Why vLLM cannot split this model over `gpus` GPUs in tensor parallel (it divides heads
    among them), or None. llama.cpp splits by layers and takes any count."""
    if gpus < 1:
        return "A node has at least one GPU."
    if engine.kind != "vllm" or gpus == 1:
        return None
    if arch.heads and arch.heads % gpus:
        return f"Its {arch.heads} attention heads do not split evenly over {gpus} GPUs."
    if (arch.kv_heads % gpus if gpus < arch.kv_heads else gpus % arch.kv_heads):
        return f"Its {arch.kv_heads} KV heads do not split evenly over {gpus} GPUs."
    lin = arch.linear
    if lin and (lin.value_heads % gpus or lin.key_heads % gpus):
        return f"Its linear-attention heads do not split evenly over {gpus} GPUs."
    return None


@dataclass(frozen=True)
class Plan:
    """What a card (gpus=1) or a node holds of a model at a context, one sequence and many."""

    fits: bool  # one sequence of `context` tokens
    context: int
    gpus: int
    vram_bytes: float  # per GPU
    weights_bytes: float  # all GPUs together
    kv_bytes: float  # one sequence of `context` tokens as the engine holds it, all GPUs
    kv_room_bytes: float  # what the engine leaves for the cache beside the weights, all GPUs
    max_context: int  # the longest one sequence may be here (0: not even the weights fit)
    sequences: int  # sequences of `context` tokens the cache holds at once
    block_tokens: int  # vLLM's block; llama.cpp's cell padding
    reasons: tuple[str, ...] = field(default=())  # why it does not fit, in the product's words


def gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def _check(arch: Architecture, quantization: str | None, context: int, engine: Engine) -> float:
    if arch.kv_heads < 1 or arch.head_dim < 1 or arch.kv_layers < 1:
        raise ValueError("The model's attention layers are not known.")
    if engine.kind not in ENGINES:
        raise ValueError(f"Unknown engine '{engine.kind}'.")
    if context < 1:
        raise ValueError("The context is at least one token.")
    weights = weight_bytes(arch, quantization)
    if weights is None:
        raise ValueError(f"Unknown quantization '{quantization}'.")
    kv_element_bytes(arch, engine)  # raises for a cache type the engine does not have
    return weights


def plan(arch: Architecture, *, quantization: str | None, context: int, vram_bytes: float,
         gpus: int = 1, engine: Engine = VLLM) -> Plan:
    """Whether `gpus` GPUs of `vram_bytes` each hold the model's weights at `quantization` and
    one sequence of `context` tokens under the engine's rules; the longest sequence they hold;
    how many sequences of `context` tokens fit at once. Raises ValueError for input no engine
    takes (an unknown quantization, a cache type the engine lacks, a context below 1)."""
    weights = _check(arch, quantization, context, engine)
    problem = shard_problem(arch, gpus, engine)
    limit = arch.max_context or context
    if engine.kind == "vllm":
        result = _plan_vllm(arch, weights, context, vram_bytes, gpus, engine)
    else:
        result = _plan_llamacpp(arch, weights, context, vram_bytes, gpus, engine)
    reasons = list(result.reasons)
    if problem:
        reasons.insert(0, problem)
    if context > limit:
        reasons.insert(0, f"The model reads at most {limit:,} tokens.")
    fits = result.fits and not problem and context <= limit
    return replace(result, fits=fits, reasons=tuple(reasons),
                   max_context=0 if problem else min(result.max_context, limit),
                   sequences=result.sequences if fits else 0)


def _room_reasons(weights, room, kv, context, usable, gpus) -> list[str]:
    where = "the GPUs" if gpus > 1 else "the card"
    if room <= 0:
        return [f"The weights ({gib(weights)}) do not fit in the {gib(usable)} the engine gets "
                f"of {where}."]
    if kv > room:
        return [f"{context:,} tokens need {gib(kv)} of KV cache; {gib(room)} are left beside "
                f"the weights."]
    return []


def _plan_vllm(arch, weights, context, vram_bytes, gpus, engine) -> Plan:
    layout = vllm_layout(arch, engine, gpus)
    usable = vram_bytes * engine.gpu_memory_utilization - engine.reserve_bytes
    room = usable - weights / gpus  # per GPU
    blocks = max(0, math.floor(room / layout.block_bytes)) if room > 0 else 0
    need = layout.blocks_for(context)
    longest = max(0, (blocks - layout.state_blocks) // layout.attention_groups) \
        * layout.block_tokens
    return Plan(fits=need <= blocks, context=context, gpus=gpus, vram_bytes=vram_bytes,
                weights_bytes=weights, kv_bytes=need * layout.block_bytes * gpus,
                kv_room_bytes=room * gpus, max_context=longest, sequences=blocks // need,
                block_tokens=layout.block_tokens,
                reasons=tuple(_room_reasons(weights, room * gpus,
                                            need * layout.block_bytes * gpus, context,
                                            usable * gpus, gpus)))


def llamacpp_kv_bytes(arch: Architecture, tokens: int, *, engine: Engine = LLAMA_CPP,
                      sequences: int = 1) -> float:
    """llama.cpp's cache for `sequences` slots of `tokens` each (its -np and -c): the cells
    rounded up to LLAMACPP_CELL_PAD, plus each slot's recurrent state in F32."""
    cells = -(-tokens * sequences // LLAMACPP_CELL_PAD) * LLAMACPP_CELL_PAD
    per_cell = 2 * arch.kv_layers * arch.kv_heads * arch.head_dim * kv_element_bytes(arch, engine)
    state = arch.linear_layers * linear_state_bytes(arch, conv_bytes=4, ssm_bytes=4)
    return cells * per_cell + sequences * state


def _plan_llamacpp(arch, weights, context, vram_bytes, gpus, engine) -> Plan:
    usable = gpus * (vram_bytes * engine.gpu_memory_utilization - engine.reserve_bytes)
    room = usable - weights
    kv = llamacpp_kv_bytes(arch, context, engine=engine)
    per_cell = llamacpp_kv_bytes(arch, LLAMACPP_CELL_PAD, engine=engine) \
        - llamacpp_kv_bytes(arch, 0, engine=engine)
    state = llamacpp_kv_bytes(arch, 0, engine=engine)
    cells = math.floor((room - state) / per_cell) if room > state else 0
    n = max(0, math.floor(room / kv)) if room > 0 else 0
    while n and llamacpp_kv_bytes(arch, context, engine=engine, sequences=n) > room:
        n -= 1
    return Plan(fits=kv <= room, context=context, gpus=gpus, vram_bytes=vram_bytes,
                weights_bytes=weights, kv_bytes=kv, kv_room_bytes=room,
                max_context=cells * LLAMACPP_CELL_PAD, sequences=n,
                block_tokens=LLAMACPP_CELL_PAD,
                reasons=tuple(_room_reasons(weights, room, kv, context, usable, gpus)))


def min_vram_bytes(arch: Architecture, *, quantization: str | None, context: int,
                   gpus: int = 1, engine: Engine = VLLM) -> float | None:
    """The least memory each of `gpus` GPUs must have for `plan()` to say one sequence of
    `context` tokens fits; None when no amount does (a context beyond the model's, heads that
    do not split). Raises ValueError as plan() does."""
    weights = _check(arch, quantization, context, engine)
    if shard_problem(arch, gpus, engine) or context > (arch.max_context or context):
        return None
    if engine.kind == "vllm":
        layout = vllm_layout(arch, engine, gpus)
        room = layout.blocks_for(context) * layout.block_bytes
        return (room + weights / gpus + engine.reserve_bytes) / engine.gpu_memory_utilization
    kv = llamacpp_kv_bytes(arch, context, engine=engine)
    return ((kv + weights) / gpus + engine.reserve_bytes) / engine.gpu_memory_utilization


def min_vram_mib(arch: Architecture, **kwargs) -> int | None:
    """min_vram_bytes() in whole MiB, as NVML reports a card's memory: the least such reading
    that plan() accepts (rounded up, then checked, so that float rounding never lets a card
    one MiB short through)."""
    need = min_vram_bytes(arch, **kwargs)
    if need is None:
        return None
    mib = math.ceil(need / 2**20)
    for extra in range(4):  # a float's rounding is worth a byte, never a MiB
        if plan(arch, vram_bytes=(mib + extra) * 2**20, **kwargs).fits:
            return mib + extra
    raise AssertionError(f"plan() and min_vram_bytes() disagree at {mib} MiB")
