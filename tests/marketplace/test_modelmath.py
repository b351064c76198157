"""What fits, with plain values: KV per token from config.json fields, the engines' block and
state rules, and the figures vLLM and llama.cpp printed for real models (FACTS.md,
docs/what-fits.md)."""

import math

import pytest

from marketplace import modelmath as mm
from marketplace.model_data import architecture_for

GIB, MIB = 2**30, 2**20
LLAMA_8B = architecture_for("meta-llama/Llama-3.1-8B-Instruct")
QWEN_27B = architecture_for("Qwen/Qwen3.5-27B")
QWEN_4B = architecture_for("Qwen/Qwen3.5-4B")
FP8_KV = mm.Engine(kv_cache_dtype="fp8")


# --- KV per token from config.json ---------------------------------------------------------------

@pytest.mark.parametrize("arch, kv_bytes, per_token", [
    # FACTS.md: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072 = 128 KiB.
    (LLAMA_8B, 2, 131_072),
    # One layer in four keeps a cache: 2 x 16 x 4 x 256 x 2 bytes = 64 KiB.
    (QWEN_27B, 2, 65_536),
    (QWEN_27B, 1, 32_768),
    (QWEN_4B, 2, 2 * 8 * 4 * 256 * 2),
])
def test_kv_bytes_per_token_from_config_fields(arch, kv_bytes, per_token):
    assert mm.kv_bytes_per_token(arch, kv_bytes) == per_token


def test_the_layer_types_are_read_not_assumed():
    assert (QWEN_27B.layers, QWEN_27B.kv_layers, QWEN_27B.linear_layers) == (64, 16, 48)
    assert not LLAMA_8B.hybrid and LLAMA_8B.linear is None and LLAMA_8B.linear_layers == 0
    explicit = mm.from_config({"num_hidden_layers": 4, "hidden_size": 64,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "layer_types": ["linear_attention", "linear_attention",
                                               "full_attention", "sliding_attention"]})
    assert explicit.kv_layers == 2 and explicit.linear is None  # no linear_* fields given


def test_the_qwen35_linear_state_from_its_config_fields():
    """Gated DeltaNet: a conv window of 3 over (16 x 128 x 2 + 48 x 128) channels in BF16, and
    48 matrices of 128 x 128 in float32 (mamba_ssm_dtype)."""
    assert QWEN_27B.linear.conv_dim == 10_240 and QWEN_27B.linear.ssm_bytes == 4
    assert mm.linear_state_bytes(QWEN_27B) == 10_240 * 3 * 2 + 48 * 128 * 128 * 4
    # Tensor parallel splits the heads; each draft token widens the conv window by one.
    assert mm.linear_state_bytes(QWEN_27B, gpus=2, speculative_tokens=3) == (
        5_120 * 6 * 2 + 24 * 128 * 128 * 4)


def test_a_context_beyond_the_config_is_refused():
    p = mm.plan(QWEN_27B, quantization="bf16", context=300_000, vram_bytes=141 * GIB)
    assert not p.fits and p.reasons[0] == "The model reads at most 262,144 tokens."
    assert mm.min_vram_bytes(QWEN_27B, quantization="bf16", context=300_000) is None


# --- vLLM's blocks, against the figures vLLM printed --------------------------------------------

@pytest.mark.parametrize("arch, engine, gpus, block, source", [
    # vllm-project/vllm#40696: "Setting attention block size to 528 tokens" for Qwen3.5-4B (BF16).
    (QWEN_4B, mm.VLLM, 1, 528, "vllm#40696"),
    # LMCache's Qwen3.5/3.6 recipe: unified block size 784 for the 27B on one GPU (Qwen3.6-27B,
    # the same config fields).
    (QWEN_27B, mm.VLLM, 1, 784, "LMCache recipe"),
    # A Qwen3.8-27B-FP8 deployment (same fields) on 2x RTX 3090, fp8 KV: 1,568-token blocks.
    (QWEN_27B, FP8_KV, 2, 1_568, "mitchross/talos-argocd-proxmox#1995"),
    (LLAMA_8B, mm.VLLM, 1, 16, "plain attention"),
])
def test_vllm_block_size_matches_what_vllm_printed(arch, engine, gpus, block, source):
    assert mm.vllm_layout(arch, engine, gpus).block_tokens == block, source


def test_the_published_llama_8b_kv_cache_lines_on_an_rtx_3090():
    """vllm-project/vllm#10517, Llama-3.1-8B on an RTX 3090: kv_cache_size=3.81GiB gave 1952 blocks
    and "Maximum concurrency for 20000 tokens per request: 1.56x"; 2.89 GiB gave 1478 blocks,
    "the maximum number of tokens that can be stored in KV cache (23648)". A block is 16
    tokens of 128 KiB: 2 MiB."""
    layout = mm.vllm_layout(LLAMA_8B)
    assert layout.block_bytes == 16 * 131_072 == 2 * MIB
    assert f"{1952 * layout.block_bytes / GIB:.2f}" == "3.81"
    assert f"{1952 / layout.blocks_for(20_000):.2f}" == "1.56"
    assert f"{1478 * layout.block_bytes / GIB:.2f}" == "2.89"
    assert 1478 * layout.block_tokens == 23_648


def test_the_published_qwen_27b_fp8_kv_pool_on_two_rtx_3090s():
    """The same deployment's boot log (TP=2, fp8 KV, prefix caching, no speculative decoding):
    a 4.99 GiB pool per GPU, "GPU KV cache size: 302,921 tokens" and "Maximum concurrency for
    131,072 tokens per request: 2.31x". vLLM prints int(concurrency x max_model_len); the
    concurrency is the pool's blocks over a request's: 84 attention blocks of 1,568 tokens and
    2 state blocks (align mode) in each of the 3 groups of 16 linear layers."""
    layout = mm.vllm_layout(QWEN_27B, FP8_KV, gpus=2)
    assert (layout.layers_per_group, layout.attention_groups, layout.state_blocks) == (16, 1, 6)
    # Any pool that prints as 4.99 GiB (4.985-4.995) holds 208 blocks.
    assert {math.floor(g * GIB / layout.block_bytes) for g in (4.985, 4.99, 4.995)} == {208}
    per_request = layout.blocks_for(131_072)
    assert per_request == 84 + 6
    concurrency = 208 / per_request
    assert f"{concurrency:.2f}" == "2.31"
    assert int(concurrency * 131_072) == 302_921


def test_qwen_27b_at_its_full_context_against_the_published_9_3_gib():
    """FACTS.md: "A full 262,144-token request of that 27B model needs ~9.3 GiB of KV cache".

    The naive figure is 16 GiB at a 16-bit cache (64 KiB x 262,144) and 8 GiB at FP8; vLLM adds
    its block rounding and the linear layers' state blocks. Neither cache type gives 9.3 GiB
    alone. What does, within 1%, is an FP8 cache with the checkpoint's multi-token-prediction
    head drafting (its full-attention layer keeps KV too: 17 layers in groups of 17, and each
    draft token widens the conv state and takes a state block): 3 draft tokens with prefix
    caching (--mamba-cache-mode align), 9.29 GiB, or 4 without it, 9.33 GiB. The fleet's other
    published figures point to the first: prefix caching worked on it (FACTS.md: 7.2 s -> 1.6 s
    on a repeated prompt), and its single-stream speed needs ~2.9 tokens per pass over the
    weights (verification/predict.py), which multi-token prediction gives. The fleet did not
    publish its flags: this is the reading that reproduces the figure from the config and
    vLLM's rules, not a confirmation of it (docs/what-fits.md lists every candidate)."""
    tokens = 262_144

    def needs(**settings) -> float:
        engine = mm.Engine(**settings)
        return mm.vllm_layout(QWEN_27B, engine).blocks_for(tokens) \
            * mm.vllm_layout(QWEN_27B, engine).block_bytes

    # 16-bit cache: 335 blocks of 784 tokens + 3 groups x 2 state blocks, 784 x 4 KiB x 16 each.
    assert needs() == (335 + 6) * 784 * 4_096 * 16  # 16.3 GiB
    # FP8: 168 blocks of 1,568 tokens + 6, 1,568 x 2 KiB x 16 each.
    assert needs(kv_cache_dtype="fp8") == (168 + 6) * 1_568 * 2_048 * 16  # 8.3 GiB
    fleet = needs(kv_cache_dtype="fp8", speculative_tokens=3)
    # 1,600-token blocks (the conv window grows by 3) x 17 layers: 164 + 3 groups x (2 + 3).
    assert fleet == (164 + 15) * 1_600 * 2_048 * 17
    assert fleet == pytest.approx(9.3 * GIB, rel=0.01)
    # With prefix caching, two or four draft tokens miss by ~2%: the tolerance tells them apart.
    for n in (2, 4):
        assert needs(kv_cache_dtype="fp8", speculative_tokens=n) != pytest.approx(
            9.3 * GIB, rel=0.01)
    # Without it, four draft tokens hit too; three do not.
    assert needs(kv_cache_dtype="fp8", speculative_tokens=4, prefix_caching=False) == (
        pytest.approx(9.3 * GIB, rel=0.01))
    assert needs(kv_cache_dtype="fp8", speculative_tokens=3, prefix_caching=False) != (
        pytest.approx(9.3 * GIB, rel=0.01))


def test_a_plain_attention_model_on_vllm():
    """Llama-3.1-8B has no hybrid cache: 16-token blocks of all 32 layers, nothing per sequence
    beyond its tokens. On a 24 GB RTX 4090 (24,564 MiB) at BF16: 90% of the card less 2 GiB,
    less 16.06 GB of weights, leaves 2,371 blocks of 2 MiB."""
    card = 24_564 * MIB
    p = mm.plan(LLAMA_8B, quantization="bf16", context=8_192, vram_bytes=card)
    room = card * 0.9 - 2 * GIB - 8.03e9 * 2
    blocks = math.floor(room / (2 * MIB))
    assert blocks == 2_371
    assert p.fits and p.block_tokens == 16
    assert p.kv_bytes == 8_192 * 131_072  # 512 blocks: no rounding at a multiple of 16
    assert p.sequences == blocks // 512 == 4
    assert p.max_context == min(blocks * 16, 131_072) == 37_936
    full = mm.plan(LLAMA_8B, quantization="bf16", context=131_072, vram_bytes=card)
    assert not full.fits and full.kv_bytes == 16 * GIB
    assert full.reasons == ("131,072 tokens need 16.0 GiB of KV cache; 4.6 GiB are left beside "
                            "the weights.",)


# --- cards and nodes -----------------------------------------------------------------------------

@pytest.mark.parametrize("quant, vram_mib, gpus, fits, longest, sequences", [
    # RTX PRO 6000 (96 GiB), BF16 weights and cache: 712 blocks of 784 tokens, 341 a request.
    ("bf16", 96 * 1024, 1, True, 262_144, 2),
    # H200 (143,771 MiB): 1,637 blocks.
    ("bf16", 143_771, 1, True, 262_144, 4),
    # One RTX 4090 at AWQ: 130 blocks, 124 of them for tokens.
    ("awq", 24_564, 1, False, 124 * 784, 0),
    # One 4090 cannot hold the FP8 weights (25.1 GiB) at all...
    ("fp8", 24_564, 1, False, 0, 0),
    # ...two in tensor parallel can: 12.6 GiB of weights each, 278 blocks of 1,568 tokens
    # (each GPU keeps 2 of the 4 KV heads and 24 of the 48 linear heads).
    ("fp8", 24_564, 2, True, 262_144, 1),
])
def test_qwen_27b_on_cards_and_nodes(quant, vram_mib, gpus, fits, longest, sequences):
    engine = FP8_KV if gpus == 2 else mm.VLLM
    p = mm.plan(QWEN_27B, quantization=quant, context=262_144, vram_bytes=vram_mib * MIB,
                gpus=gpus, engine=engine)
    assert (p.fits, p.max_context, p.sequences) == (fits, longest, sequences)
    assert p.fits == (not p.reasons)


def test_weights_that_do_not_fit_say_so():
    p = mm.plan(QWEN_27B, quantization="fp8", context=4_096, vram_bytes=24_564 * MIB)
    assert p.reasons == ("The weights (25.1 GiB) do not fit in the 19.6 GiB the engine gets of "
                         "the card.",)


def test_tensor_parallel_needs_heads_that_split():
    p = mm.plan(QWEN_27B, quantization="bf16", context=4_096, vram_bytes=80 * GIB, gpus=3)
    assert not p.fits and p.reasons[0] == "Its 4 KV heads do not split evenly over 3 GPUs."
    assert mm.min_vram_bytes(QWEN_27B, quantization="bf16", context=4_096, gpus=3) is None
    # llama.cpp splits by layers: any count.
    assert mm.shard_problem(QWEN_27B, 3, mm.LLAMA_CPP) is None


def test_concurrent_sequences_shrink_as_the_context_grows():
    card = 96 * GIB
    counts = [mm.plan(QWEN_27B, quantization="bf16", context=n, vram_bytes=card).sequences
              for n in (4_096, 32_768, 131_072, 262_144)]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1
    # 712 blocks; a request of 4,096 tokens takes 6 of 784 tokens and 6 state blocks.
    assert counts[0] == 712 // 12


# --- llama.cpp -----------------------------------------------------------------------------------

# A published RTX 4090 measurement of Qwen3.5-27B on llama.cpp (tianchengwu.com, "Running
# Qwen-3.5-27B on RTX 4090"), q4_0 KV cache, VRAM in MiB as nvidia-smi reads it. The 2K reading
# of Q4_K_M is what LLAMACPP_RESERVE_BYTES was fitted on; the other three check it.
LLAMACPP_MEASURED = [
    ("q4_k_m", 131_072, 21_694),
    ("q5_k_m", 2_048, 21_758),
    ("q5_k_m", 131_072, 24_018),
]


@pytest.mark.parametrize("quant, context, measured_mib", LLAMACPP_MEASURED)
def test_llama_cpp_memory_against_a_published_measurement(quant, context, measured_mib):
    engine = mm.engine_for(quant, "q4_0")
    assert engine.kind == "llama.cpp"
    total = (mm.weight_bytes(QWEN_27B, quant) + mm.llamacpp_kv_bytes(QWEN_27B, context,
                                                                    engine=engine)
             + engine.reserve_bytes)
    assert total / MIB == pytest.approx(measured_mib, rel=0.02)


def test_llama_cpp_cells_and_state():
    engine = mm.engine_for("q4_k_m", "q4_0")
    per_cell = 2 * 16 * 4 * 256 * 18 / 32  # q4_0: 18 bytes per 32 values
    state = 48 * (10_240 * 3 + 48 * 128 * 128) * 4  # F32, one slot
    assert mm.llamacpp_kv_bytes(QWEN_27B, 1_000, engine=engine) == 1_024 * per_cell + state
    assert mm.llamacpp_kv_bytes(QWEN_27B, 1_000, engine=engine, sequences=2) == (
        2_048 * per_cell + 2 * state)
    p = mm.plan(QWEN_27B, quantization="q4_k_m", context=131_072, vram_bytes=24_564 * MIB,
                engine=engine)
    assert p.fits and p.block_tokens == 256 and p.max_context % 256 == 0


def test_the_engine_follows_the_weights_and_refuses_a_cache_it_lacks():
    assert mm.engine_for("Q4_K_M").kind == "llama.cpp"
    assert mm.engine_for("awq").kind == "vllm"
    assert mm.engine_for("bf16", "fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="vllm has no 'q4_0' KV cache"):
        mm.engine_for("bf16", "q4_0")
    with pytest.raises(ValueError, match="Unknown quantization 'zz9'"):
        mm.plan(QWEN_27B, quantization="zz9", context=1, vram_bytes=GIB)


# --- the threshold the catalog filters on ---------------------------------------------------------

@pytest.mark.parametrize("arch, quant, kv, context", [
    (QWEN_27B, "bf16", None, 262_144),
    (QWEN_27B, "fp8", "fp8", 32_768),
    (QWEN_27B, "awq", None, 1),
    (QWEN_27B, "q4_k_m", "q4_0", 131_072),
    (QWEN_4B, "bf16", None, 100_000),
    (LLAMA_8B, "bf16", None, 131_072),
    (LLAMA_8B, "q8_0", None, 4_000),
])
def test_min_vram_is_the_exact_edge_of_plan(arch, quant, kv, context):
    engine = mm.engine_for(quant, kv)
    mib = mm.min_vram_mib(arch, quantization=quant, context=context, engine=engine)
    at = mm.plan(arch, quantization=quant, context=context, vram_bytes=mib * MIB, engine=engine)
    below = mm.plan(arch, quantization=quant, context=context, vram_bytes=(mib - 1) * MIB,
                    engine=engine)
    assert at.fits and not below.fits
