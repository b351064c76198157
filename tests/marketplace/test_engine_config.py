"""A node's engine command, with plain values: the fleet simulator's machines as their
heartbeats describe them (fleetsim.profiles.simulated_facts), each choice checked against
arithmetic done by hand here from the model's config.json fields and the engines' rules
(docs/engine-config.md, docs/what-fits.md)."""

import json
import math
import shlex

import pytest

from fleetsim import profiles
from marketplace import engine_config as ec
from marketplace.model_data import architecture_for

GIB, MIB = 2**30, 2**20
QWEN_27B = architecture_for("Qwen/Qwen3.5-27B")
LLAMA_8B = architecture_for("meta-llama/Llama-3.1-8B-Instruct")
RESERVE = 2 * GIB  # what vLLM keeps per GPU beside weights and KV (modelmath's estimate)

# --- the 27B hybrid's blocks, by hand --------------------------------------------------------
# One linear (Gated DeltaNet) layer's state for one sequence: a conv window of 3 over
# 16 x 128 x 2 + 48 x 128 = 10,240 channels in BF16, and 48 matrices of 128 x 128 in float32.
STATE_1GPU = 10_240 * 3 * 2 + 48 * 128 * 128 * 4  # 3,207,168 bytes
STATE_2GPU = 5_120 * 3 * 2 + 24 * 128 * 128 * 4  # heads split over two GPUs: 1,603,584
# A token's page in one attention layer: K and V x KV heads (4, or 2 a GPU) x 256 x bytes.
# vLLM grows the block by 16 tokens until a block's page holds one layer's state.
assert 16 * math.ceil(STATE_1GPU / (16 * 2 * 4 * 256 * 2)) == 784  # 16-bit cache, one GPU
assert 16 * math.ceil(STATE_1GPU / (16 * 2 * 4 * 256 * 1)) == 1_568  # FP8 cache, one GPU
assert 16 * math.ceil(STATE_2GPU / (16 * 2 * 2 * 256 * 1)) == 1_568  # FP8, two GPUs
# A block holds its tokens in each of the 16 layers of a group: the same bytes either way.
BLOCK_1GPU = 784 * (2 * 4 * 256 * 2) * 16  # = 1,568 x 2 KiB x 16 = 51,380,224
BLOCK_2GPU = 1_568 * (2 * 2 * 256 * 1) * 16  # = 25,690,112
STATE_BLOCKS = 3 * 2  # 3 groups of 16 linear layers x 2 blocks (prefix caching, align mode)


def blocks(card_mib: int, util: float, weights_per_gpu: float, block: int) -> int:
    return math.floor((card_mib * MIB * util - RESERVE - weights_per_gpu) / block)


def facts(key: str) -> ec.NodeFacts:
    return ec.NodeFacts.from_report(profiles.simulated_facts(key, f"{key}-1"))


# The arithmetic below sizes 16-bit weights on the cards that hold them, whatever weights their
# fleetsim profiles serve (8-bit, as the published fleet did).
SIXTEEN_BIT = {"h200", "rtx-pro-6000"}


def config(key: str, **kwargs) -> ec.EngineConfig:
    p = profiles.get_profile(key)
    return ec.compute(facts(key), model=p.model, arch=architecture_for(p.model),
                      quantization="bf16" if key in SIXTEEN_BIT else p.quantization, **kwargs)


# --- the fleet's machines ------------------------------------------------------------------------

H200_BLOCKS = blocks(143_771, 0.95, 27e9 * 2, BLOCK_1GPU)
PRO6000_BLOCKS = blocks(96 * 1024, 0.95, 27e9 * 2, BLOCK_1GPU)
PAIR_5090_BLOCKS = blocks(32 * 1024, 0.9, 27e9 / 2, BLOCK_2GPU)
PAIR_4090_BLOCKS = blocks(24_564, 0.9, 27e9 / 2, BLOCK_2GPU)
# WSL2: Windows' desktop (1,528 MiB) and WSL2's driver (1.31 GiB) of 24,564 MiB: 0.883 -> 0.88.
WSL_UTIL = math.floor((1 - (1_528 + 1.31 * 1024) / 24_564) * 100) / 100
PAIR_WSL_BLOCKS = blocks(24_564, WSL_UTIL, 27e9 / 2, BLOCK_2GPU)


def test_the_hand_arithmetic():
    assert (H200_BLOCKS, PRO6000_BLOCKS, PAIR_5090_BLOCKS, PAIR_4090_BLOCKS) == (
        1_694, 813, 594, 293)
    assert WSL_UTIL == 0.88 and PAIR_WSL_BLOCKS == 273


# A full-length request (262,144 tokens): 335 blocks of 784 or 168 of 1,568, plus the 6 state
# blocks. A request of 4,096 tokens: 6 blocks of 784 or 3 of 1,568, plus 6.
FULL_16BIT, FULL_FP8 = 335 + STATE_BLOCKS, 168 + STATE_BLOCKS
TYPICAL_16BIT, TYPICAL_FP8 = 6 + STATE_BLOCKS, 3 + STATE_BLOCKS


def longest_of_four(pool: int, block_tokens: int) -> int:
    """The longest request four fit at once, cut to a multiple of 1,024."""
    return (pool // 4 - STATE_BLOCKS) * block_tokens // 1_024 * 1_024


@pytest.mark.parametrize("key, layout, tp, util, kv, max_len, seqs, unit", [
    # One GPU. 0.95 on a 140 GB card; a 16-bit cache holds 1,694 // 341 = 4 full-length requests,
    # so no FP8; 1,694 // 12 = 141 requests of 4,096 tokens.
    ("h200", "one GPU", None, "0.95", "auto", 262_144, H200_BLOCKS // TYPICAL_16BIT, "16"),
    # 813 // 341 = 2 full-length requests at 16 bits, 813 // 174 = 4 at FP8 (CC 12.0 has it);
    # 813 // 9 = 90 of 4,096 tokens.
    ("rtx-pro-6000", "one GPU", None, "0.95", "fp8", 262_144, PRO6000_BLOCKS // TYPICAL_FP8,
     "32"),
    # One 32 GB card: 25.1 GiB of FP8 weights leave 34 blocks, 4 requests of 3,136 tokens: not a
    # replica that serves well (32,768). Split: 594 blocks a GPU, 594 // 174 = 3 full-length
    # requests, so the limit is what four fit: (148 - 6) x 1,568 = 222,656 -> 222,208.
    ("2x-rtx-5090", "tensor parallel 2", "2", "0.9", "fp8",
     longest_of_four(PAIR_5090_BLOCKS, 1_568), PAIR_5090_BLOCKS // TYPICAL_FP8, "32"),
    # The weights (27 GB) do not fit one card's 0.9 x 24,564 MiB - 2 GiB; split: 293 blocks,
    # four of (73 - 6) x 1,568 = 105,056 -> 104,448 tokens; 293 // 9 = 32 requests.
    ("2x-rtx-4090", "tensor parallel 2", "2", "0.9", "fp8",
     longest_of_four(PAIR_4090_BLOCKS, 1_568), PAIR_4090_BLOCKS // TYPICAL_FP8, "32"),
    # The same cards under WSL2: 0.88 of each, 273 blocks: (68 - 6) x 1,568 = 97,216 -> 96,256.
    ("2x-rtx-4090-wsl2", "tensor parallel 2", "2", "0.88", "fp8",
     longest_of_four(PAIR_WSL_BLOCKS, 1_568), PAIR_WSL_BLOCKS // TYPICAL_FP8, "32"),
])
def test_vllm_on_the_fleets_machines(key, layout, tp, util, kv, max_len, seqs, unit):
    c = config(key)
    assert c.runnable and c.engine == "vllm" and c.layout == layout
    assert c.value("--tensor-parallel-size") == tp
    assert c.value("--data-parallel-size") is None
    assert c.value("--gpu-memory-utilization") == util
    assert c.value("--kv-cache-dtype") == kv
    assert c.value("--max-model-len") == str(max_len)
    assert c.value("--max-num-seqs") == str(seqs)
    # The hybrid 27B: prefix caching said explicitly, in align mode, with a unit that divides
    # the block (784 = 16 x 49: 64, 48 and 32 do not; 1,568 = 32 x 49).
    assert c.value("--enable-prefix-caching") == "on"
    assert c.value("--mamba-cache-mode") == "align"
    assert c.value("--prefix-match-unit") == unit
    assert c.value("--api-key") == ec.ENGINE_KEY_PLACEHOLDER
    argv = c.argv
    assert argv[:3] == ("vllm", "serve", "Qwen/Qwen3-27B")
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    assert shlex.split(c.command().replace(ec.ENGINE_KEY_PLACEHOLDER, "KEY")) == [
        "KEY" if part == ec.ENGINE_KEY_PLACEHOLDER else part for part in argv]


def test_the_numbers_behind_the_h200_figures():
    c = config("h200")
    assert H200_BLOCKS // FULL_16BIT == 4  # four full-length requests: the model's whole context
    assert c.figures["kv_blocks"] == H200_BLOCKS and c.figures["block_tokens"] == 784
    assert c.figures["kv_bytes_per_token"] == 2 * 16 * 4 * 256 * 2  # 64 KiB: 16 of 64 layers
    assert c.figures["requests_at_max_model_len"] == 4


def test_fp8_and_tensor_parallel_for_the_cards_that_need_them():
    """The 16-bit cache on the PRO 6000 and the 4090 pair, by hand: too few full-length
    requests, so FP8, which those cards compute in."""
    assert PRO6000_BLOCKS // FULL_16BIT == 2 and PRO6000_BLOCKS // FULL_FP8 == 4
    assert PAIR_4090_BLOCKS // FULL_16BIT == 0 and PAIR_4090_BLOCKS // FULL_FP8 == 1
    one_4090 = 24_564 * MIB * 0.9 - RESERVE  # what vLLM gets of one card
    assert 27e9 > one_4090  # the FP8 weights do not fit one 4090
    pair = config("2x-rtx-4090")
    assert "do not fit the 19.6 GiB vLLM gets of one 24 GB card" in pair.layout_reason
    assert pair.value("--quantization") == "fp8"  # FP8 weights from the 16-bit checkpoint


def test_the_wsl2_pair_gives_windows_its_share():
    native, wsl = config("2x-rtx-4090"), config("2x-rtx-4090-wsl2")
    assert "Under WSL2" in wsl.flag("--gpu-memory-utilization").reason
    assert "48% slower" in wsl.layout_reason
    differs = {f.name for f in wsl.flags if f.value != native.value(f.name)}
    assert differs == {"--gpu-memory-utilization", "--max-model-len", "--max-num-seqs"}


def pair_report(*links) -> dict:
    """The 4090 pair's heartbeat with these NVLink counts, one per GPU (absent: not sent)."""
    report = profiles.simulated_facts("2x-rtx-4090", "pair-1")
    for gpu, count in zip(report["gpus"], links, strict=True):
        if count == "absent":
            del gpu["nvlink_links"]
        else:
            gpu["nvlink_links"] = count
    return report


@pytest.mark.parametrize(("links", "nvlink"), [
    ((0, 0), False),  # the fleet's pair: PCIe alone
    ((4, 4), True),  # bridged
    ((4, 0), False),  # one card without a link up
    ((4, None), False),  # one card NVML could not ask
    (("absent", "absent"), False),  # an agent older than the field
])
def test_nvlink_comes_from_the_report(links, nvlink):
    assert ec.NodeFacts.from_report(pair_report(*links)).nvlink is nvlink


def test_one_gpu_is_never_joined_by_nvlink():
    assert not facts("h200").nvlink  # its 18 links are up, but there is no second GPU
    assert not ec.nvlink_joined([18]) and not ec.nvlink_joined([])
    assert ec.nvlink_joined([18] * 8) and not ec.nvlink_joined([18] * 7 + [0])


def test_tensor_parallel_names_the_link_the_gpus_exchange_activations_over():
    p = profiles.get_profile("2x-rtx-4090")

    def pair(*links):
        return ec.compute(ec.NodeFacts.from_report(pair_report(*links)), model=p.model,
                          arch=architecture_for(p.model), quantization=p.quantization)

    pcie, bridged, unknown = pair(0, 0), pair(4, 4), pair("absent", "absent")
    assert "exchange activations over PCIe on every token" in pcie.layout_reason
    assert "exchange activations over NVLink on every token" in bridged.layout_reason
    assert "PCIe" not in bridged.layout_reason
    assert unknown.layout_reason == pcie.layout_reason  # not said: judged as PCIe
    # The layout is chosen by memory: the link changes the words, not the command.
    assert bridged.layout == pcie.layout == "tensor parallel 2"
    assert bridged.argv == pcie.argv


def test_llama_cpp_on_the_m4_max():
    """Apple Silicon: no CUDA, so llama-server. Metal lets it use 3/4 of 128 GB; 16.4 GB of
    Q4_K_M weights and 3.3 GiB of buffers leave room for 4 slots of the whole 262,144 tokens:
    4 x 262,144 cells of 64 KiB (f16 K and V, 16 layers x 4 heads x 256) plus each slot's
    recurrent state in F32 (48 layers x (10,240 x 3 + 48 x 128 x 128) x 4 bytes)."""
    weights = 27e9 * 4.85 / 8
    room = 128 * GIB * 0.75 - 3.3 * GIB - weights
    cells = 4 * 262_144 * (2 * 16 * 4 * 256 * 2)
    states = 4 * 48 * (10_240 * 3 + 48 * 128 * 128) * 4
    assert cells + states < room
    c = config("m4-max-llamacpp")
    assert c.runnable and c.engine == "llama.cpp" and c.layout == "llama.cpp on Metal"
    assert c.program == ("llama-server",)
    assert (c.value("-c"), c.value("--parallel"), c.value("-ngl")) == (
        str(4 * 262_144), "4", "999")
    assert c.figures["kv_bytes"] == cells + states
    assert c.value("--alias") == "Qwen/Qwen3-27B" and c.value("-m").endswith("Q4_K_M.gguf")
    assert c.value("--host") == "0.0.0.0" and "--metrics" in c.argv
    assert c.argv[c.argv.index("--api-key") + 1] == ec.ENGINE_KEY_PLACEHOLDER
    assert "GGUF" in c.layout_reason and "75% of the 128 GB" in c.layout_reason


def test_replicas_when_one_card_serves_well():
    """Llama-3.1-8B on two RTX 5090s: 16.06 GB of weights on one 32 GB card leave
    (32,768 MiB x 0.9 - 2 GiB - 16.06 GB) / 2 MiB = 6,063 blocks of 16 tokens at 16 bits (not four
    of the model's 131,072-token requests: 8,192 blocks each), 12,127 of 1 MiB at FP8: four of
    12,127 // 4 x 16 = 48,496 tokens, more than 32,768, so each card serves its own copy."""
    five = profiles.CARDS["rtx-5090"]
    gpu = ec.Gpu(five.name, five.memory_mib, five.compute_capability, 1_613.0, five.pcie_gen)
    c = ec.compute(ec.NodeFacts(gpus=(gpu, gpu), os="Linux 6.8.0-45-generic"),
                   model="meta-llama/Llama-3.1-8B-Instruct", arch=LLAMA_8B, quantization="bf16")
    assert blocks(32_768, 0.9, 16.06e9, 16 * 131_072) == 6_063
    fp8 = blocks(32_768, 0.9, 16.06e9, 16 * 65_536)
    assert fp8 == 12_127 and fp8 // 4 * 16 == 48_496
    assert c.layout == "2 replicas (data parallel)"
    assert c.value("--data-parallel-size") == "2" and c.value("--tensor-parallel-size") is None
    assert c.value("--kv-cache-dtype") == "fp8" and c.value("--max-model-len") == "48128"
    assert c.value("--max-num-seqs") == str(fp8 // 256)  # 4,096 tokens: 256 blocks
    # A plain-attention model: prefix caching is vLLM's default, said anyway; no hybrid flags.
    assert c.value("--enable-prefix-caching") == "on" and c.flag("--mamba-cache-mode") is None
    assert not c.flag("--enable-prefix-caching").differs


def test_the_published_figures_through_the_config():
    """FACTS.md: Llama-3.1-8B at BF16 keeps 128 KiB of KV per token; a full 262,144-token
    request of the 27B hybrid needs ~9.3 GiB, which vLLM's rules give with an FP8 cache and
    the checkpoint's multi-token prediction drafting 3 tokens with prefix caching on
    (tests/marketplace/test_modelmath.py): set by hand on the H200, the config says so."""
    llama = config("rtx-pro-6000-llama8b")
    assert llama.figures["kv_bytes_per_token"] == 131_072 == 128 * 1024
    # 96 GB at 0.95 less 16.06 GB of weights: 38,012 blocks of 2 MiB; four of 8,192 fit, so
    # the 16-bit cache and the model's whole context; 38,012 // 256 = 148 requests of 4,096.
    llama_blocks = blocks(96 * 1024, 0.95, 16.06e9, 16 * 131_072)
    assert llama_blocks == 38_012 and llama_blocks // 8_192 == 4
    assert (llama.value("--kv-cache-dtype"), llama.value("--max-model-len"),
            llama.value("--max-num-seqs")) == ("auto", "131072", str(llama_blocks // 256))

    h200 = config("h200")
    assert h200.figures["kv_bytes_at_max_context"] == FULL_16BIT * BLOCK_1GPU  # 16.3 GiB
    fleet = config("h200", overrides={
        "--kv-cache-dtype": "fp8",
        "--speculative-config": '{"method": "mtp", "num_speculative_tokens": 3}'})
    # 1,600-token blocks of 17 layers (the draft head's too): 164 + 3 groups x (2 + 3).
    assert fleet.figures["kv_bytes_at_max_context"] == (164 + 15) * 1_600 * 2_048 * 17
    assert fleet.figures["kv_bytes_at_max_context"] == pytest.approx(9.3 * GIB, rel=0.01)
    assert fleet.value("--speculative-config") == (
        '{"method":"mtp","num_speculative_tokens":3}')
    # Hits on whole blocks only while drafting: the unit is left out.
    assert fleet.flag("--prefix-match-unit") is None


def test_what_differs_from_one_fleet_wide_command():
    h200 = {f.name: f for f in config("h200").differences()}
    assert set(h200) == {"--gpu-memory-utilization", "--max-num-seqs", "--enable-prefix-caching",
                         "--mamba-cache-mode", "--prefix-match-unit", "--api-key"}
    assert h200["--enable-prefix-caching"].default == "off"  # vLLM's for hybrids
    assert h200["--max-num-seqs"].default == "1024"  # vLLM's own on a 141 GB card
    pair = {f.name for f in config("2x-rtx-4090").differences()}
    assert {"--tensor-parallel-size", "--kv-cache-dtype", "--max-model-len"} <= pair
    assert "--gpu-memory-utilization" not in pair  # 0.9, vLLM's own


def test_the_engine_follows_the_weights_and_the_card():
    pascal = ec.NodeFacts(gpus=(ec.Gpu("Tesla P40", 24_576, "6.1"),), os="Linux")
    c = ec.compute(pascal, model="meta-llama/Llama-3.1-8B-Instruct", arch=LLAMA_8B,
                   quantization="bf16")
    assert c.engine == "llama.cpp" and "compute capability 7.0" in c.layout_reason
    gguf = ec.compute(facts("h200"), model="Qwen/Qwen3.5-27B", arch=QWEN_27B,
                      quantization="Q4_K_M")
    assert gguf.engine == "llama.cpp" and "GGUF" in gguf.layout_reason


def test_llama_cpp_keeps_what_fits_on_a_small_card():
    """27B at Q4_K_M (16.4 GB) on a 12 GB card: 12 GiB - 3.3 GiB usable; one slot of 8,192
    tokens (512 MiB of cells and one 157 MB recurrent state); 16.4 GB / 64 layers a layer."""
    small = ec.NodeFacts(gpus=(ec.Gpu("NVIDIA GeForce RTX 3060", 12_288, "8.6"),), os="Linux")
    c = ec.compute(small, model="Qwen/Qwen3.5-27B", arch=QWEN_27B, quantization="Q4_K_M")
    kv = 8_192 * 65_536 + 48 * (10_240 * 3 + 48 * 128 * 128) * 4
    layers = math.floor((12 * GIB - 3.3 * GIB - kv) / (27e9 * 4.85 / 8 / 64))
    assert layers == 33
    assert (c.value("-c"), c.value("--parallel"), c.value("-ngl")) == ("8192", "1", "33")
    assert "31 run on the CPU" in c.flag("-ngl").reason


def test_a_node_that_cannot_serve_the_model_says_why():
    small = ec.NodeFacts(gpus=(ec.Gpu("NVIDIA GeForce RTX 3060", 12_288, "8.6"),), os="Linux")
    c = ec.compute(small, model="Qwen/Qwen3.5-27B", arch=QWEN_27B, quantization="bf16")
    assert not c.runnable and "do not fit" in c.problems[0]
    assert c.to_json()["argv"] == []
    unknown = ec.compute(small, model="acme/mystery", arch=None, quantization="bf16")
    assert not unknown.runnable and "does not know" in unknown.problems[0]


# --- overrides -----------------------------------------------------------------------------------

def test_an_override_goes_on_top_and_the_arithmetic_follows():
    c = config("h200", overrides={"--kv-cache-dtype": "fp8"},
               override_reasons={"--kv-cache-dtype": "quality checked"})
    kv = c.flag("--kv-cache-dtype")
    assert (kv.value, kv.overridden, kv.computed, kv.override_reason) == (
        "fp8", True, "auto", "quality checked")
    assert "no need to halve it" in kv.reason  # the computed value's own reason stays
    # 1,568-token blocks of the same bytes: 1,694 // 9 requests of 4,096 tokens now.
    seqs = c.flag("--max-num-seqs")
    assert seqs.value == str(H200_BLOCKS // TYPICAL_FP8) and not seqs.overridden
    assert c.value("--prefix-match-unit") == "32"


def test_a_plain_override_keeps_the_computed_value_beside_it():
    c = config("2x-rtx-4090", overrides={"--max-num-seqs": "16"})
    flag = c.flag("--max-num-seqs")
    assert (flag.value, flag.computed) == ("16", str(PAIR_4090_BLOCKS // TYPICAL_FP8))
    assert c.argv[c.argv.index("--max-num-seqs") + 1] == "16"


@pytest.mark.parametrize("flag, value, error", [
    ("--swap-space", "4", "not a flag the platform lets you set"),
    ("--api-key", "x", "not a flag the platform lets you set"),
    ("--gpu-memory-utilization", "1.5", "0.5 to 0.98"),
    ("--gpu-memory-utilization", "nan", "0.5 to 0.98"),
    ("--max-num-seqs", "many", "whole number"),
    ("--max-num-seqs", "0", "1 to 4,096"),
    ("--kv-cache-dtype", "q4", "takes one of"),
    ("--prefix-match-unit", "20", "multiple of 16"),
    ("--enable-prefix-caching", "maybe", "on or off"),
    ("--speculative-config", "{", "JSON object"),
    ("--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}', "mtp"),
    ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 99}', "1 to 8"),
    ("--max-num-seqs", "", "needs a value"),
])
def test_a_value_out_of_range_is_refused(flag, value, error):
    with pytest.raises(ec.OverrideError, match=error):
        ec.parse_override(flag, value)


def check(key, flag, value, **overrides):
    p = profiles.get_profile(key)
    return ec.check_override(facts(key), flag=flag, value=value, overrides=overrides,
                             model=p.model, arch=architecture_for(p.model),
                             quantization=p.quantization)


@pytest.mark.parametrize("key, flag, value, error", [
    # One 4090 does not hold the FP8 weights.
    ("2x-rtx-4090", "--tensor-parallel-size", "1", "do not fit"),
    ("h200", "--tensor-parallel-size", "2", "does not divide this node's 1 GPU"),
    ("h200", "--max-model-len", "300000", "reads at most 262,144"),
    # At half of each 24 GB card the 13.5 GB of weights a card leave no room at all.
    ("2x-rtx-4090", "--gpu-memory-utilization", "0.5", "do not fit"),
    ("h200", "--prefix-match-unit", "64", "does not divide the 784-token block"),
    ("rtx-pro-6000-llama8b", "--speculative-config",
     '{"method": "mtp", "num_speculative_tokens": 2}', "no multi-token-prediction head"),
    ("h200", "-c", "4096", "a llama.cpp flag"),
    ("m4-max-llamacpp", "--max-num-seqs", "8", "a vllm flag"),
    ("m4-max-llamacpp", "-c", "2000000", "reads at most 262,144"),  # 500,000 a slot
])
def test_an_override_the_node_cannot_take_is_refused(key, flag, value, error):
    with pytest.raises(ec.OverrideError, match=error):
        check(key, flag, value)


def test_an_override_that_fits_is_accepted():
    c = check("2x-rtx-4090", "--max-model-len", "262144")
    assert c.value("--max-model-len") == "262144" and c.runnable
    assert check("h200", "--gpu-memory-utilization", "0.850").value(
        "--gpu-memory-utilization") == "0.85"
    assert ec.canonical_value("--speculative-config",
                              '{"num_speculative_tokens": 3, "method": "mtp"}') == (
        '{"method":"mtp","num_speculative_tokens":3}')


def test_stored_overrides_that_no_longer_apply_are_listed_not_applied():
    c = config("h200", overrides={"--tensor-parallel-size": "2", "-c": "8192", "--bogus": "1",
                                  "--max-num-seqs": "64"})
    assert {i.flag for i in c.ignored} == {"--tensor-parallel-size", "-c", "--bogus"}
    assert c.runnable and c.layout == "one GPU" and c.value("--max-num-seqs") == "64"


def test_the_config_is_json_for_the_heartbeat_reply():
    c = config("2x-rtx-4090", overrides={"--max-num-seqs": "16"}, engine_key="rse_key")
    data = json.loads(json.dumps(c.to_json()))
    assert data["engine"] == "vllm" and data["runnable"]
    assert data["argv"] == list(c.argv) and data["argv"][-2:] == ["--api-key", "rse_key"]
    by_flag = {f["flag"]: f for f in data["flags"]}
    assert by_flag["--max-num-seqs"]["overridden"] and by_flag["--max-num-seqs"]["computed"]
    assert by_flag["--tensor-parallel-size"]["differs"]
    assert data["figures"]["kv_blocks"] == PAIR_4090_BLOCKS


@pytest.mark.parametrize("key, flags", [
    ("rtx-pro-6000", ("--ssl-keyfile", "--ssl-certfile")),  # vLLM
    ("m4-max-llamacpp", ("--ssl-key-file", "--ssl-cert-file")),  # llama-server
])
def test_an_agent_that_makes_a_certificate_gets_a_command_serving_https(key, flags):
    plain, tls = config(key), config(key, tls=True)
    assert plain.value(flags[0]) is None and plain.value(flags[1]) is None
    assert tls.value(flags[0]) == ec.TLS_KEY_PLACEHOLDER
    assert tls.value(flags[1]) == ec.TLS_CERT_PLACEHOLDER
    # Left for the agent to fill in: never quoted into something else.
    assert f"{flags[0]} {ec.TLS_KEY_PLACEHOLDER} {flags[1]} {ec.TLS_CERT_PLACEHOLDER}" \
        in tls.command()
    assert [word for word in tls.argv if word not in (*flags, ec.TLS_KEY_PLACEHOLDER,
                                                       ec.TLS_CERT_PLACEHOLDER)] == list(plain.argv)
