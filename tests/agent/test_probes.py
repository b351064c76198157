"""The verification probes (docs/agent-protocol.md, section 3): arithmetic with a fake timer,
real runs on this CPU with torch, the GPU path on CPU tensors dressed as CUDA, NVML facts
from a fake NVML."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent import probes
from agent.cli import main
from agent.nvml import read_probe_facts, theoretical_bandwidth_gbs
from agent.probes import (
    CpuTimer,
    ProbeError,
    default_array_bytes,
    is_wsl,
    measure_bandwidth,
    measure_matmul,
    resolve_params,
    run_probes,
)
from tests.agent.fakes import (
    H200,
    MIB,
    RTX_4090,
    CudaOnCpu,
    NVMLError_LibraryNotFound,
    NVMLError_NotSupported,
    fake_nvml,
    gpu_properties,
)

torch = pytest.importorskip("torch")
CPU = torch.device("cpu")
GIB = 1024 * MIB

# Small enough for a test on the CPU, with a short warm-up.
SMALL = {"warmup_s": 0.05, "iterations": 5, "array_bytes": 4 * MIB, "matmul_n": 128,
         "copy_bytes": MIB}


class FakeTimer:
    """Runs each measured call for real and says it took the next of `seconds`; its clock
    advances `tick` seconds at each reading."""

    def __init__(self, seconds, tick=0.02):
        self.seconds = list(seconds)
        self.tick = tick
        self.clock = 0.0
        self.calls_in_warm_up = 0

    def now(self):
        self.calls_in_warm_up += 1
        reading = self.clock
        self.clock += self.tick
        return reading

    def measure(self, fn, during=None):
        fn()
        if during is not None:
            during()
        return self.seconds.pop(0)


class CountingTimer(CpuTimer):
    def __init__(self):
        self.measured = 0

    def measure(self, fn, during=None):
        self.measured += 1
        return super().measure(fn, during)


# --- bandwidth ------------------------------------------------------------------------------

def test_triad_counts_three_arrays_per_iteration_and_reports_gb_per_s():
    timer = FakeTimer([0.0002, 0.0001, 0.0004])
    figures = measure_bandwidth(torch, CPU, timer, array_bytes=1_000_000, warmup_s=0.05,
                                iterations=3)
    # 3 x 1,000,000 bytes in 0.2, 0.1 and 0.4 ms: 15, 30 and 7.5 GB/s (10^9 bytes).
    assert figures == {
        "kernel": "triad", "array_bytes": 1_000_000, "bytes_per_iteration": 3_000_000,
        "warmup_s": 0.06,  # the clock read 0, 0.02, 0.04, 0.06: three warm-up runs
        "iterations": 3, "best_gbs": 30.0, "median_gbs": 15.0,
        "sm_clock_mhz": [], "memory_clock_mhz": [], "throttle_reasons": [],
    }
    assert timer.seconds == []  # exactly the requested iterations were timed


def test_triad_arrays_are_whole_float32_words():
    figures = measure_bandwidth(torch, CPU, FakeTimer([0.001]), array_bytes=1_000_003,
                                warmup_s=0, iterations=1)
    assert (figures["array_bytes"], figures["bytes_per_iteration"]) == (1_000_000, 3_000_000)


def test_triad_on_this_cpu_for_real():
    timer = CountingTimer()
    figures = measure_bandwidth(torch, CPU, timer, array_bytes=4 * MIB, warmup_s=0.05,
                                iterations=7)
    assert timer.measured == 7 and figures["iterations"] == 7
    assert figures["warmup_s"] >= 0.05
    assert 0.1 < figures["median_gbs"] <= figures["best_gbs"] < 10_000  # GB/s a CPU can do


def test_a_triad_that_computes_nothing_is_an_error():
    class NoAdd:  # a "device" whose kernel does not run
        def __getattr__(self, name):
            return getattr(torch, name)

        def add(self, *args, **kwargs):
            pass

    with pytest.raises(ProbeError, match="the triad kernel computed wrong values"):
        measure_bandwidth(NoAdd(), CPU, CpuTimer(), array_bytes=MIB, warmup_s=0, iterations=1)


def test_defaults_follow_the_protocol():
    settings = resolve_params({}, gpu=True)
    assert settings.warmup_s >= 1.0 and settings.iterations >= 20
    assert settings.matmul_n == 8192 and settings.copy_bytes == 256 * MIB
    assert settings.array_bytes is None  # decided per GPU from its L2
    # max(4 x L2, 1 GiB) per array
    assert default_array_bytes(gpu_properties(l2_bytes=50 * MIB)) == GIB  # H200: 4 x 50 MiB
    assert default_array_bytes(gpu_properties(l2_bytes=512 * MIB)) == 2 * GIB
    assert default_array_bytes(SimpleNamespace()) == GIB  # a torch that does not say


def test_params_override_defaults_and_bad_ones_are_refused():
    settings = resolve_params({"warmup_s": 2, "iterations": 50, "array_bytes": 8 * MIB,
                               "something_newer": True}, gpu=True)
    assert (settings.warmup_s, settings.iterations, settings.array_bytes) == (2.0, 50, 8 * MIB)
    quick = resolve_params({"quick": True}, gpu=False)
    assert quick.warmup_s < 1 and quick.matmul_n <= 256
    for bad in ({"iterations": 0}, {"iterations": 2.5}, {"iterations": True},
                {"warmup_s": "1"}, {"matmul_n": -1}):
        with pytest.raises(ProbeError, match="params."):
            resolve_params(bad, gpu=True)
    with pytest.raises(ProbeError, match="params.iterations must be an integer"):
        run_probes({"iterations": 0}, device="cpu")


# --- matmul ---------------------------------------------------------------------------------

def test_matmul_counts_two_n_cubed_flops():
    timer = FakeTimer([2e-6, 1e-6, 4e-6])
    figures = measure_matmul(torch, CPU, timer, n=100, warmup_s=0, iterations=3)
    # 2 x 100^3 = 2,000,000 flops in 2, 1 and 4 us: 1, 2 and 0.5 TFLOPS.
    assert figures == {"dtype": "bfloat16", "n": 100, "iterations": 3, "best_tflops": 2.0,
                       "median_tflops": 1.0}


def test_bf16_matmul_on_this_cpu_for_real():
    timer = CountingTimer()
    figures = measure_matmul(torch, CPU, timer, n=128, warmup_s=0.05, iterations=4)
    assert timer.measured == 4 and figures["n"] == 128
    assert 0 < figures["median_tflops"] <= figures["best_tflops"] < 100


# --- the whole run on this CPU --------------------------------------------------------------

def test_run_on_the_cpu():
    result = run_probes(SMALL, device="cpu")
    assert result["device"] == "cpu" and "message" not in result
    assert result["wsl"] is is_wsl(result["kernel_release"])
    [entry] = result["gpus"]
    assert (entry["index"], entry["uuid"]) == (0, None)
    assert entry["facts"]["name"]
    assert set(entry["facts"]) == set(probes.FACT_KEYS)
    bandwidth, matmul = entry["bandwidth"], entry["matmul"]
    assert bandwidth["iterations"] == 5 and bandwidth["warmup_s"] >= 0.05
    assert bandwidth["array_bytes"] == 4 * MIB
    assert 0 < bandwidth["median_gbs"] <= bandwidth["best_gbs"]
    assert 0 < matmul["median_tflops"] <= matmul["best_tflops"]
    assert (entry["host_device"], entry["vram"]) == (None, None)
    assert result["errors"] == ["CPU host_device: no host<->device copy on the CPU",
                                "CPU vram: no device memory to check on the CPU"]
    json.dumps(result, allow_nan=False)  # what the platform gets is plain JSON


def test_one_failing_part_keeps_the_others(monkeypatch):
    def no_matmul(*args, **kwargs):
        raise RuntimeError("bf16 is\nnot supported")

    monkeypatch.setattr(probes, "measure_matmul", no_matmul)
    result = run_probes(SMALL, device="cpu")
    [entry] = result["gpus"]
    assert entry["matmul"] is None and entry["bandwidth"]["best_gbs"] > 0
    assert result["errors"][0] == "CPU matmul: RuntimeError: bf16 is not supported"


def test_probe_command_prints_json(capsys):
    assert main(["probe", "--quick", "--device", "cpu",
                 "--params", json.dumps({"warmup_s": 0.01, "iterations": 2})]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["device"] == "cpu"
    assert result["gpus"][0]["bandwidth"]["array_bytes"] == probes.QUICK_CPU["array_bytes"]
    assert result["gpus"][0]["matmul"]["iterations"] == 2
    assert "CPU: bandwidth..." in err  # progress goes to stderr; stdout stays pure JSON


def test_the_agent_imports_torch_only_to_measure():
    # Providers install torch themselves; the agent loads it when a probe runs, not before.
    code = ("import sys, agent.cli, agent.probes, agent.probe_jobs; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "[]"


# --- no torch, no GPU, WSL ------------------------------------------------------------------

def test_without_torch_the_answer_is_device_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    result = run_probes({}, nvml=fake_nvml([H200]))
    assert (result["device"], result["gpus"], result["errors"]) == ("none", [], [])
    assert result["message"].startswith("no GPU: torch is not installed")
    assert "kernel_release" in result and "wsl" in result


def test_no_torch_probe_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["probe"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "none"


def test_a_cpu_only_torch_is_device_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    result = run_probes({})
    assert (result["device"], result["gpus"]) == ("none", [])
    assert result["message"] == (f"no GPU: torch {torch.__version__} is a CPU-only build; "
                                 "install a CUDA build of torch")


@pytest.mark.parametrize(
    ("release", "wsl"),
    [("5.15.153.1-microsoft-standard-WSL2", True), ("4.4.0-19041-Microsoft", True),
     ("6.8.0-45-generic", False), ("24.3.0", False)],
)
def test_wsl_is_told_by_the_kernel_release(monkeypatch, release, wsl):
    assert is_wsl(release) is wsl
    monkeypatch.setattr(probes.platform, "release", lambda: release)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert run_probes({})["wsl"] is wsl
    assert run_probes({})["kernel_release"] == release


# --- facts from NVML ------------------------------------------------------------------------

H200_PROBE_FACTS = {
    "name": "NVIDIA H200", "uuid": H200["uuid"], "serial": "1654922012345",
    "architecture": "hopper", "compute_capability": "9.0", "memory_total_mib": 143_771,
    "memory_bus_width_bits": 6144, "max_memory_clock_mhz": 3201,
    "theoretical_bandwidth_gbs": 4917.0,  # 3,201 MHz x 6,144 bits x 2 / 8
    "pcie_gen_current": 5, "pcie_gen_max": 5, "pcie_width_current": 16, "pcie_width_max": 16,
    "power_limit_w": 700, "power_default_limit_w": 700, "virtualization_mode": 0,
    "ecc_mode": 1, "ecc_errors": 0, "driver_version": "560.35.03", "cuda_version": "12.6",
    "power_draw_w": 113,  # 112,640 mW now
}


def test_h200_probe_facts():
    nvml = fake_nvml([H200])
    assert read_probe_facts(nvml, nvml.nvmlDeviceGetHandleByIndex(0)) == H200_PROBE_FACTS


def test_theoretical_bandwidth():
    assert theoretical_bandwidth_gbs(3201, 6144) == 4917.0  # H200 (spec 4,800)
    assert theoretical_bandwidth_gbs(10501, 384) == 1008.0  # RTX 4090 (spec 1,008)
    assert theoretical_bandwidth_gbs(None, 6144) is None
    assert theoretical_bandwidth_gbs(3201, 0) is None


def test_facts_nvml_refuses_are_null():
    nvml = fake_nvml([RTX_4090], driver=NVMLError_NotSupported("Not Supported"))
    facts = read_probe_facts(nvml, nvml.nvmlDeviceGetHandleByIndex(0))
    assert (facts["serial"], facts["ecc_mode"], facts["ecc_errors"]) == (None, None, None)
    assert facts["driver_version"] is None
    assert (facts["architecture"], facts["theoretical_bandwidth_gbs"]) == ("ada", 1008.0)

    gpu = {**H200, "memory_bus_width": NVMLError_NotSupported("Not Supported"),
           "architecture": 99}
    del gpu["serial"]
    nvml = fake_nvml([gpu])
    facts = read_probe_facts(nvml, nvml.nvmlDeviceGetHandleByIndex(0))
    assert facts["memory_bus_width_bits"] is None and facts["theoretical_bandwidth_gbs"] is None
    assert facts["architecture"] == "unknown (99)" and facts["serial"] is None
    assert facts["max_memory_clock_mhz"] == 3201


def test_facts_of_a_lost_gpu_are_all_null():
    facts = read_probe_facts(fake_nvml([]), None)
    assert all(value is None for key, value in facts.items()
               if key not in ("driver_version", "cuda_version"))


# --- the GPU path, on CPU tensors dressed as CUDA --------------------------------------------

@pytest.fixture
def cuda_h200(monkeypatch):
    fake = CudaOnCpu(torch, [gpu_properties()], free_bytes=8 * MIB)
    monkeypatch.setattr(probes, "load_torch", lambda: (fake, None))
    return fake


def link_that_speeds_up_under_load():
    """The first reading (facts, at idle) says gen 1; every later one (during the copy) 5."""
    readings = iter([1])
    return lambda: next(readings, 5)


def test_gpu_path(cuda_h200):
    nvml = fake_nvml([{**H200, "pcie_gen_current": link_that_speeds_up_under_load(),
                       "clocks_event_reasons": 0x4 | 0x1}])
    result = run_probes(SMALL, nvml=nvml)
    assert result["errors"] == []
    assert result["device"] == "cuda"
    [entry] = result["gpus"]
    assert (entry["index"], entry["uuid"]) == (0, H200["uuid"])
    expected = {k: v for k, v in H200_PROBE_FACTS.items() if k != "uuid"}
    assert entry["facts"] == {**expected, "compute_capability_cuda": "9.0", "sm_count": 132}
    assert list(entry["facts"]) == list(probes.FACT_KEYS)  # the documented order
    bandwidth = entry["bandwidth"]
    assert bandwidth["array_bytes"] == 4 * MIB and bandwidth["iterations"] == 5
    assert 0 < bandwidth["median_gbs"] <= bandwidth["best_gbs"]
    # Clocks and reasons sampled during the run; "GPU idle" is not a throttle reason.
    assert (bandwidth["sm_clock_mhz"], bandwidth["memory_clock_mhz"]) == ([1980], [3201])
    assert bandwidth["throttle_reasons"] == ["sw_power_cap"]
    assert entry["matmul"]["n"] == 128 and entry["matmul"]["best_tflops"] > 0
    copy = entry["host_device"]
    assert (copy["pinned"], copy["bytes"]) == (True, MIB)
    assert copy["h2d_gbs"] > 0 and copy["d2h_gbs"] > 0
    assert True in cuda_h200.pinned  # the host side of the copy is pinned
    assert entry["vram"] == {"free_bytes": 8 * MIB, "tested_bytes": int(8 * MIB * 0.9) // 8 * 8,
                             "pattern_ok": True}
    assert cuda_h200.synchronized > 0  # the warm-up waits for the device
    assert nvml.calls[0] == "init" and nvml.calls[-1] == "shutdown"
    json.dumps(result, allow_nan=False)


def test_default_gpu_array_is_max_of_4_l2_and_1_gib(cuda_h200, monkeypatch):
    sizes = []
    monkeypatch.setattr(probes, "measure_bandwidth",
                        lambda *args, array_bytes, **kwargs: sizes.append(array_bytes))
    run_probes({**SMALL, "array_bytes": None}, nvml=None)
    assert sizes == [GIB]


def test_nvml_and_cuda_number_gpus_differently(cuda_h200):
    # CUDA_VISIBLE_DEVICES shows CUDA only the H200, which NVML lists second: the uuid matches
    # them, and the result uses NVML's index, as the heartbeat does.
    result = run_probes(SMALL, nvml=fake_nvml([RTX_4090, H200]))
    [entry] = result["gpus"]
    assert (entry["index"], entry["uuid"], entry["facts"]["name"]) == (1, H200["uuid"],
                                                                       "NVIDIA H200")


def test_a_gpu_nvml_does_not_know(cuda_h200):
    result = run_probes(SMALL, nvml=fake_nvml([RTX_4090]))
    [entry] = result["gpus"]
    assert entry["facts"]["name"] == "NVIDIA H200"  # CUDA's word
    assert entry["facts"]["serial"] is None and entry["bandwidth"] is not None
    assert "NVML does not know CUDA's GPU-5b1c0d2e" in result["errors"][0]


def test_without_nvml_cuda_still_measures(cuda_h200):
    nvml = fake_nvml([H200], init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found"))
    result = run_probes(SMALL, nvml=nvml)
    [entry] = result["gpus"]
    assert entry["facts"]["sm_count"] == 132 and entry["facts"]["memory_bus_width_bits"] is None
    assert entry["bandwidth"]["sm_clock_mhz"] == [] and entry["vram"]["pattern_ok"] is True
    assert result["errors"] == ["NVML: NVML Shared Library Not Found; its facts, clocks and "
                                "link are null"]


def test_vram_failure_is_null_with_its_reason(cuda_h200):
    def out_of_memory(device=None):
        raise RuntimeError("CUDA error: out of memory")

    cuda_h200.cuda.mem_get_info = out_of_memory
    result = run_probes(SMALL, nvml=fake_nvml([H200]))
    [entry] = result["gpus"]
    assert entry["vram"] is None
    assert entry["bandwidth"] and entry["matmul"] and entry["host_device"]
    assert result["errors"] == ["GPU 0 vram: RuntimeError: CUDA error: out of memory"]


def test_vram_that_does_not_keep_a_pattern(cuda_h200, monkeypatch):
    monkeypatch.setattr(cuda_h200, "equal", lambda a, b: False, raising=False)
    result = run_probes(SMALL, nvml=None)
    assert result["gpus"][0]["vram"]["pattern_ok"] is False


def test_a_gpu_cuda_cannot_describe_does_not_lose_the_others(monkeypatch):
    properties = [gpu_properties(uuid=RTX_4090["uuid"].removeprefix("GPU-")), gpu_properties()]
    fake = CudaOnCpu(torch, properties)
    monkeypatch.setattr(probes, "load_torch", lambda: (fake, None))

    def get_device_properties(index):
        if index == 0:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return properties[index]

    fake.cuda.get_device_properties = get_device_properties
    result = run_probes(SMALL, nvml=fake_nvml([RTX_4090, H200]))
    lost, h200 = result["gpus"]
    assert lost == {"index": 0, "uuid": None, "facts": None, "bandwidth": None, "matmul": None,
                    "host_device": None, "vram": None}
    assert h200["uuid"] == H200["uuid"] and h200["vram"]["pattern_ok"] is True
    assert result["errors"] == ["GPU 0 RuntimeError: CUDA error: unspecified launch failure"]
