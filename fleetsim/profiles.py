"""Measured machine profiles for simulated fleet workers.

Standard library, the agent's own modules and marketplace's pure model data (model_data,
modelmath: what a model weighs, not how a card serves it). The agent never imports fleetsim:
fleetsim hands the agent a simulated machine.

Every figure comes from /work/shared/FACTS.md (a GPU fleet operator's published measurements of
a 27B model on vLLM, plus the GPU reference spec table); each profile's `sources` says which
figure came from where and which ones are our own estimates.

Besides the honest machines, the planted-fault profiles ("liars", LIARS) let the verification
benchmark score itself: each is an honest profile with `Faults` planted (see `plant`), and
simulated_probe_results answers the agent's `probes` job from the real card plus its faults.
"""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import dataclass, replace

from agent.probes import DEFAULT_PARAMS
from fleetsim import physics
from marketplace import model_data, modelmath

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
class Card:
    """What a GPU physically is: the figures a correct measurement is derived from.

    A profile's NVML fields say what the machine *reports*; its `card` says what is really in
    it. They agree on an honest machine and differ where a liar spoofs NVML.
    """

    name: str  # NVML name of the real card
    architecture: str | None  # NVML architecture, as the agent names it
    compute_capability: str | None  # what CUDA itself reports
    sm_count: int | None
    memory_mib: int  # what the card really has, as NVML reports it when nothing is spoofed
    bus_width_bits: int | None
    max_memory_clock_mhz: int | None  # NVML max memory clock (half the GDDR data rate)
    sm_clock_mhz: int | None  # graphics clock under a sustained load
    l2_mb: int | None
    bandwidth_gbs: float  # spec
    # Dense, FP32 accumulate; an ESTIMATE where none is published; None where unmeasured.
    bf16_tflops: float | None
    pcie_gen: int | None
    power_w: int | None  # default power limit
    ecc_mode: int | None  # None: GeForce cards do not support ECC (NVML says not supported)
    has_serial: bool  # NVML reads a board serial on datacenter and pro boards only
    # Share of the spec a correct method measures on this card (see _CARD_NOTE); None on a
    # card the probes cannot measure (no CUDA).
    bandwidth_efficiency: float | None
    matmul_efficiency: float | None
    reserved_mib: int = 512  # memory taken before the VRAM test runs (CUDA context)
    # What NVML reads with the model loaded and nothing running (W): OUR ESTIMATE, from what
    # such cards commonly read idle with a driver loaded; None where NVML reads nothing (Mac).
    idle_power_w: int | None = None
    # NVLink links up, as NVML counts them: an SXM board's all up, 0 on a card joined to the
    # others by PCIe alone (these GeForce and workstation builds), None where there is no NVML.
    nvlink_links: int | None = 0


_CARD_NOTE = (
    "Memory clocks and bus widths as NVML reports them (4090 10,501 MHz x 384 bits = 1,008 GB/s; "
    "3090 9,751 x 384 = 936; 5090 and PRO 6000 14,001 x 512 = 1,792; H200 3,201 x 6,144 = "
    "4,917); SM counts, compute capabilities, L2, power and PCIe from verification/spec_data.py "
    "and FACTS.md; graphics clocks are NVIDIA's published boost clocks. Measured shares of spec: "
    "FACTS.md says published SM-kernel bandwidth results reach 81-96% of spec, so honest cards "
    "read ~90% (the H200 87.5%: ~4,200 of 4,800, where FACTS.md's correct method read 4,110); "
    "BF16 matmul reads 78-82% of the dense FP32-accumulate spec (our choice inside the 70-85% "
    "a tuned GEMM reaches); a 3090 measures ~92% / ~87% (~860 GB/s, ~62 TFLOPS)."
)

CARDS: dict[str, Card] = {
    "rtx-3090": Card(
        name="NVIDIA GeForce RTX 3090", architecture="ampere", compute_capability="8.6",
        sm_count=82, memory_mib=24_576,  # nvidia-smi's usual reading; not in FACTS.md
        bus_width_bits=384, max_memory_clock_mhz=9_751, sm_clock_mhz=1_695, l2_mb=6,
        bandwidth_gbs=936, bf16_tflops=71, pcie_gen=4, power_w=350, ecc_mode=None,
        has_serial=False, bandwidth_efficiency=0.92, matmul_efficiency=0.87, idle_power_w=25),
    "rtx-4090": Card(
        name="NVIDIA GeForce RTX 4090", architecture="ada", compute_capability="8.9",
        sm_count=128, memory_mib=24_564, bus_width_bits=384, max_memory_clock_mhz=10_501,
        sm_clock_mhz=2_520, l2_mb=72, bandwidth_gbs=1_008, bf16_tflops=165, pcie_gen=4,
        power_w=450, ecc_mode=None, has_serial=False, bandwidth_efficiency=0.90,
        matmul_efficiency=0.82, idle_power_w=25),
    "rtx-5090": Card(
        name="NVIDIA GeForce RTX 5090", architecture="blackwell", compute_capability="12.0",
        sm_count=170, memory_mib=32 * 1024, bus_width_bits=512, max_memory_clock_mhz=14_001,
        sm_clock_mhz=2_407, l2_mb=96, bandwidth_gbs=1_792, bf16_tflops=209, pcie_gen=5,
        power_w=575, ecc_mode=None, has_serial=False, bandwidth_efficiency=0.90,
        matmul_efficiency=0.80, idle_power_w=30),
    "rtx-pro-6000": Card(
        name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition", architecture="blackwell",
        compute_capability="12.0", sm_count=188, memory_mib=96 * 1024, bus_width_bits=512,
        max_memory_clock_mhz=14_001, sm_clock_mhz=2_617, l2_mb=128, bandwidth_gbs=1_792,
        # ESTIMATE: no dense BF16 figure is published; the 5090's 209 scaled by SMs (188/170).
        bf16_tflops=231, pcie_gen=5, power_w=600, ecc_mode=1, has_serial=True,
        bandwidth_efficiency=0.90, matmul_efficiency=0.80, idle_power_w=35),
    "h200": Card(
        name="NVIDIA H200", architecture="hopper", compute_capability="9.0", sm_count=132,
        memory_mib=143_771, bus_width_bits=6_144, max_memory_clock_mhz=3_201,
        sm_clock_mhz=1_980, l2_mb=50, bandwidth_gbs=4_800, bf16_tflops=989, pcie_gen=5,
        power_w=700, ecc_mode=1, has_serial=True, bandwidth_efficiency=0.875,
        matmul_efficiency=0.78, idle_power_w=80, nvlink_links=18),  # SXM: 18 NVLink 4 links
    "m4-max": Card(
        # No CUDA and no NVML on a Mac: the probes answer "no GPU" (see simulated_probe_results).
        name="Apple M4 Max", architecture=None, compute_capability=None, sm_count=None,
        memory_mib=128 * 1024, bus_width_bits=None, max_memory_clock_mhz=None,
        # ESTIMATE, as verification/spec_data.py's: Apple publishes no FLOPS figure.
        sm_clock_mhz=None, l2_mb=None, bandwidth_gbs=546, bf16_tflops=16, pcie_gen=None,
        power_w=None, ecc_mode=None, has_serial=False, bandwidth_efficiency=None,
        matmul_efficiency=None, nvlink_links=None),
}

def physics_curve(card_key: str, gpus: int, arch: modelmath.Architecture, quantization: str,
                  engine: str, *, tp: int, tokens_per_pass: float | None = None,
                  faults: Faults | None = None, pcie_gen: int | None = None,
                  max_streams: int = 256) -> tuple[tuple[tuple[int, float], ...], int, float]:
    """(curve, KV tokens, prefill tok/s) of `gpus` cards of CARDS[card_key] serving `arch`:
    the card's character (physics.py) with the hardware faults applied. Raises ValueError
    where the weights do not fit beside any KV cache."""
    card, f = CARDS[card_key], faults or NO_FAULTS
    layout = physics.Layout(gpus, max(1, min(tp, gpus)))
    weights = modelmath.weight_bytes(arch, quantization)
    if weights is None:
        raise ValueError(f"unknown quantization {quantization!r}")
    per_replica = physics.kv_tokens(
        card.memory_mib * 2**20, layout, weights,
        utilization=1.0 if engine == "llama.cpp" else modelmath.GPU_MEMORY_UTILIZATION,
        kv_bytes_per_token=modelmath.kv_bytes_per_token(arch) or 1)
    if per_replica <= 0:
        raise ValueError(f"{weights / 2**30:.0f} GiB of weights do not fit {gpus} x "
                         f"{card.memory_mib / 1024:.0f} GiB")
    clock = (f.memory_clock_mhz / card.max_memory_clock_mhz
             if f.memory_clock_mhz and card.max_memory_clock_mhz else 1.0)
    tflops = card.bf16_tflops * f.compute_factor if card.bf16_tflops else None
    character = physics.CHARACTER[card_key]
    curve = tuple((n, round(physics.aggregate_tps(
        character, bandwidth_gbs=card.bandwidth_gbs * clock, bf16_tflops=tflops, arch=arch,
        quantization=quantization, engine=engine, layout=layout, streams=n,
        pcie_gen=pcie_gen or card.pcie_gen, nvlink=bool(card.nvlink_links and gpus > 1),
        tokens_per_pass=tokens_per_pass, kv_capacity=per_replica), 2))
        for n in physics.curve_levels(max_streams))
    prefill = physics.prefill_tps(character, bf16_tflops=tflops, arch=arch, layout=layout,
                                  engine=engine)
    return curve, per_replica * layout.replicas, prefill


# The host each card sits in, as agent/host.py would read it: typical builds for the card's
# class (a workstation CPU for GeForce cards, a server CPU for datacenter ones). A Mac has no
# /sys/class/net link speed, so it reports none.
HOSTS: dict[str, dict] = {
    "rtx-3090": {"cpu_model": "AMD Ryzen 9 5950X 16-Core Processor", "cpu_cores": 32,
                 "ram_mib": 64 * 1024, "disk_free_gb": 1_650, "net_link_mbps": 2_500},
    "rtx-4090": {"cpu_model": "AMD Ryzen 9 7950X 16-Core Processor", "cpu_cores": 32,
                 "ram_mib": 128 * 1024, "disk_free_gb": 1_720, "net_link_mbps": 10_000},
    "rtx-5090": {"cpu_model": "AMD Ryzen 9 9950X 16-Core Processor", "cpu_cores": 32,
                 "ram_mib": 192 * 1024, "disk_free_gb": 3_480, "net_link_mbps": 10_000},
    "rtx-pro-6000": {"cpu_model": "AMD EPYC 9354 32-Core Processor", "cpu_cores": 64,
                     "ram_mib": 512 * 1024, "disk_free_gb": 6_900, "net_link_mbps": 25_000},
    "h200": {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cpu_cores": 224,
             "ram_mib": 2048 * 1024, "disk_free_gb": 27_600, "net_link_mbps": 100_000},
    "m4-max": {"cpu_model": "Apple M4 Max", "cpu_cores": 16, "ram_mib": 128 * 1024,
               "disk_free_gb": 1_480},
}


@dataclass(frozen=True)
class Faults:
    """Planted faults: how a liar's machine differs from the honest card it is (or pretends to
    be). The defaults plant nothing. `plant` applies them to a profile: NVML spoofs and link
    changes become the profile's NVML fields (what heartbeats report), the engine factors scale
    its serving curve, and simulated_probe_results reads the rest while measuring."""

    # An LD_PRELOAD shim that rewrites NVML's identity answers (FACTS.md: NVML can be faked).
    nvml_name: str | None = None
    nvml_compute_capability: str | None = None
    nvml_architecture: str | None = None
    nvml_memory_mib: int | None = None
    uuid_of: str | None = None  # reports the GPU UUIDs of this other machine id
    memory_clock_mhz: int | None = None  # memory clocked down: bandwidth starved
    power_limit_w: int | None = None  # power limit set below the card's default
    # What NVML's shim says the default power limit is (a capped card calling its cap default)
    nvml_power_default_w: int | None = None
    compute_factor: float = 1.0  # share of the honest matmul figure it still reaches
    pcie_link: tuple[int, int] | None = None  # (gen, width) of the slot it really sits in
    probe_factor: float = 1.0  # hardware probes read this much better than native (WSL2)
    engine_factor: float = 1.0  # share of the honest decode throughput the engine serves
    prefill_factor: float = 1.0  # share of the honest prefill rate
    # Share of the honest throughput (and prefill) it serves any other model (the platform's
    # yardstick, a renter's choice) beyond what the hardware faults above (memory clock,
    # compute) already cost in the physics: None, the engine_factor and prefill_factor (a
    # machine slow whatever it serves: an engine under WSL2); 1, nothing more (the hardware
    # faults alone, or a liar that slows only its own model).
    other_model_factor: float | None = None

    @property
    def planted(self) -> bool:
        return self != NO_FAULTS


NO_FAULTS = Faults()



@dataclass(frozen=True)
class Profile:
    key: str
    title: str
    engine: str  # "vllm" or "llama.cpp"
    model: str  # the id the engine's /v1/models reports
    # The weights' format, as the agent reports it: llama-server's GGUF file type (its
    # /v1/models says it), or for vLLM, which never says, what `fleetsim up` tells the agent.
    quantization: str
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
    card: str  # key of CARDS: the hardware really in the machine
    # What the provider's listing claims, per GPU (a liar claims what it pretends to be).
    claimed_gpu_model: str  # a verification/spec_data.py name
    claimed_vram_gb: int
    faults: Faults = NO_FAULTS
    # Tokens per pass over the weights when the engine decodes speculatively (the checkpoint's
    # multi-token-prediction head); None where it does not. vLLM's /metrics counts its drafts.
    tokens_per_pass: float | None = None
    # GPUs per replica (vLLM's --tensor-parallel-size); None: one replica over every GPU.
    tp: int | None = None
    # The checkpoint the engine loaded, where it serves it under another name (vLLM's
    # --served-model-name; its /v1/models `root`); "": the model's own name.
    weights_model: str = ""

    @property
    def checkpoint(self) -> str:
        return self.weights_model or model_data.canonical_name(self.model) or self.model

    def serving(self, model: str, quantization: str, *, engine: str | None = None,
                tp: int | None = None, context_length: int | None = None,
                max_concurrency: int | None = None,
                tokens_per_pass: float | None = None) -> Profile:
        """This machine serving `model` at `quantization` in place of its own model: its curve
        from the real card's character (physics.py) with the hardware faults applied (a memory
        clock cut, a power cap), times `Faults.other_model_factor`. Raises ValueError for a
        model fleetsim does not know or whose weights do not fit."""
        engine = engine or ("llama.cpp" if quantization.strip().lower() in modelmath.GGUF_TYPES
                            else "vllm")
        if (model, quantization, engine, tp, tokens_per_pass) == (
                self.model, self.quantization, self.engine, self.tp, self.tokens_per_pass):
            return self
        checkpoint = self.checkpoint if model == self.model else model
        arch = model_data.architecture_for(checkpoint)
        if arch is None:
            raise ValueError(f"fleetsim does not know the model {model!r}")
        f = self.faults
        factor, prefill_factor = ((f.engine_factor, f.prefill_factor)
                                  if f.other_model_factor is None
                                  else (f.other_model_factor, f.other_model_factor))
        slots = max_concurrency or (4 if engine == "llama.cpp" else 256)
        curve, kv_tokens, prefill = physics_curve(
            self.card, self.gpu_count, arch, quantization, engine, tp=tp or self.gpu_count,
            tokens_per_pass=tokens_per_pass, faults=f, pcie_gen=self.pcie_gen_max,
            max_streams=slots)
        context = min(n for n in (context_length, arch.max_context, kv_tokens) if n)
        return replace(
            self, model=model, weights_model=self.weights_model if model == self.model else "",
            quantization=quantization, engine=engine, tp=tp,
            tokens_per_pass=tokens_per_pass, max_concurrency=slots, context_length=context,
            kv_cache_tokens=kv_tokens, prefill_tps=round(prefill * prefill_factor, 1),
            throughput=tuple((n, round(t * factor, 2)) for n, t in curve))

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

# The machines no figure is published for serve what their card's character says (physics.py:
# the 4090's fitted on the published 2x RTX 4090 pair, the Mac's estimated): ESTIMATES, computed
# the same way for their own model as for any other they are asked to serve.
def _estimated(card_key: str, gpus: int, model: str, quantization: str, *, engine: str = "vllm",
               tokens_per_pass: float | None = None, max_streams: int = 32
               ) -> tuple[tuple[int, float], ...]:
    curve, _, _ = physics_curve(card_key, gpus, model_data.architecture_for(model), quantization,
                                engine, tp=gpus, tokens_per_pass=tokens_per_pass,
                                max_streams=max_streams)
    return curve


# One RTX 4090 with a 4-bit (AWQ) build of the 27B that keeps its multi-token-prediction head.
_1X4090_TP = _estimated("rtx-4090", 1, MODEL_27B, "awq-int4",
                        tokens_per_pass=physics.SPEC_TOKENS_PER_PASS)
# 27B at ~4.25 bits per weight (4-bit groups plus their scales).
_INT4_GIB = 27e9 * 4.25 / 8 / 2**30

# Apple M4 Max: no published tok/s in FACTS.md. Decode of one stream reads every weight once
# per token: 546 GB/s / ~16 GB of Q4_K_M weights (27B x ~4.8 bits) = ~34 tok/s ceiling;
# llama.cpp on Metal reaches ~70% of the bandwidth, and its four parallel slots share each
# weight read but little matmul (physics.py's estimate): ~18 alone, ~48 at 4 slots.
_M4_TP = _estimated("m4-max", 1, MODEL_27B, "Q4_K_M", engine="llama.cpp", max_streams=4)

_HONEST_PROFILES: dict[str, Profile] = {
    p.key: p
    for p in (
        Profile(
            key="rtx-pro-6000",
            title="1x RTX PRO 6000 Blackwell 96 GB (vLLM)",
            engine="vllm",
            model=MODEL_27B,
            # 8-bit weights: the only reading under which the fleet's four single-stream figures
            # fit one bandwidth law (verification/predict.py). 96 GB holds them (~27 GB) and
            # many full-length requests (~9.3 GiB of KV each at 262,144 tokens, FACTS.md).
            quantization="fp8",
            context_length=262_144,
            # Measured up to 32 concurrent; beyond it we queue rather than claim more.
            max_concurrency=32,
            throughput=_PRO6000_TP,
            tokens_per_pass=physics.SPEC_TOKENS_PER_PASS,
            prefill_tps=_prefill_for(_PRO6000_TP),
            prefix_cache=True,
            kv_cache_tokens=_kv_tokens(96, _FP8_GIB),
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
            card="rtx-pro-6000",
            claimed_gpu_model="RTX PRO 6000 Blackwell",
            claimed_vram_gb=96,
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
            quantization="fp8",
            # 48 GB cannot hold BF16 weights, so FP8 (~25 GiB). The ~500k tokens of KV left are
            # shared by up to 32 requests; capping a request at 65,536 tokens keeps one long
            # prompt from evicting everyone else (24 GB cards need per-node engine settings).
            context_length=65_536,
            max_concurrency=32,
            throughput=_4090_TP,
            tokens_per_pass=physics.SPEC_TOKENS_PER_PASS,
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
            card="rtx-4090",
            claimed_gpu_model="RTX 4090",
            claimed_vram_gb=24,
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
            quantization="fp8",
            # FP8 weights like the 4090 pair (BF16 would leave 64 GB too little KV room); ~900k
            # tokens of KV hold several full-length 262,144-token requests.
            context_length=262_144,
            max_concurrency=32,
            throughput=_5090_TP,
            tokens_per_pass=physics.SPEC_TOKENS_PER_PASS,
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
            card="rtx-5090",
            claimed_gpu_model="RTX 5090",
            claimed_vram_gb=32,
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
            quantization="fp8",  # as the fleet's other machines (rtx-pro-6000)
            context_length=262_144,
            max_concurrency=128,  # measured up to 128 concurrent
            throughput=_H200_TP,
            tokens_per_pass=physics.SPEC_TOKENS_PER_PASS,
            prefill_tps=_prefill_for(_H200_TP),
            prefix_cache=True,
            kv_cache_tokens=_kv_tokens(143_771 / 1024, _FP8_GIB),
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
            card="h200",
            claimed_gpu_model="H200",
            claimed_vram_gb=141,
            sources=(
                "tok/s: fleet operator's published measurements (FACTS.md), 163-176 alone "
                "(we use 170) and 3,342 at 128 concurrent. GPU facts: FACTS.md spec table "
                "(H200 SXM, 700 W, PCIe 5, CC 9.0); memory 143,771 MiB as NVML reports it. "
                + _PREFILL_NOTE
            ),
        ),
        Profile(
            key="rtx-4090",
            title="1x RTX 4090 24 GB, 27B at 4 bits (vLLM)",
            engine="vllm",
            # A 4-bit (AWQ) build of the same 27B, served under the canonical name
            # (--served-model-name), so routing sees one model across the fleet.
            model=MODEL_27B,
            quantization="awq-int4",
            # ~230k tokens of KV are left beside ~14 GiB of weights; 32,768 per request keeps
            # one long prompt from evicting everyone else (24 GB cards need per-node settings).
            context_length=32_768,
            max_concurrency=32,
            throughput=_1X4090_TP,
            tokens_per_pass=physics.SPEC_TOKENS_PER_PASS,
            prefill_tps=_prefill_for(_1X4090_TP),
            prefix_cache=True,
            kv_cache_tokens=_kv_tokens(24_564 / 1024, _INT4_GIB),
            gpu_name="NVIDIA GeForce RTX 4090",
            gpu_count=1,
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
            card="rtx-4090",
            claimed_gpu_model="RTX 4090",
            claimed_vram_gb=24,
            sources=(
                "ESTIMATE derived from the 2x-rtx-4090 figures (FACTS.md: 94 alone, 435 at 32): "
                "one stream reads the same bytes per card per token (FP8 split over two cards vs "
                "4-bit on one, both at 1,008 GB/s), so ~the same ceiling, less a little for "
                "dequantising: 90 alone; batched decode is compute-bound and one card has half "
                "the pair's compute: 435 / 2 = ~218 at 32. GPU facts: FACTS.md spec table (450 "
                "W, PCIe 4, CC 8.9); memory 24,564 MiB as NVML reports it. " + _PREFILL_NOTE
            ),
        ),
        Profile(
            key="m4-max-llamacpp",
            title="Apple M4 Max 128 GB unified (llama.cpp, Q4_K_M)",
            engine="llama.cpp",
            # llama-server reports its --alias as the model id; the provider sets it to the
            # canonical name so the platform routes to it like any other worker.
            model=MODEL_27B,
            quantization="Q4_K_M",
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
            card="m4-max",
            claimed_gpu_model="Apple M4 Max",
            claimed_vram_gb=128,
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


# Two models the published serving reference does not cover, served by honest machines whose
# peers the verification benchmark's liars must be judged against: ESTIMATES from their cards'
# character (physics.py), neither model decoding more than one token a pass.
MODEL_LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
MODEL_MISTRAL_24B = "mistralai/Mistral-Small-24B-Instruct-2501"
_PRO6000_LLAMA8B_TP = _estimated("rtx-pro-6000", 1, MODEL_LLAMA_8B, "bf16")
_4090X2_MISTRAL24B_TP = _estimated("rtx-4090", 2, MODEL_MISTRAL_24B, "fp8")

_HONEST_PROFILES |= {p.key: p for p in (
    replace(
        _HONEST_PROFILES["rtx-pro-6000"], key="rtx-pro-6000-llama8b",
        title="1x RTX PRO 6000 Blackwell 96 GB, Llama-3.1-8B (vLLM)", model=MODEL_LLAMA_8B,
        quantization="bf16", context_length=131_072, throughput=_PRO6000_LLAMA8B_TP,
        tokens_per_pass=None,
        # a third of the 27B's FLOPs per token
        prefill_tps=round(_prefill_for(_PRO6000_LLAMA8B_TP) * 3, 1),
        # 128 KiB of KV per token (FACTS.md) beside 16 GB of weights in 90% of 96 GB
        kv_cache_tokens=int((96 * 0.9 - 16) * 2**30 / 131_072),
        sources=("ESTIMATE (no published figure for this model): the RTX PRO 6000's character "
                 "(fleetsim/physics.py, fitted on its published 27B figures) serving it; "
                 "hardware as rtx-pro-6000. " + _PREFILL_NOTE)),
    replace(
        _HONEST_PROFILES["2x-rtx-4090"], key="2x-rtx-4090-mistral24b",
        title="2x RTX 4090 24 GB, Mistral-Small-24B, tensor parallel (vLLM)",
        model=MODEL_MISTRAL_24B, quantization="fp8", context_length=32_768,
        tokens_per_pass=None,
        throughput=_4090X2_MISTRAL24B_TP, prefill_tps=_prefill_for(_4090X2_MISTRAL24B_TP),
        # 40 layers x 8 KV heads x 128 x 2 x 2 bytes = 160 KiB a token beside 24 GB of weights
        kv_cache_tokens=int((2 * 24 * 0.9 - 24) * 2**30 / 163_840),
        sources=("ESTIMATE (no published figure for this model): the RTX 4090's character "
                 "(fleetsim/physics.py, fitted on the published pair's 27B figures) serving it; "
                 "hardware as 2x-rtx-4090. " + _PREFILL_NOTE)),
)}


def plant(base: Profile, *, key: str, faults: Faults, sources: str, title: str | None = None,
          card: str | None = None, throughput: tuple[tuple[int, float], ...] | None = None,
          claimed_gpu_model: str | None = None, claimed_vram_gb: int | None = None,
          **changes) -> Profile:
    """`base` with `faults` planted: NVML reports the spoofed identity, memory, power limit and
    link; the engine serves `engine_factor` of the base curve (or `throughput`, given whole)
    and prefills at `prefill_factor`; probes measure the real `card` with the faults applied.
    The listing claims what the base claims unless told otherwise."""
    real = CARDS[card or base.card]
    gen, width = faults.pcie_link or (base.pcie_gen_max, base.pcie_width_max)
    if throughput is None:
        throughput = tuple((n, round(t * faults.engine_factor, 2)) for n, t in base.throughput)
    return replace(
        base,
        key=key,
        title=title or base.title,
        card=card or base.card,
        faults=faults,
        sources=sources,
        throughput=throughput,
        prefill_tps=round(base.prefill_tps * faults.prefill_factor, 1),
        gpu_name=faults.nvml_name or real.name,
        memory_total_mib=faults.nvml_memory_mib or real.memory_mib,
        compute_capability=faults.nvml_compute_capability or real.compute_capability,
        power_limit_w=faults.power_limit_w or real.power_w,
        pcie_gen_current=gen,
        pcie_gen_max=gen,
        pcie_width_current=width,
        pcie_width_max=width,
        claimed_gpu_model=claimed_gpu_model or base.claimed_gpu_model,
        claimed_vram_gb=claimed_vram_gb or base.claimed_vram_gb,
        **changes,
    )


_H = _HONEST_PROFILES
# liar-3090-as-4090's engine: a 3090 in place of the 4090, serving what a 3090 serves (its
# character, physics.py: ESTIMATE).
_3090_TP = _estimated("rtx-3090", 1, MODEL_27B, "awq-int4",
                      tokens_per_pass=physics.SPEC_TOKENS_PER_PASS)
# liar-bandwidth-starved: memory locked at 6,801 of 10,501 MHz; decode reads weights at that
# clock's share of the bandwidth, so it serves in proportion; prefill is compute-bound.
_STARVED_CLOCK_MHZ = 6_801
# liar-power-capped: 250 W of 450 reaches ~60% of the BF16 spec (0.73 of an honest 4090's ~82%);
# decode is mostly bandwidth-bound and loses less (ESTIMATE: 0.8).
_CAPPED_COMPUTE = 0.73

_PLANTED_PROFILES: dict[str, Profile] = {
    p.key: p
    for p in (
        plant(
            _H["rtx-4090"], key="liar-3090-as-4090", card="rtx-3090",
            title="1x \"RTX 4090\" 24 GB that is a 3090 (vLLM)",
            faults=Faults(nvml_name="NVIDIA GeForce RTX 4090", nvml_compute_capability="8.9",
                          nvml_architecture="ada", prefill_factor=round(71 / 165, 3)),
            throughput=_3090_TP,
            sources=(
                "PLANTED: an RTX 3090 whose NVML shim reports an RTX 4090 (name, compute "
                "capability, architecture); CUDA still says 8.6 with 82 SMs, it measures like a "
                "3090 (~860 GB/s, ~62 TFLOPS) and serves like one (the 3090's character, "
                "fleetsim/physics.py: ESTIMATE); prefill x 71/165. " + _CARD_NOTE
            ),
        ),
        plant(
            _H["rtx-4090"], key="liar-48gb", claimed_vram_gb=48,
            title="1x RTX 4090 claiming 48 GB (vLLM)",
            faults=Faults(nvml_memory_mib=48 * 1024),
            sources=(
                "PLANTED: an honest 24 GB RTX 4090 whose NVML memory is spoofed to 49,152 MiB "
                "and whose listing claims 48 GB; the VRAM check allocates only what 24 GB "
                "holds (~22 GB tested). Serves like rtx-4090. " + _CARD_NOTE
            ),
        ),
        plant(
            _H["rtx-4090"], key="liar-bandwidth-starved",
            title="1x RTX 4090 with its memory clock cut (vLLM)",
            faults=Faults(memory_clock_mhz=_STARVED_CLOCK_MHZ,
                          engine_factor=round(_STARVED_CLOCK_MHZ / 10_501, 3),
                          other_model_factor=1.0),
            sources=(
                "PLANTED: an RTX 4090 with its memory clock locked at 6,801 of 10,501 MHz: "
                "theoretical 653 GB/s, measured ~58% of the 1,008 GB/s spec, and the engine "
                "serves x 0.648 (decode is bandwidth-bound; prefill is not). " + _CARD_NOTE
            ),
        ),
        plant(
            _H["rtx-4090"], key="liar-power-capped",
            title="1x RTX 4090 capped at 250 W (vLLM)",
            faults=Faults(power_limit_w=250, compute_factor=_CAPPED_COMPUTE, engine_factor=0.8,
                          prefill_factor=_CAPPED_COMPUTE, other_model_factor=1.0),
            sources=(
                "PLANTED: an RTX 4090 with its power limit at 250 W (default 450): BF16 matmul "
                "~60% of spec, SM clock down, sw_power_cap throttling; bandwidth unharmed; the "
                "engine serves x 0.8 (ESTIMATE: decode is mostly bandwidth-bound) and prefills "
                "x 0.73. " + _CARD_NOTE
            ),
        ),
        plant(
            _H["rtx-4090"], key="liar-gen3-x1",
            title="1x RTX 4090 on a PCIe Gen3 x1 riser (vLLM)",
            faults=Faults(pcie_link=(3, 1)),
            sources=(
                "PLANTED: an RTX 4090 on a mining-style Gen3 x1 riser: NVML max and current link "
                "Gen3 x1, host<->device ~0.8 GB/s (80% of 0.985 GB/s). Once the weights are "
                "loaded decode barely crosses the link, so it serves like rtx-4090. " + _CARD_NOTE
            ),
        ),
        plant(
            _H["2x-rtx-4090"], key="2x-rtx-4090-wsl2",
            title="2x RTX 4090 24 GB under Windows/WSL2 (vLLM)",
            # Same cards as 2x-rtx-4090 and a newer driver: every hardware probe looks as good
            # or better; only serving speed and the WSL kernel string give it away.
            faults=Faults(engine_factor=_WSL2_FACTOR, prefill_factor=_WSL2_FACTOR,
                          probe_factor=1.05),
            driver_version="565.77",
            cuda_version="12.7",
            os="Linux 5.15.167.4-microsoft-standard-WSL2",
            sources=(
                "PLANTED (WSL2): the 2x-rtx-4090 curve (94 alone, 435 at 32; FACTS.md) times "
                "0.52: the fleet operator published that the same 4090 machine under "
                "Windows/WSL2 serves 48% slower although it benchmarks better on every hardware "
                "probe (we read its probes 5% above native, beyond the +-2% jitter). Hardware "
                "facts as 2x-rtx-4090 with a newer driver. Prefill scaled by the same 0.52. "
                + _PREFILL_NOTE
            ),
        ),
        plant(
            _H["h200"], key="liar-duplicate-uuid",
            title="1x H200 reporting another machine's GPU UUID (vLLM)",
            faults=Faults(uuid_of="h200-1"),
            sources=(
                "PLANTED: an honest H200 that reports the GPU UUID of machine h200-1 (FACTS.md: "
                "a UUID seen on two machines at once is a spoof). Everything else as h200."
            ),
        ),
        plant(
            _H["rtx-pro-6000-llama8b"], key="liar-slow-llama8b",
            title="1x RTX PRO 6000 serving Llama-3.1-8B at a third of its peers (vLLM)",
            faults=Faults(engine_factor=0.32, prefill_factor=0.32),
            sources=(
                "PLANTED: an RTX PRO 6000 with honest hardware probes whose engine serves a "
                "model the published reference does not cover at 32% of rtx-pro-6000-llama8b."
            ),
        ),
        plant(
            _H["2x-rtx-4090-mistral24b"], key="liar-slow-mistral24b",
            title="2x RTX 4090 serving Mistral-Small-24B like a WSL2 pair, bare-metal probes",
            faults=Faults(engine_factor=0.53, prefill_factor=0.53),
            sources=(
                "PLANTED: two RTX 4090s with full bare-metal probe figures and a Linux kernel "
                "whose engine serves 53% of its peer 2x-rtx-4090-mistral24b, as the WSL2 pair "
                "does (FACTS.md: 48% slower), on a model the published reference lacks."
            ),
        ),
        plant(
            _H["h200"], key="liar-h200-300w",
            title="1x H200 capped at 300 W that calls 300 W its default (vLLM)",
            faults=Faults(power_limit_w=300, nvml_power_default_w=300, compute_factor=0.85,
                          engine_factor=0.8, prefill_factor=0.6),
            sources=(
                "PLANTED: an H200 with its power limit at 300 W of 700 and an NVML shim that "
                "reports 300 W as the default limit too; a short matmul still reaches 85% of an "
                "honest one, decode (bandwidth-bound) loses 20% (ESTIMATE)."
            ),
        ),
        plant(
            _H["rtx-pro-6000"], key="liar-slow-engine",
            title="1x RTX PRO 6000 with a misconfigured engine (vLLM)",
            faults=Faults(engine_factor=0.3, prefill_factor=0.3),
            sources=(
                "PLANTED: an honest RTX PRO 6000 (hardware probes honest) whose engine serves "
                "30% of rtx-pro-6000's throughput and prefill, like a 24 GB card's engine flags "
                "applied to it (FACTS.md: a 5090 ran at 8% of its bandwidth that way)."
            ),
        ),
    )
}

# Liars that neither peers nor a published figure could catch before the yardstick: a model
# whose name states no size, a GPU count no other machine has, two slow machines with only each
# other as peers, a slow Mac. Each at 40-60% of what the honest machine serves.
MODEL_HOUSE = "acme/house-blend"  # a name that states no size: the 27B under another name
_ARCH_27B = model_data.architecture_for(MODEL_27B)
# Three RTX 4090s serve the 27B as their character says (no published figure: ESTIMATE).
_3X4090_TP, _3X4090_KV, _ = physics_curve(
    "rtx-4090", 3, _ARCH_27B, "fp8", "vllm", tp=3,
    tokens_per_pass=physics.SPEC_TOKENS_PER_PASS, max_streams=32)
_5090X2_MISTRAL24B_TP, _5090X2_MISTRAL24B_KV, _ = physics_curve(
    "rtx-5090", 2, model_data.architecture_for(MODEL_MISTRAL_24B), "fp8", "vllm", tp=2,
    max_streams=32)


def _times(curve: tuple[tuple[int, float], ...], factor: float) -> tuple[tuple[int, float], ...]:
    return tuple((n, round(t * factor, 2)) for n, t in curve)


_PLANTED_PROFILES |= {p.key: p for p in (
    plant(
        _H["2x-rtx-5090"], key="liar-nosize-5090x2", model=MODEL_HOUSE,
        weights_model=model_data.canonical_name(MODEL_27B),
        title="2x RTX 5090 serving a model whose name states no size, at 40% (vLLM)",
        faults=Faults(engine_factor=0.4, prefill_factor=0.4, other_model_factor=1.0),
        sources=("PLANTED: an honest pair of RTX 5090s serving the 27B under a name that states "
                 "no size (vLLM's --served-model-name; its weights are the 27B's, on disk where "
                 "the agent reads them) at 40% of 2x-rtx-5090, and the platform's yardstick at "
                 "full speed.")),
    plant(
        _H["2x-rtx-4090"], key="liar-3x4090", gpu_count=3, throughput=_times(_3X4090_TP, 0.6),
        kv_cache_tokens=_3X4090_KV,
        title="3x RTX 4090 serving the 27B at 60% of what three honest cards do (vLLM)",
        faults=Faults(engine_factor=0.6, prefill_factor=0.6),
        sources=("PLANTED: three RTX 4090s, a count no other machine of the fleet has, serving "
                 "the 27B and the platform's yardstick at 60% of what the 4090's character "
                 "(fleetsim/physics.py) serves on three cards; probes honest.")),
    plant(
        _H["2x-rtx-5090"], key="liar-twin-5090-24b", model=MODEL_MISTRAL_24B,
        quantization="fp8", tokens_per_pass=None, context_length=32_768,
        throughput=_times(_5090X2_MISTRAL24B_TP, 0.5), kv_cache_tokens=_5090X2_MISTRAL24B_KV,
        title="2x RTX 5090 serving Mistral-Small-24B at half speed: one of two twins (vLLM)",
        faults=Faults(engine_factor=0.5, prefill_factor=0.5, other_model_factor=1.0),
        sources=("PLANTED: a pair of RTX 5090s serving Mistral-Small-24B at 50% of what the "
                 "5090's character (fleetsim/physics.py) serves, beside a twin as slow and no "
                 "honest machine on that model; the platform's yardstick at full speed.")),
    plant(
        _H["m4-max-llamacpp"], key="liar-slow-m4",
        title="Apple M4 Max serving at 45% of an honest M4 Max (llama.cpp)",
        faults=Faults(engine_factor=0.45, prefill_factor=0.45),
        sources=("PLANTED: an M4 Max (no probes: a Mac has no CUDA) whose engine serves 45% "
                 "of m4-max-llamacpp, whatever model, beside that honest Mac.")),
)}

PROFILES: dict[str, Profile] = _HONEST_PROFILES | _PLANTED_PROFILES

# The verification benchmark's fleet: one machine per key, so `python -m fleetsim up --planted`
# names them <key>-1 and liar-duplicate-uuid copies the UUID of the real h200-1.
HONEST: set[str] = {"h200", "rtx-pro-6000", "2x-rtx-5090", "2x-rtx-4090", "rtx-4090",
                    "m4-max-llamacpp", "rtx-pro-6000-llama8b", "2x-rtx-4090-mistral24b"}
LIARS: dict[str, str] = {
    "liar-3090-as-4090": "an RTX 3090 whose NVML says RTX 4090 (CUDA: CC 8.6, 82 SMs)",
    "liar-48gb": "a 24 GB RTX 4090 whose NVML and listing say 48 GB",
    "liar-bandwidth-starved": "an RTX 4090 with its memory clock cut: ~58% of spec bandwidth",
    "liar-power-capped": "an RTX 4090 capped at 250 W of 450: ~60% of spec compute",
    "liar-gen3-x1": "an RTX 4090 on a PCIe Gen3 x1 link: ~0.8 GB/s host<->device",
    "2x-rtx-4090-wsl2": "2x RTX 4090 under WSL2: probes as good as native, serves 52%",
    "liar-duplicate-uuid": "an H200 reporting the GPU UUID of machine h200-1",
    "liar-slow-engine": "an honest RTX PRO 6000 whose engine serves 30% of its throughput",
    "liar-slow-llama8b": "an RTX PRO 6000 serving Llama-3.1-8B at 32% of its fleet peer",
    "liar-slow-mistral24b": "2x RTX 4090, bare-metal probes, serving Mistral-24B at 53% of its "
                            "peer",
    "liar-h200-300w": "an H200 capped at 300 W whose NVML calls 300 W its default",
    "liar-nosize-5090x2": "2x RTX 5090 serving a model whose name states no size at 40%",
    "liar-3x4090": "3x RTX 4090 (a count nobody else has) serving at 60%, yardstick too",
    "liar-twin-5090-24b": "two 2x RTX 5090 twins serving Mistral-24B at 50%, peers of each "
                          "other only",
    "liar-slow-m4": "an Apple M4 Max serving at 45% of the honest M4 Max beside it",
}
# The findings that may catch each liar: flagged on another check alone is not caught.
SERVING = ("serving", "yardstick")  # its own model, or the platform's yardstick
CAUGHT_BY: dict[str, tuple[str, ...]] = {
    "liar-3090-as-4090": ("identity",), "liar-48gb": ("vram",),
    "liar-bandwidth-starved": ("bandwidth",), "liar-power-capped": ("power",),
    "liar-gen3-x1": ("pcie",), "2x-rtx-4090-wsl2": SERVING, "liar-duplicate-uuid": ("uuid",),
    "liar-slow-engine": SERVING, "liar-slow-llama8b": SERVING, "liar-slow-mistral24b": SERVING,
    "liar-h200-300w": ("power",),
    # The yardstick at full speed: only its own model, judged by the size its files give,
    # gives it away.
    "liar-nosize-5090x2": ("serving",), "liar-twin-5090-24b": ("serving",),
    "liar-3x4090": SERVING, "liar-slow-m4": SERVING,
}
# Machines of the fleet that are twice in it (two machines, one key).
TWICE = ("liar-twin-5090-24b",)
PLANTED_FLEET: list[str] = [
    "h200", "rtx-pro-6000", "2x-rtx-5090", "2x-rtx-4090", "rtx-4090", "m4-max-llamacpp",
    "rtx-pro-6000-llama8b", "2x-rtx-4090-mistral24b", *LIARS, *TWICE,
]


def get_profile(key: str) -> Profile:
    try:
        return PROFILES[key]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown fleetsim profile {key!r}; known profiles: {known}") from None


# --- power draw ----------------------------------------------------------------------------

# A busy GPU runs close to its power limit: OUR ESTIMATE is 90% of it at the profile's highest
# measured load. Any work at all raises the clocks and streams the weights from memory, so half
# the way up from idle comes with the first request; the other half grows with the share of
# that top throughput the load reaches. The limits are FACTS.md's spec table's (RTX 4090
# 450 W, RTX 5090 575 W, RTX PRO 6000 600 W, H200 700 W, RTX 3090 350 W), or the cap a liar
# set (liar-power-capped 250 W, liar-h200-300w 300 W).
LOADED_POWER_SHARE = 0.9


def power_draw_w(profile: Profile, running: int) -> int | None:
    """What each GPU of the machine draws (W, as NVML would read it) with `running` requests
    in the engine's batch; None where NVML reads no power (the Mac)."""
    card = CARDS[profile.card]
    limit = profile.faults.power_limit_w or card.power_w
    if card.idle_power_w is None or limit is None:
        return None
    if running <= 0:
        return card.idle_power_w
    busy = LOADED_POWER_SHARE * limit
    share = min(1.0, profile.aggregate_tps(running) / profile.throughput[-1][1])
    return round(card.idle_power_w + (busy - card.idle_power_w) * (0.5 + 0.5 * share))


def gpu_uuid(machine_id: str, index: int) -> str:
    """NVML-style GPU UUID, deterministic per (machine id, GPU index)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{machine_id}/{index}')}"


def reported_uuid(profile: Profile, machine_id: str, index: int) -> str:
    """The UUID a machine reports for its GPU: its own, or the copied machine's."""
    return gpu_uuid(profile.faults.uuid_of or machine_id, index)


def simulated_facts(profile_key: str, machine_id: str) -> dict:
    """The hardware part of a heartbeat (docs/agent-protocol.md), as NVML would report it."""
    p = get_profile(profile_key)
    return {
        "nvidia": p.nvidia,
        "driver_version": p.driver_version,
        "cuda_version": p.cuda_version,
        "os": p.os,
        "host": dict(HOSTS.get(p.card, {})),
        "gpus": [
            {
                "index": i,
                "name": p.gpu_name,
                "uuid": reported_uuid(p, machine_id, i),
                "memory_total_mib": p.memory_total_mib,
                "compute_capability": p.compute_capability,
                "pcie_gen_current": p.pcie_gen_current,
                "pcie_gen_max": p.pcie_gen_max,
                "pcie_width_current": p.pcie_width_current,
                "pcie_width_max": p.pcie_width_max,
                "power_limit_w": p.power_limit_w,
                "nvlink_links": CARDS[p.card].nvlink_links,
            }
            for i in range(p.gpu_count)
        ],
    }


# --- verification probes ----------------------------------------------------------------------

# The job's params when the platform sends none (docs/agent-protocol.md, section 3): the
# agent's own defaults, which need nothing beyond the standard library to import.
DEFAULT_PROBE_PARAMS = DEFAULT_PARAMS
# Run-to-run spread of a measurement: each figure is within +-2% of the card's, seeded by the
# machine id so a machine measures the same every time.
PROBE_JITTER = 0.02
# PCIe payload GB/s per lane after line encoding (8b/10b up to Gen2, 128b/130b after).
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938}
# A pinned copy reaches ~80% of the link: Gen4 x16 ~25 GB/s, Gen5 x16 ~50, Gen3 x1 ~0.8.
HOST_DEVICE_EFFICIENCY = 0.80
VRAM_TESTED_SHARE = 0.90  # the memory test writes and reads back 90% of what is free
# A triad moves three arrays of max(4 x L2, 1 GiB) (STREAM's rule; FACTS.md).
_GIB = 2**30


def simulated_probe_results(profile_key: str, machine_id: str, params: dict | None = None) -> dict:
    """The `probes` job result (docs/agent-protocol.md, section 3) that `machine_id` would post,
    measured the correct way on the profile's real card with its planted faults: NVML facts as
    reported (spoofs included), CUDA's own view, and measurements from the hardware. Honest
    cards read ~90% of spec bandwidth, ~80% of dense BF16 and ~80% of the PCIe link (_CARD_NOTE).
    Deterministic per machine id.

    A machine without CUDA (the Mac) answers as the real agent does there: device "none", no
    GPUs, and a message saying why; the platform then verifies it by its load test alone."""
    p = get_profile(profile_key)
    params = DEFAULT_PROBE_PARAMS | (params or {})
    kernel = p.os.split(" ", 1)[-1]  # "Linux 6.8.0-45-generic" -> "6.8.0-45-generic"
    result = {"device": "cuda", "kernel_release": kernel, "wsl": "microsoft" in kernel.lower(),
              "gpus": [], "errors": []}
    if not p.nvidia:
        return result | {"device": "none", "message": "no GPU: torch sees no CUDA device "
                                                      "(torch.cuda.is_available() is false)"}
    result["gpus"] = [_probe_gpu(p, machine_id, i, params) for i in range(p.gpu_count)]
    return result


def _probe_gpu(p: Profile, machine_id: str, index: int, params: dict) -> dict:
    card, f = CARDS[p.card], p.faults
    rng = random.Random(f"fleetsim-probes/{machine_id}/{index}")

    def jitter() -> float:
        return 1 + rng.uniform(-PROBE_JITTER, PROBE_JITTER)

    def median_of(best: float) -> float:
        # Narrow on purpose: WSL2's medians must stay above native's (its probe_factor 1.05
        # beats the jitter only if best/median spread less than ~0.9%).
        return best * rng.uniform(0.985, 0.993)

    mem_clock = f.memory_clock_mhz or card.max_memory_clock_mhz
    theoretical = round(mem_clock * card.bus_width_bits * 2 / 8 / 1000, 1)
    clock_share = mem_clock / card.max_memory_clock_mhz
    bandwidth = (card.bandwidth_gbs * card.bandwidth_efficiency * clock_share * f.probe_factor
                 * jitter())
    tflops = card.bf16_tflops * card.matmul_efficiency * f.compute_factor * f.probe_factor * jitter()
    link_gbs = PCIE_LANE_GBS[p.pcie_gen_current] * p.pcie_width_current
    h2d = link_gbs * HOST_DEVICE_EFFICIENCY * f.probe_factor * jitter()
    free_bytes = (card.memory_mib - card.reserved_mib) * 2**20  # what the card really has
    tested_bytes = int(free_bytes * VRAM_TESTED_SHARE) // 2**20 * 2**20
    sm_clock = round(card.sm_clock_mhz * f.compute_factor)
    array_bytes = max(4 * (card.l2_mb or 0) * 2**20, _GIB)
    return {
        "index": index,
        "uuid": reported_uuid(p, machine_id, index),
        "facts": {
            "name": p.gpu_name,
            "serial": str(rng.randrange(10**12, 10**13)) if card.has_serial else None,
            "architecture": f.nvml_architecture or card.architecture,
            "compute_capability": p.compute_capability,
            "compute_capability_cuda": card.compute_capability,
            "sm_count": card.sm_count,
            "memory_total_mib": p.memory_total_mib,
            "memory_bus_width_bits": card.bus_width_bits,
            "max_memory_clock_mhz": mem_clock,
            "theoretical_bandwidth_gbs": theoretical,
            "pcie_gen_current": p.pcie_gen_current,
            "pcie_gen_max": p.pcie_gen_max,
            "pcie_width_current": p.pcie_width_current,
            "pcie_width_max": p.pcie_width_max,
            "power_limit_w": p.power_limit_w,
            "power_default_limit_w": f.nvml_power_default_w or card.power_w,
            "power_draw_w": power_draw_w(p, 0),  # the probes read it on an idle engine
            "virtualization_mode": 0,
            "ecc_mode": card.ecc_mode,
            "ecc_errors": 0 if card.ecc_mode is not None else None,
            "driver_version": p.driver_version,
            "cuda_version": p.cuda_version,
        },
        "bandwidth": {
            "kernel": "triad",
            "array_bytes": array_bytes,
            "bytes_per_iteration": 3 * array_bytes,
            "warmup_s": round(params["warmup_s"] + rng.uniform(0.01, 0.05), 2),
            "iterations": params["iterations"],
            "best_gbs": round(bandwidth, 1),
            "median_gbs": round(median_of(bandwidth), 1),
            "sm_clock_mhz": [sm_clock],
            "memory_clock_mhz": [mem_clock],
            "throttle_reasons": ["sw_power_cap"] if f.power_limit_w else [],
        },
        "matmul": {
            "dtype": "bfloat16",
            "n": params["matmul_n"],
            "iterations": params["iterations"],
            "best_tflops": round(tflops, 1),
            "median_tflops": round(median_of(tflops), 1),
        },
        "host_device": {
            "pinned": True,
            "bytes": params["copy_bytes"],
            "h2d_gbs": round(h2d, 2),
            "d2h_gbs": round(median_of(h2d), 2),
        },
        "vram": {"free_bytes": free_bytes, "tested_bytes": tested_bytes, "pattern_ok": True},
    }


def machine_ids(profile_keys: list[str]) -> list[str]:
    """fleetsim's machine ids: each profile key with its count so far (h200-1, h200-2)."""
    seen: dict[str, int] = {}
    ids = []
    for key in profile_keys:
        seen[key] = seen.get(key, 0) + 1
        ids.append(f"{key}-{seen[key]}")
    return ids
