"""The yardstick: one serving workload the platform chooses for each class of machine, served by
every machine whose agent runs its engine, whatever its provider serves. Pure: plain values.

Most combinations of GPU, count, model, quantization and engine have no verified peer and no
published figure when their first machine joins. The yardstick is the same model at the same
weights on the same engine for every machine of a class, so every GPU and count has peers on it
from its second machine on, a reference from its first where the fleet published figures for
that hardware (reference_tps), and in every case a measured calibration of the card: what it
turns into tokens against what first principles predict for its hardware (serving.py).

The classes follow the memory a card has, so that the weights leave room for a batch of 32:
Llama-3.1-8B-Instruct, an open dense model every engine serves, at 16 bits on cards of 60 GB and
more, at FP8 (quantized by vLLM as it loads) on 14 GB and more, and as a 4-bit GGUF on
llama.cpp for smaller cards and for machines without CUDA (Apple Silicon).
"""

import math
from dataclasses import dataclass, replace

from marketplace import modelmath
from marketplace.model_data import architecture_for
from verification import predict
from verification.spec_data import SERVING_REFERENCE

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LEVELS = (1, 8, 32)
BF16_MIN_GIB = 60
FP8_MIN_GIB = 14
# The reference machine of a GPU as a correct measurement reads it (FACTS.md: STREAM kernels
# reach 81-96% of the spec's bandwidth, a tuned BF16 GEMM ~80% of its rate).
REFERENCE_BANDWIDTH_SHARE = 0.9
REFERENCE_COMPUTE_SHARE = 0.8
# The 4-bit build llama.cpp fetches by itself (llama-server --hf-repo/--hf-file).
GGUF_REPO = "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF"
GGUF_FILE = "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf"


@dataclass(frozen=True)
class Workload:
    model: str
    quantization: str
    engine: str  # "vllm" or "llama.cpp"

    @property
    def key(self) -> str:
        """What two machines must share to be peers on it."""
        return f"{self.model}/{self.quantization}/{self.engine}"

    @property
    def label(self) -> str:
        name = self.model.rsplit("/", 1)[-1].removesuffix("-Instruct")
        engine = "vLLM" if self.engine == "vllm" else "llama.cpp"
        return f"{name} at {self.quantization} on {engine}"

    @property
    def arch(self) -> modelmath.Architecture:
        return architecture_for(self.model)


def workload_for(*, memory_mib: list[int], cuda: bool) -> Workload | None:
    """The class of a machine: its smallest card's memory, and whether it has CUDA. None where
    the smallest 4-bit build does not fit."""
    if not memory_mib:
        return None
    smallest = min(memory_mib) / 1024
    if cuda and smallest >= BF16_MIN_GIB:
        return Workload(MODEL, "bf16", "vllm")
    if cuda and smallest >= FP8_MIN_GIB:
        return Workload(MODEL, "fp8", "vllm")
    gguf = Workload(MODEL, "Q4_K_M", "llama.cpp")
    weights = modelmath.weight_bytes(gguf.arch, gguf.quantization)
    return gguf if smallest * 2**30 > weights + modelmath.LLAMACPP_RESERVE_BYTES else None


def llamacpp_argv(argv: list[str]) -> list[str]:
    """llama-server's command with the GGUF fetched by the engine itself, in place of a file the
    machine would need already (`-m NAME`)."""
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word in ("-m", "--model") and i + 1 < len(argv):
            out += ["--hf-repo", GGUF_REPO, "--hf-file", GGUF_FILE]
            skip = True
            continue
        out.append(word)
    return out


def reference_hardware(spec, count: int, *, tp: int | None,
                       measured: predict.Hardware | None) -> predict.Hardware:
    """`count` cards of `spec` as a correct measurement reads them (a spec without a compute
    figure: the node's measured one), laid out as the yardstick runs on them."""
    tflops = (spec.bf16_tflops * REFERENCE_COMPUTE_SHARE if spec.bf16_tflops
              else measured.bf16_tflops if measured else None)
    major, _, minor = (spec.compute_capability or "0.0").partition(".")
    fp8 = (int(major or 0), int(minor or 0)) >= (8, 9) if major.isdigit() else False
    return predict.Hardware(cards=count, bandwidth_gbs=spec.bandwidth_gbs * REFERENCE_BANDWIDTH_SHARE,
                            vram_bytes=spec.memory_gb * 2**30, bf16_tflops=tflops,
                            pcie_gen=spec.pcie_gen, nvlink=bool(measured and measured.nvlink),
                            tp=tp, fp8_math=fp8, unified_memory=spec.unified_memory)


def reference_tps(workload: Workload, *, gpu: str, count: int, hardware: predict.Hardware,
                  levels=LEVELS) -> dict[int, float]:
    """What the published figures of this GPU and count (spec_data.SERVING_REFERENCE) say it
    serves the yardstick at: each figure times the prediction for the yardstick over the
    prediction for the published model, on the reference machine (`hardware`: the spec as a
    correct measurement reads it). Between two published concurrencies the ratio is taken
    linear in log2 of the concurrency; beyond them, the nearest. {} where nothing is
    published for this hardware."""
    row = next((r for r in SERVING_REFERENCE if r["gpu"] == gpu and r["count"] == count), None)
    arch = architecture_for(row["model"]) if row else None
    if row is None or arch is None:
        return {}
    ratios = {}
    for level, published in row["tps"].items():
        fleet = predict.predict(replace(hardware, tp=None), arch, engine="vllm",
                                quantization=row.get("quantization", "fp8"),
                                concurrency=level,
                                tokens_per_pass=predict.FLEET_TOKENS_PER_PASS)
        if fleet is not None:
            ratios[level] = published / fleet.expected
    if not ratios:
        return {}
    out = {}
    for level in levels:
        ours = predict.predict(hardware, workload.arch, engine=workload.engine,
                               quantization=workload.quantization, concurrency=level)
        if ours is not None:
            out[level] = round(ours.expected * _ratio_between(ratios, level), 1)
    return out


def _ratio_between(ratios: dict[int, float], level: int) -> float:
    known = sorted(ratios)
    if level <= known[0]:
        return ratios[known[0]]
    if level >= known[-1]:
        return ratios[known[-1]]
    for lo, hi in zip(known, known[1:], strict=False):
        if lo <= level <= hi:
            share = (math.log2(level) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return ratios[lo] + (ratios[hi] - ratios[lo]) * share
    return ratios[known[-1]]
