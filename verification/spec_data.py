"""Reference specs of the GPUs Rigshare verifies against, with a source for every figure.

Loaded into `GpuSpec` by a data migration (operators edit the table in admin afterwards); the
evaluator reads rows, not this file. Sources: ../shared/FACTS.md, which quotes NVIDIA datasheets
(via stas00/ml-engineering), the GA102/AD102 whitepapers and press reviews; SM counts and bus
widths from the same whitepapers and NVIDIA product pages.

Dense BF16 tensor TFLOPS is the FP32-accumulate rate, the one a framework's default BF16 GEMM
gets: on GeForce cards it is half the FP16-accumulate headline (a 4090 is ~165, not 330).
"""

DATASHEET = "NVIDIA datasheet, as quoted in FACTS.md (stas00/ml-engineering)"
WHITEPAPER_GA102 = "NVIDIA Ampere GA102 whitepaper (FACTS.md)"
WHITEPAPER_AD102 = "NVIDIA Ada AD102 whitepaper (FACTS.md)"
PRESS_5090 = "press reviews of the RTX 5090 (FACTS.md)"
PRESS_PRO6000 = "press reviews of the RTX PRO 6000 Blackwell (FACTS.md)"
APPLE = "Apple product specifications (FACTS.md)"
# Apple publishes no FLOPS figure: GPU cores x 128 ALUs x 2 (a fused multiply-add) x the GPU
# clock, 16-bit math at the FP32 rate on Apple GPUs. OUR ESTIMATE, for the serving prediction
# (its parallel slots share this math) where no probe measures it.
APPLE_GPU_ESTIMATE = ("ESTIMATE: {cores} GPU cores x 128 ALUs x 2 FLOP x {ghz} GHz; Apple "
                      "publishes no FLOPS figure")

# name, NVML names that identify it, memory GB, bandwidth GB/s, dense BF16 TFLOPS, L2 MB,
# power W, PCIe gen, compute capability, bus width bits, SMs, sources
SPECS = [
    dict(name="RTX 3090", nvml_names=["NVIDIA GeForce RTX 3090"], memory_gb=24,
         bandwidth_gbs=936, bf16_tflops=71, l2_mb=6, power_w=350, pcie_gen=4,
         compute_capability="8.6", bus_width_bits=384, sm_count=82,
         sources={"*": WHITEPAPER_GA102, "bf16_tflops": WHITEPAPER_GA102 + " (FP32 accumulate)"}),
    dict(name="RTX 4090", nvml_names=["NVIDIA GeForce RTX 4090"], memory_gb=24,
         bandwidth_gbs=1008, bf16_tflops=165, l2_mb=72, power_w=450, pcie_gen=4,
         compute_capability="8.9", bus_width_bits=384, sm_count=128,
         sources={"*": WHITEPAPER_AD102,
                  "bf16_tflops": WHITEPAPER_AD102 + " (165 with FP32 accumulate; 330 FP16)"}),
    dict(name="RTX 5090", nvml_names=["NVIDIA GeForce RTX 5090"], memory_gb=32,
         bandwidth_gbs=1792, bf16_tflops=209, l2_mb=96, power_w=575, pcie_gen=5,
         compute_capability="12.0", bus_width_bits=512, sm_count=170,
         sources={"*": PRESS_5090,
                  "bf16_tflops": PRESS_5090 + " (419 with FP16 accumulate; half for FP32)"}),
    dict(name="RTX PRO 6000 Blackwell",
         nvml_names=["NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                     "NVIDIA RTX PRO 6000 Blackwell Server Edition",
                     "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition"],
         memory_gb=96, bandwidth_gbs=1792, bf16_tflops=None, l2_mb=128, power_w=600, pcie_gen=5,
         compute_capability="12.0", bus_width_bits=512, sm_count=188,
         sources={"*": PRESS_PRO6000, "bf16_tflops": "not published plainly (FACTS.md)"}),
    dict(name="A100 80GB SXM", nvml_names=["NVIDIA A100-SXM4-80GB"], memory_gb=80,
         bandwidth_gbs=2039, bf16_tflops=312, l2_mb=40, power_w=400, pcie_gen=4,
         compute_capability="8.0", bus_width_bits=5120, sm_count=108,
         sources={"*": DATASHEET}),
    dict(name="A100 80GB PCIe", nvml_names=["NVIDIA A100 80GB PCIe"], memory_gb=80,
         bandwidth_gbs=1935, bf16_tflops=312, l2_mb=40, power_w=300, pcie_gen=4,
         compute_capability="8.0", bus_width_bits=5120, sm_count=108,
         sources={"*": DATASHEET}),
    dict(name="H100 SXM", nvml_names=["NVIDIA H100 80GB HBM3"], memory_gb=80,
         bandwidth_gbs=3350, bf16_tflops=989, l2_mb=50, power_w=700, pcie_gen=5,
         compute_capability="9.0", bus_width_bits=5120, sm_count=132,
         sources={"*": DATASHEET}),
    dict(name="H100 PCIe", nvml_names=["NVIDIA H100 PCIe"], memory_gb=80,
         bandwidth_gbs=2000, bf16_tflops=756, l2_mb=50, power_w=350, pcie_gen=5,
         compute_capability="9.0", bus_width_bits=5120, sm_count=114,
         sources={"*": DATASHEET}),
    dict(name="H200", nvml_names=["NVIDIA H200", "NVIDIA H200 NVL"], memory_gb=141,
         bandwidth_gbs=4800, bf16_tflops=989, l2_mb=50, power_w=700, pcie_gen=5,
         compute_capability="9.0", bus_width_bits=6144, sm_count=132,
         sources={"*": DATASHEET, "l2_mb": DATASHEET + " (~50)"}),
    dict(name="L40S", nvml_names=["NVIDIA L40S"], memory_gb=48, bandwidth_gbs=864,
         bf16_tflops=362, l2_mb=96, power_w=350, pcie_gen=4, compute_capability="8.9",
         bus_width_bits=384, sm_count=142, sources={"*": DATASHEET}),
    dict(name="Apple M1 Ultra", nvml_names=["Apple M1 Ultra"], memory_gb=128,
         bandwidth_gbs=800, bf16_tflops=21, l2_mb=None, power_w=None, pcie_gen=None,
         compute_capability="", bus_width_bits=None, sm_count=None,
         sources={"*": APPLE, "bf16_tflops": APPLE_GPU_ESTIMATE.format(cores=64, ghz=1.3)}),
    dict(name="Apple M4 Max", nvml_names=["Apple M4 Max"], memory_gb=128,
         bandwidth_gbs=546, bf16_tflops=16, l2_mb=None, power_w=None, pcie_gen=None,
         compute_capability="", bus_width_bits=None, sm_count=None,
         sources={"*": APPLE + " (546 GB/s for the 16-core CPU / 40-core GPU part; 410 for "
                  "14/32)", "bf16_tflops": APPLE_GPU_ESTIMATE.format(cores=40, ghz=1.58)}),
]

FLEET_REPORT = "published GPU-fleet measurements, 27B model on vLLM (FACTS.md)"

# What the same hardware serves elsewhere, by concurrency (output tokens/s, the whole engine):
# the reference for "serves far below what its hardware predicts". Only published figures.
SERVING_REFERENCE = [
    dict(gpu="RTX PRO 6000 Blackwell", count=1, model="Qwen/Qwen3-27B",
         tps={1: 106, 32: 1342}, source=FLEET_REPORT),
    dict(gpu="RTX 4090", count=2, model="Qwen/Qwen3-27B", tps={1: 94, 32: 435},
         source=FLEET_REPORT + ", tensor parallel over PCIe"),
    dict(gpu="RTX 5090", count=2, model="Qwen/Qwen3-27B", tps={1: 152, 32: 1318},
         source=FLEET_REPORT + " (149-156 alone)"),
    dict(gpu="H200", count=1, model="Qwen/Qwen3-27B", tps={1: 170, 128: 3342},
         source=FLEET_REPORT + " (163-176 alone)"),
]


def seed_specs(model) -> None:
    """Write SPECS into the GpuSpec table (the data migration, and tests that flush tables)."""
    for row in SPECS:
        model.objects.update_or_create(name=row["name"], defaults={
            k: ("" if v is None and k == "compute_capability" else v)
            for k, v in row.items() if k != "name"})
