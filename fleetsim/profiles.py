"""Measured machine profiles for simulated fleet workers.

Standard library only: the node agent imports this module under `--simulate PROFILE`, and the
agent must run with nothing but httpx and nvidia-ml-py installed.

Every figure comes from /work/shared/FACTS.md (a GPU fleet operator's published measurements of
a 27B model on vLLM, plus the GPU reference spec table); each profile's `sources` says which
figure came from where and which ones are our own estimates.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

# The model every measured fleet machine served (FACTS.md: "27B model, vLLM"). Same id as the
# agent protocol's example, so the platform's routing sees one model across engines.
MODEL_27B = "Qwen/Qwen3-27B"

# Fixed namespace so GPU UUIDs are a pure function of (machine id, GPU index): a restarted
# simulated machine keeps its UUIDs, two different machines never share one.
_UUID_NAMESPACE = uuid.UUID("8f0c6d0e-5a4b-4c1e-9d3a-2b7f6e1a9c40")

# Fleet report: a repeated 13,000-token prompt took 7.2 s cold and 1.6 s once prefix caching
# worked. The 1.6 s left with a fully cached prompt is the part that is not prefill, so the
# prefill itself took 7.2 - 1.6 = 5.6 s: ~2,321 prompt tok/s. The report does not name the
# machine; we anchor the figure on the RTX PRO 6000 (our choice, not a published fact) and scale
# the other profiles by their aggregate throughput at 32 concurrent streams, because batched
# decode is compute-bound like prefill, whereas single-stream decode is bandwidth-bound.
_PREFILL_REF_TPS = 13_000 / (7.2 - 1.6)
_PREFILL_REF_AGG32 = 1_342.0


@dataclass(frozen=True)
class Profile:
    key: str
    title: str
    engine: str  # "vllm" or "llama.cpp"
    model: str  # the id the engine's /v1/models reports
    context_length: int  # per request: prompt + max_tokens must fit
    max_concurrency: int  # running requests; more wait in the engine's queue
    # (concurrent requests, aggregate output tok/s), ascending in concurrency.
    throughput: tuple[tuple[int, float], ...]
    prefill_tps: float  # uncached prompt tokens processed per second
    prefix_cache: bool
    kv_cache_tokens: int  # tokens of KV cache the engine holds (prompt + output, all requests)
    gpu_name: str
    gpu_count: int
    memory_total_mib: int  # per GPU, as NVML reports it
    compute_capability: str | None
    pcie_gen_current: int | None
    pcie_gen_max: int | None
    pcie_width_current: int | None
    pcie_width_max: int | None
    power_limit_w: int | None
    nvidia: bool
    driver_version: str | None
    cuda_version: str | None
    os: str
    sources: str

    def aggregate_tps(self, n: int | float) -> float:
        """Total output tok/s with `n` requests decoding at once.

        Linear in log2(n) between measured points, because throughput grows roughly by a
        constant amount per doubling of the batch until the card saturates. Flat beyond the
        last point: no published figure above it, so we do not invent growth.
        """
        return _interpolate(self.throughput, n)

    def per_stream_tps(self, n: int | float) -> float:
        return self.aggregate_tps(n) / n if n > 0 else 0.0

    @property
    def single_stream_tps(self) -> float:
        return self.aggregate_tps(1)


def _interpolate(points: tuple[tuple[int, float], ...], n: int | float) -> float:
    if n <= 0:
        return 0.0
    if n <= points[0][0]:
        return points[0][1]
    for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
        if n <= n1:
            x0, x1 = math.log2(n0), math.log2(n1)
            return t0 + (t1 - t0) * (math.log2(n) - x0) / (x1 - x0)
    return points[-1][1]


def _kv_tokens(memory_gib: float, weights_gib: float) -> int:
    """KV cache capacity in tokens: vLLM takes 90% of GPU memory (its default
    gpu_memory_utilization) and keeps what the weights leave; FACTS.md: a full 262,144-token
    request of this 27B model needs ~9.3 GiB of KV cache."""
    return int((memory_gib * 0.9 - weights_gib) / 9.3 * 262_144)


# 27B parameters: ~50.3 GiB in BF16, ~25.1 GiB in FP8.
_BF16_GIB = 27e9 * 2 / 2**30
_FP8_GIB = 27e9 / 2**30


def _prefill_for(points: tuple[tuple[int, float], ...]) -> float:
    return round(_PREFILL_REF_TPS * _interpolate(points, 32) / _PREFILL_REF_AGG32, 1)


_LINUX = "Linux 6.8.0-45-generic"
_PREFILL_NOTE = (
    "prefill_tps derived from the fleet report's repeated 13,000-token prompt "
    "(7.2 s cold, 1.6 s cached: 13,000 / 5.6 s = ~2,321 tok/s on the RTX PRO 6000 reference), "
    "scaled by aggregate tok/s at 32 concurrent."
)

_PRO6000_TP = ((1, 106.0), (32, 1_342.0))
_4090_TP = ((1, 94.0), (32, 435.0))
_5090_TP = ((1, 152.0), (32, 1_318.0))
_H200_TP = ((1, 170.0), (128, 3_342.0))
# The fleet report: the same 4090 box under Windows/WSL2 serves 48% slower.
_WSL2_FACTOR = 0.52
_4090_WSL2_TP = tuple((n, round(t * _WSL2_FACTOR, 2)) for n, t in _4090_TP)

# Apple M4 Max: no published tok/s in FACTS.md. Decode of one stream reads every weight once
# per token: 546 GB/s / ~16 GB of Q4_K_M weights (27B x ~4.8 bits) = ~34 tok/s ceiling;
# llama.cpp on Metal reaches roughly two thirds of that, ~22 tok/s. Four parallel slots share
# each weight read, but Metal's batched matmuls are weak; we assume about 2x at 4 slots.
_M4_TP = ((1, 22.0), (4, 44.0))

PROFILES: dict[str, Profile] = {
    p.key: p
    for p in (
        Profile(
            key="rtx-pro-6000",
            title="1x RTX PRO 6000 Blackwell 96 GB (vLLM)",
            engine="vllm",
            model=MODEL_27B,
            # 96 GB holds the BF16 weights (~54 GB) and several full-length requests
            # (~9.3 GiB of KV each at 262,144 tokens, FACTS.md).
            context_length=262_144,
            # Measured up to 32 concurrent; beyond it we queue rather than claim more.
            max_concurrency=32,
            throughput=_PRO6000_TP,
            prefill_tps=_prefill_for(_PRO6000_TP),
            prefix_cache=True,
            kv_cache_tokens=_kv_tokens(96, _BF16_GIB),
            gpu_name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
            gpu_count=1,
            memory_total_mib=96 * 1024,  # computed from 96 GB, not an NVML reading
            compute_capability="12.0",
            pcie_gen_current=5,
            pcie_gen_max=5,
            pcie_width_current=16,
            pcie_width_max=16,
            power_limit_w=600,
            nvidia=True,
            driver_version="570.133.07",
            cuda_version="12.8",
            os=_LINUX,
            sources=(
                "tok/s: fleet operator's published measurements (FACTS.md), 106 alone and "
                "1,342 at 32 concurrent. GPU facts: FACTS.md spec table (600 W, PCIe 5, CC 12.0); "
                "memory computed as 96 x 1024 MiB (no NVML reading published). " + _PREFILL_NOTE
            ),
        ),
        Profile(
            key="2x-rtx-4090",
            title="2x RTX 4090 24 GB, tensor parallel (vLLM)",
            engine="vllm",
            model=MODEL_27B,
            # 48 GB cannot hold BF16 weights, so FP8 (~25 GiB). The ~500k tokens of KV left are
            # shared by up to 32 requests; capping a request at 65,536 tokens keeps one long
            # prompt from evicting everyone else (24 GB cards need per-node engine settings).
            context_length=65_536,
            max_concurrency=32,
            throughput=_4090_TP,
            prefill_tps=_prefill_for(_4090_TP),
            prefix_cache=True,
            kv_cache_tokens=_kv_tokens(2 * 24_564 / 1024, _FP8_GIB),
            gpu_name="NVIDIA GeForce RTX 4090",
            gpu_count=2,
            memory_total_mib=24_564,  # NVML reading (FACTS.md)
            compute_capability="8.9",
            pcie_gen_current=4,
            pcie_gen_max=4,
            pcie_width_current=16,
            pcie_width_max=16,
            power_limit_w=450,
            nvidia=True,
            driver_version="550.127.05",
            cuda_version="12.4",
            os=_LINUX,
            sources=(
                "tok/s: fleet operator's published measurements (FACTS.md), 94 alone and 435 "
                "at 32 concurrent, tensor parallel over PCIe. GPU facts: FACTS.md spec table "
                "(450 W, PCIe 4, CC 8.9); memory 24,564 MiB as NVML reports it. " + _PREFILL_NOTE
            ),
        ),
        Profile(
            key="2x-rtx-5090",
            title="2x RTX 5090 32 GB, tensor parallel (vLLM)",
            engine="vllm",
            model=MODEL_27B,
            # FP8 weights like the 4090 pair (BF16 would leave 64 GB too little KV room); ~900k
            # tokens of KV hold several full-length 262,144-token requests.
            context_length=262_144,
            max_concurrency=32,
            throughput=_5090_TP,
            prefill_tps=_prefill_for(_5090_TP),
            prefix_cache=True,
            kv_cache_tokens=_kv_tokens(2 * 32, _FP8_GIB),
            gpu_name="NVIDIA GeForce RTX 5090",
            gpu_count=2,
            memory_total_mib=32 * 1024,  # computed from 32 GB, not an NVML reading
            compute_capability="12.0",
            pcie_gen_current=5,
            pcie_gen_max=5,
            pcie_width_current=16,
            pcie_width_max=16,
            power_limit_w=575,
            nvidia=True,
            driver_version="570.133.07",
            cuda_version="12.8",
            os=_LINUX,
            sources=(
                "tok/s: fleet operator's published measurements (FACTS.md), 149-156 alone "
                "(we use 152) and 1,318 at 32 concurrent. GPU facts: FACTS.md spec table "
                "(575 W, PCIe 5, CC 12.0); memory computed as 32 x 1024 MiB (no NVML reading "
                "published). " + _PREFILL_NOTE
            ),
        ),
        Profile(
            key="h200",
            title="1x H200 141 GB (vLLM)",
            engine="vllm",
            model=MODEL_27B,
            context_length=262_144,
            max_concurrency=128,  # measured up to 128 concurrent
            throughput=_H200_TP,
            prefill_tps=_prefill_for(_H200_TP),
            prefix_cache=True,
            kv_cache_tokens=_kv_tokens(143_771 / 1024, _BF16_GIB),
            gpu_name="NVIDIA H200",
            gpu_count=1,
            memory_total_mib=143_771,  # NVML reading (FACTS.md)
            compute_capability="9.0",
            pcie_gen_current=5,
            pcie_gen_max=5,
            pcie_width_current=16,
            pcie_width_max=16,
            power_limit_w=700,
            nvidia=True,
            driver_version="560.35.03",
            cuda_version="12.6",
            os=_LINUX,
            sources=(
                "tok/s: fleet operator's published measurements (FACTS.md), 163-176 alone "
                "(we use 170) and 3,342 at 128 concurrent. GPU facts: FACTS.md spec table "
                "(H200 SXM, 700 W, PCIe 5, CC 9.0); memory 143,771 MiB as NVML reports it. "
                + _PREFILL_NOTE
            ),
        ),
        Profile(
            key="2x-rtx-4090-wsl2",
            title="2x RTX 4090 24 GB under Windows/WSL2 (vLLM)",
            engine="vllm",
            model=MODEL_27B,
            context_length=65_536,
            max_concurrency=32,
            throughput=_4090_WSL2_TP,
            prefill_tps=round(_prefill_for(_4090_TP) * _WSL2_FACTOR, 1),
            prefix_cache=True,
            kv_cache_tokens=_kv_tokens(2 * 24_564 / 1024, _FP8_GIB),
            # Same cards as 2x-rtx-4090 and a newer driver: every hardware probe looks as good
            # or better; only serving speed and the WSL kernel string give it away.
            gpu_name="NVIDIA GeForce RTX 4090",
            gpu_count=2,
            memory_total_mib=24_564,
            compute_capability="8.9",
            pcie_gen_current=4,
            pcie_gen_max=4,
            pcie_width_current=16,
            pcie_width_max=16,
            power_limit_w=450,
            nvidia=True,
            driver_version="565.77",
            cuda_version="12.7",
            os="Linux 5.15.167.4-microsoft-standard-WSL2",
            sources=(
                "The 2x-rtx-4090 curve (94 alone, 435 at 32; FACTS.md) times 0.52: the fleet "
                "operator published that the same 4090 machine under Windows/WSL2 serves 48% "
                "slower although it benchmarks better on every hardware probe. Hardware facts "
                "as 2x-rtx-4090 with a newer driver. Prefill scaled by the same 0.52. "
                + _PREFILL_NOTE
            ),
        ),
        Profile(
            key="m4-max-llamacpp",
            title="Apple M4 Max 128 GB unified (llama.cpp, Q4_K_M)",
            engine="llama.cpp",
            # llama-server reports its --alias as the model id; the provider sets it to the
            # canonical name so the platform routes to it like any other worker.
            model=MODEL_27B,
            # llama.cpp splits -c across its parallel slots; -c 131072 with 4 slots gives each
            # request 32,768 tokens, and the Mac's prefill makes longer prompts impractical.
            context_length=32_768,
            max_concurrency=4,  # llama-server --parallel 4
            throughput=_M4_TP,
            # Estimate: ~17 FP16 TFLOPS on the 40-core GPU over ~54 GFLOP per token of a 27B
            # model is ~300 tok/s at best; llama.cpp on Metal gets about half.
            prefill_tps=150.0,
            # llama-server reuses a slot's cached prefix (cache_prompt), so repeats are fast.
            prefix_cache=True,
            kv_cache_tokens=131_072,  # llama-server -c 131072, shared by its 4 slots
            gpu_name="Apple M4 Max",
            gpu_count=1,
            memory_total_mib=128 * 1024,  # unified memory, computed from 128 GB
            compute_capability=None,
            pcie_gen_current=None,
            pcie_gen_max=None,
            pcie_width_current=None,
            pcie_width_max=None,
            power_limit_w=None,
            nvidia=False,
            driver_version=None,
            cuda_version=None,
            os="Darwin 24.3.0",
            sources=(
                "ESTIMATE, no published tok/s in FACTS.md. Derived from bandwidth: M4 Max "
                "(16-core CPU / 40-core GPU) 546 GB/s (FACTS.md spec table) over ~16 GB of Q4 "
                "weights = ~34 tok/s ceiling for one stream; we assume llama.cpp reaches ~65% "
                "(22 tok/s) and ~2x that in aggregate over 4 parallel slots (44 tok/s). "
                "Prefill 150 tok/s is likewise an estimate. Memory is the 128 GB unified memory."
            ),
        ),
    )
}


def get_profile(key: str) -> Profile:
    try:
        return PROFILES[key]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown fleetsim profile {key!r}; known profiles: {known}") from None


def gpu_uuid(machine_id: str, index: int) -> str:
    """NVML-style GPU UUID, deterministic per (machine id, GPU index)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{machine_id}/{index}')}"


def simulated_facts(profile_key: str, machine_id: str) -> dict:
    """The hardware part of a heartbeat (docs/agent-protocol.md), as NVML would report it."""
    p = get_profile(profile_key)
    return {
        "nvidia": p.nvidia,
        "driver_version": p.driver_version,
        "cuda_version": p.cuda_version,
        "os": p.os,
        "gpus": [
            {
                "index": i,
                "name": p.gpu_name,
                "uuid": gpu_uuid(machine_id, i),
                "memory_total_mib": p.memory_total_mib,
                "compute_capability": p.compute_capability,
                "pcie_gen_current": p.pcie_gen_current,
                "pcie_gen_max": p.pcie_gen_max,
                "pcie_width_current": p.pcie_width_current,
                "pcie_width_max": p.pcie_width_max,
                "power_limit_w": p.power_limit_w,
            }
            for i in range(p.gpu_count)
        ],
    }
