"""The simulated cards' world beyond their own model: the same card serving any model, its
hardware faults applied, the platform's yardstick run as a simulated engine, and the files its
agent reads a model's size from."""

import json

import pytest

from agent import model_files
from fleetsim import physics
from fleetsim.machine import simulated_engine_argv
from fleetsim.profiles import get_profile, physics_curve
from fleetsim.server import write_checkpoint
from marketplace import modelmath
from marketplace.model_data import architecture_for

ARCH_27B = architecture_for("Qwen/Qwen3-27B")
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("card, gpus, published", [
    ("rtx-pro-6000", 1, {1: 106, 32: 1342}),
    ("rtx-4090", 2, {1: 94, 32: 435}),
    ("rtx-5090", 2, {1: 152, 32: 1318}),
    ("h200", 1, {1: 170, 128: 3342}),
])
def test_each_cards_character_serves_its_published_figures(card, gpus, published):
    """The character is fitted on the published 27B at 8-bit with the fleet's speculative
    decoding: it meets both figures of its machine."""
    curve, _, _ = physics_curve(card, gpus, ARCH_27B, "fp8", "vllm", tp=gpus,
                                tokens_per_pass=physics.SPEC_TOKENS_PER_PASS,
                                max_streams=max(published))
    served = dict(curve)
    for level, figure in published.items():
        assert served[level] == pytest.approx(figure, rel=0.01), level


def test_the_published_profiles_serve_their_figures_and_the_others_their_character():
    for key in ("rtx-4090", "m4-max-llamacpp", "rtx-pro-6000-llama8b",
                "2x-rtx-4090-mistral24b"):
        p = get_profile(key)
        again = p.serving(p.checkpoint, p.quantization, engine=p.engine, tp=p.gpu_count,
                          max_concurrency=p.max_concurrency, tokens_per_pass=p.tokens_per_pass)
        for n, tps in p.throughput:
            assert again.aggregate_tps(n) == pytest.approx(tps, rel=0.01), (key, n)


def test_serving_another_model_follows_the_weights_it_reads():
    pro = get_profile("rtx-pro-6000")
    bf16 = pro.serving(LLAMA_8B, "bf16")
    fp8 = pro.serving(LLAMA_8B, "fp8")
    # Half the bytes a token; each pass also pays a fixed cost that fp8 does not halve.
    assert 1.5 * bf16.aggregate_tps(1) < fp8.aggregate_tps(1) < 2 * bf16.aggregate_tps(1)
    assert bf16.model == LLAMA_8B and bf16.tokens_per_pass is None
    assert bf16.context_length == 131_072 and bf16.kv_cache_tokens > 32 * 640
    with pytest.raises(ValueError, match="does not know"):
        pro.serving("acme/unknown", "bf16")
    with pytest.raises(ValueError, match="do not fit"):
        get_profile("rtx-4090").serving("Qwen/Qwen3.5-27B", "bf16")


def test_hardware_faults_reach_every_model_and_the_engine_factor_by_choice():
    honest = get_profile("rtx-4090").serving(LLAMA_8B, "fp8").aggregate_tps(1)
    starved = get_profile("liar-bandwidth-starved").serving(LLAMA_8B, "fp8").aggregate_tps(1)
    # The memory clock cut to 6,801 of 10,501 MHz: one stream reads weights that much slower.
    assert 0.6 < starved / honest < 0.75
    wsl = get_profile("2x-rtx-4090-wsl2").serving(LLAMA_8B, "fp8")
    pair = get_profile("2x-rtx-4090").serving(LLAMA_8B, "fp8")
    assert wsl.aggregate_tps(8) == pytest.approx(0.52 * pair.aggregate_tps(8), rel=0.01)
    # A liar that slows only its own model serves the yardstick as the honest pair does.
    nosize = get_profile("liar-nosize-5090x2")
    honest_pair = get_profile("2x-rtx-5090")
    assert nosize.serving(LLAMA_8B, "fp8", tp=1).aggregate_tps(8) == pytest.approx(
        honest_pair.serving(LLAMA_8B, "fp8", tp=1).aggregate_tps(8))
    assert nosize.aggregate_tps(1) == pytest.approx(0.4 * honest_pair.aggregate_tps(1), rel=0.01)


def test_the_platforms_commands_become_the_simulated_engine():
    vllm = simulated_engine_argv(
        ["vllm", "serve", LLAMA_8B, "--quantization", "fp8", "--data-parallel-size", "2",
         "--max-model-len", "32768", "--max-num-seqs", "77", "--speculative-config",
         '{"method":"mtp","num_speculative_tokens":3}', "--port", "8123", "--api-key", "k"],
        "2x-rtx-4090", time_scale=2)
    assert vllm[1:5] == ["-m", "fleetsim", "serve", "--profile"]
    words = " ".join(vllm)
    for part in ("--model meta-llama/Llama-3.1-8B-Instruct", "--quantization fp8",
                 "--tensor-parallel-size 1", "--max-concurrency 77", "--port 8123",
                 "--speculative", "--time-scale 2", "--engine vllm"):
        assert part in words, part
    assert "k" not in vllm  # the key means nothing to a simulated engine
    llama = simulated_engine_argv(
        ["llama-server", "--hf-repo", "bartowski/x", "--hf-file",
         "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "--alias", LLAMA_8B, "-c", "32768",
         "--parallel", "4", "--port", "9000"], "m4-max-llamacpp")
    words = " ".join(llama)
    for part in ("--engine llama.cpp", "--quantization Q4_K_M", "--max-model-len 8192",
                 "--max-concurrency 4", f"--model {LLAMA_8B}"):
        assert part in words, part


def test_a_checkpoint_on_disk_is_what_the_agent_reads(tmp_path, monkeypatch):
    """The simulated machine keeps its model as a Hugging Face cache entry (a sparse weights
    file: no disk), and the real agent's reader sizes it from there by its hub id."""
    profile = get_profile("liar-nosize-5090x2")
    snapshot = write_checkpoint(profile, tmp_path)
    assert snapshot is not None and (snapshot / "config.json").exists()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    found = model_files.read({"id": profile.model, "root": profile.checkpoint})
    assert found["weights_bytes"] == int(modelmath.weight_bytes(ARCH_27B, "fp8"))
    assert found["config"]["num_hidden_layers"] == 64
    assert found["config"]["full_attention_interval"] == 4  # a hybrid: KV in one layer in 4
    assert json.loads((snapshot / "config.json").read_text())["hidden_size"] == 5120
    assert (snapshot / "model.safetensors").stat().st_blocks * 512 < 1 << 20  # sparse
    # A GGUF the engine says its size of itself: nothing written.
    assert write_checkpoint(get_profile("m4-max-llamacpp"), tmp_path) is None
