"""The first-principles serving prediction against the published fleet figures (FACTS.md)."""

from dataclasses import replace

import pytest

from marketplace import modelmath
from marketplace.model_data import architecture_for
from marketplace.models import Card
from verification import evidence
from verification.predict import FLEET_TOKENS_PER_PASS, LOAD_GAIN_FLOOR, Hardware, predict

ARCH_27B = architecture_for("Qwen/Qwen3-27B")

# Each machine as a correct measurement reads it: bandwidth ~90% of spec on GDDR7/GDDR6X,
# an H200 4,110 GB/s (FACTS.md); BF16 matmul at fleetsim's measured shares of the dense
# FP32-accumulate spec (the RTX PRO 6000's 231 TFLOPS is an estimate: none is published).
MACHINES = {
    "RTX PRO 6000": (Hardware(1, 1792 * 0.9, 96 * 2**30, 231 * 0.8, 5), {1: 106, 32: 1342}),
    "2x RTX 4090": (Hardware(2, 1008 * 0.9, 24_564 * 2**20, 165 * 0.82, 4), {1: 94, 32: 435}),
    "2x RTX 5090": (Hardware(2, 1792 * 0.9, 32 * 2**30, 209 * 0.8, 5), {1: 152, 32: 1318}),
    "H200": (Hardware(1, 4110, 143_771 * 2**20, 989 * 0.78, 5), {1: 170, 128: 3342}),
}
CASES = [(name, level, published) for name, (_, figures) in MACHINES.items()
         for level, published in figures.items()]
TOLERANCE = 0.025  # what the fit reaches on all eight published figures


@pytest.mark.parametrize("name, level, published", CASES)
def test_the_prediction_meets_every_published_figure(name, level, published):
    """The fleet's engines decode ~2.9 tokens a pass (its multi-token-prediction head): the
    prediction, told so, meets each figure."""
    hw = MACHINES[name][0]
    p = predict(hw, ARCH_27B, engine="vllm", quantization="fp8", concurrency=level,
                tokens_per_pass=FLEET_TOKENS_PER_PASS)
    assert p.expected == pytest.approx(published, rel=TOLERANCE)


@pytest.mark.parametrize("name, level, published", CASES)
def test_no_published_machine_falls_under_its_floor(name, level, published):
    hw = MACHINES[name][0]
    p = predict(hw, ARCH_27B, engine="vllm", quantization="fp8", concurrency=level)
    assert p.floor < 0.85 * published  # a warning would need 85%: none is near it
    assert p.floor <= p.expected


def test_nvlink_costs_tensor_parallel_no_more_than_the_fastest_pcie():
    """No NVLink pair is published: a pair joined by it is held to the Gen5 pair's per-token
    cost whatever its PCIe slots, never to the unknown link's (the slower Gen4 cost)."""
    pair = MACHINES["2x RTX 4090"][0]

    def at_32(**changes):
        hw = replace(pair, **changes)
        return predict(hw, ARCH_27B, engine="vllm", quantization="fp8", concurrency=32)

    gen4, gen5, unknown = at_32(), at_32(pcie_gen=5), at_32(pcie_gen=None)
    assert unknown == gen4 and gen5.floor > gen4.floor
    assert at_32(nvlink=True) == at_32(pcie_gen=None, nvlink=True) == gen5


def test_the_node_s_cards_say_whether_tensor_parallel_crosses_nvlink():
    probe = {"bandwidth": {"best_gbs": 907.0}, "matmul": {"best_tflops": 135.0}}

    def hardware(*links):
        cards = [Card(index=i, memory_total_mib=24_564, pcie_gen_max=4, nvlink_links=count)
                 for i, count in enumerate(links)]
        return evidence.hardware(cards, dict.fromkeys(range(len(cards)), probe), None)

    assert hardware(4, 4).nvlink and hardware(4, 4).pcie_gen == 4
    assert not hardware(4, 0).nvlink and not hardware(None, None).nvlink


def test_the_h200_range_of_published_single_stream_figures():
    hw = MACHINES["H200"][0]
    p = predict(hw, ARCH_27B, engine="vllm", quantization="fp8", concurrency=1,
                tokens_per_pass=FLEET_TOKENS_PER_PASS)
    assert 163 * (1 - TOLERANCE) <= p.expected <= 176 * (1 + TOLERANCE)


@pytest.mark.parametrize("name, level, published", CASES)
def test_a_machine_at_30_percent_of_the_fleet_falls_under_its_floor(name, level, published):
    """What the floor is for: a card serving 30% of what the same hardware serves in the fleet
    is a mismatch (below 70% of the floor) at one stream and under load, with no peer and no
    published figure to go by."""
    hw = MACHINES[name][0]
    p = predict(hw, ARCH_27B, engine="vllm", quantization="fp8", concurrency=level)
    assert 0.3 * published < 0.7 * p.floor


def test_heavier_weights_predict_slower_decoding():
    hw = MACHINES["RTX PRO 6000"][0]
    fp8 = predict(hw, ARCH_27B, engine="vllm", quantization="fp8", concurrency=1)
    bf16 = predict(hw, ARCH_27B, engine="vllm", quantization="bf16", concurrency=1)
    int4 = predict(hw, ARCH_27B, engine="vllm", quantization="awq", concurrency=1)
    assert int4.expected > fp8.expected > bf16.expected


def test_weights_that_do_not_fit_predict_nothing():
    one_4090 = Hardware(1, 907, 24_564 * 2**20, 135)
    assert predict(one_4090, ARCH_27B, engine="vllm", quantization="bf16", concurrency=1) is None
    assert predict(one_4090, ARCH_27B, engine="vllm", quantization="fp8", concurrency=1) is None
    assert predict(one_4090, ARCH_27B, engine="vllm", quantization="awq", concurrency=1)


def test_an_unknown_quantization_predicts_nothing():
    hw = MACHINES["H200"][0]
    assert predict(hw, ARCH_27B, engine="vllm", quantization="zz9", concurrency=1) is None


def test_the_kv_cache_bounds_the_batch_and_reads_the_layer_types():
    """A hybrid keeps KV in one layer in four: four times the sequences of a dense model of the
    same shape fit beside the weights."""
    hybrid = ARCH_27B
    dense = modelmath.Architecture(27e9, 27e9, 64, 64, 4, 256)
    card = Hardware(1, 1600, 40 * 2**30, 180)  # 40 GB: ~7 GB of KV room beside 27 GB of FP8
    h = predict(card, hybrid, engine="vllm", quantization="fp8", concurrency=256,
                sequence_tokens=8192)
    d = predict(card, dense, engine="vllm", quantization="fp8", concurrency=256,
                sequence_tokens=8192)
    assert h.batch == pytest.approx(4 * d.batch, abs=3) and d.batch < 256
    assert h.expected > d.expected


def test_a_node_starved_of_kv_room_is_held_to_the_smallest_published_batching_gain():
    """27B weights fill most of a 24 GB card: the fleet saw such replicas batch poorly, so the
    floor under load is the single-stream floor times the 4090 pair's gain, no more."""
    one_4090 = Hardware(1, 907, 24_564 * 2**20, 135)
    one = predict(one_4090, ARCH_27B, engine="vllm", quantization="awq", concurrency=1)
    many = predict(one_4090, ARCH_27B, engine="vllm", quantization="awq", concurrency=32)
    assert many.floor == pytest.approx(one.floor * LOAD_GAIN_FLOOR)
    roomy = MACHINES["RTX PRO 6000"][0]
    one = predict(roomy, ARCH_27B, engine="vllm", quantization="fp8", concurrency=1)
    many = predict(roomy, ARCH_27B, engine="vllm", quantization="fp8", concurrency=32)
    assert many.floor > one.floor * LOAD_GAIN_FLOOR


def test_llama_cpp_on_apple_silicon_reads_its_unified_memory_bandwidth():
    m4_max = Hardware(1, 546 * 0.81, 128 * 2**30, None, unified_memory=True)
    p = predict(m4_max, ARCH_27B, engine="llama.cpp", quantization="Q4_K_M", concurrency=1)
    # ~16 GB of Q4_K_M weights over ~442 GB/s: ~27 tok/s of bandwidth; llama.cpp gets 45-65%.
    assert 10 < p.floor < p.expected < 20
