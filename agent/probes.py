"""Verification probes (docs/agent-protocol.md, section 3): device facts, memory bandwidth,
dense BF16 matmul, host<->device copy and a VRAM pattern check, measured with torch.

The same measuring code runs on CUDA and on the CPU (where the tests run it); only the timer
differs: CUDA events on a GPU, perf_counter on the CPU. torch is imported here, lazily: the
agent runs without it, and the probes then answer device "none" saying why. Each part that
fails is null with its reason in `errors`; one failing part never loses the others.
"""

import math
import platform
import statistics
import threading
import time
import warnings
from dataclasses import dataclass

from agent import nvml as nv

MIB = 1024 * 1024
GIB = 1024 * MIB
MAX_ERROR = 256  # the protocol's string limit

# The one place for the probes' parameters: the platform sends these with every probe job,
# the agent falls back on them, and fleetsim's simulated machines answer for them.
DEFAULT_PARAMS = {"warmup_s": 1.0, "iterations": 20, "matmul_n": 8192, "copy_bytes": 256 * MIB}
MIN_GPU_ARRAY_BYTES = GIB  # FACTS.md: 1 GiB per array is >= 4 x L2 on every card we list
VRAM_FRACTION = 0.9
TRIAD_SCALAR = 3.0
CLOCK_SAMPLE_S = 0.05

# The CPU only checks the probes themselves (tests, `probe --device cpu`), so it gets sizes
# that finish in seconds rather than the GPU's.
CPU_DEFAULTS = {"array_bytes": 64 * MIB, "matmul_n": 1024}
QUICK = {"warmup_s": 0.2, "iterations": 5, "copy_bytes": 64 * MIB}
QUICK_GPU = {"matmul_n": 4096}  # the array size rule stays: under it a GPU measures its L2
QUICK_CPU = {"array_bytes": 16 * MIB, "matmul_n": 256}

PARTS = ("bandwidth", "matmul", "host_device", "vram")
FACT_KEYS = (
    "name", "serial", "architecture", "compute_capability", "compute_capability_cuda",
    "sm_count", "memory_total_mib", "memory_bus_width_bits", "max_memory_clock_mhz",
    "theoretical_bandwidth_gbs", "pcie_gen_current", "pcie_gen_max", "pcie_width_current",
    "pcie_width_max", "power_limit_w", "power_default_limit_w", "virtualization_mode",
    "ecc_mode", "ecc_errors", "driver_version", "cuda_version", "power_draw_w",
)


class ProbeError(Exception):
    """The probes cannot run as asked (bad params, an unknown simulated profile): the job
    fails."""


# --- params ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    warmup_s: float
    iterations: int
    matmul_n: int
    copy_bytes: int
    array_bytes: int | None  # None: max(4 x L2, 1 GiB) of each GPU


# name: (type, lowest, highest). Keys the agent does not know are ignored, so a newer
# platform can send more than an older agent reads.
PARAM_RANGES = {
    "warmup_s": (float, 0.0, 60.0),
    "iterations": (int, 1, 1000),
    "matmul_n": (int, 1, 65536),
    "copy_bytes": (int, 1, 64 * GIB),
    "array_bytes": (int, 4, 64 * GIB),
}


def resolve_params(params: dict | None, *, gpu: bool) -> Settings:
    """Defaults, then --quick sizes (`"quick": true`), then the platform's values. Raises
    ProbeError for a value of the wrong type or out of range."""
    params = dict(params or {})
    quick = params.pop("quick", False) is True
    values = {**DEFAULT_PARAMS, "array_bytes": None}
    if not gpu:
        values |= CPU_DEFAULTS
    if quick:
        values |= QUICK | (QUICK_GPU if gpu else QUICK_CPU)
    for name, (kind, low, high) in PARAM_RANGES.items():
        if name not in params or (name == "array_bytes" and params[name] is None):
            continue
        value = params[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                kind is int and value != int(value)) or not low <= value <= high:
            what = "an integer" if kind is int else "a number"
            raise ProbeError(f"params.{name} must be {what} from {low} to {high}, "
                             f"not {value!r}.")
        values[name] = kind(value)
    return Settings(**values)


def default_array_bytes(properties) -> int:
    """Per-array bytes on a GPU: at least 4 x its L2 (STREAM's rule) and at least 1 GiB."""
    l2 = getattr(properties, "L2_cache_size", 0) or 0
    return max(4 * l2, MIN_GPU_ARRAY_BYTES)


# --- timers ---------------------------------------------------------------------------------

class CpuTimer:
    """perf_counter around a call: CPU ops are done when they return."""

    def now(self) -> float:
        return time.perf_counter()

    def measure(self, fn, during=None) -> float:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if during is not None:
            during()
        return elapsed


class CudaTimer:
    """CUDA events around a call, so what is timed is the GPU's work, not the launch."""

    def __init__(self, torch, device):
        self.torch = torch
        self.device = device

    def now(self) -> float:
        self.torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def measure(self, fn, during=None) -> float:
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if during is not None:
            during()  # the work is still in flight here: e.g. read the PCIe link under load
        end.synchronize()
        return start.elapsed_time(end) / 1000  # milliseconds


def warm_up(fn, timer, seconds: float) -> float:
    """Run fn until at least `seconds` have passed (at least once); returns the time spent."""
    start = timer.now()
    while True:
        fn()
        elapsed = timer.now() - start
        if elapsed >= seconds:
            return elapsed


def timed(fn, timer, iterations: int, during=None) -> list[float]:
    return [timer.measure(fn, during) for _ in range(iterations)]


def _rates(work: float, seconds: list[float], unit: float) -> list[float]:
    if not seconds or min(seconds) <= 0:
        raise ProbeError(f"the timer measured no time ({seconds[:3]})")
    return [work / s / unit for s in seconds]


def _sig(value: float) -> float:
    """Four significant digits: 4210.5 GB/s and 0.002097 TFLOPS both keep what they mean."""
    return float(f"{value:.4g}")


# --- memory bandwidth: STREAM triad ----------------------------------------------------------

def triad_figures(array_bytes: int, seconds: list[float], warmup_s: float) -> dict:
    moved = 3 * array_bytes  # read b, read c, write a (BabelStream's triad weight)
    rates = _rates(moved, seconds, 1e9)
    return {"kernel": "triad", "array_bytes": array_bytes, "bytes_per_iteration": moved,
            "warmup_s": round(warmup_s, 3), "iterations": len(seconds),
            "best_gbs": _sig(max(rates)), "median_gbs": _sig(statistics.median(rates))}


def measure_bandwidth(torch, device, timer, *, array_bytes: int, warmup_s: float,
                      iterations: int, sampler=None) -> dict:
    """a = b + s * c on the device's own cores (never a memcpy: copy engines read HBM at about
    half its speed), float32 arrays of array_bytes each."""
    n = array_bytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    # Random, not constant, data: compressible memory must not flatter the figure.
    b = torch.rand(n, dtype=torch.float32, device=device)
    c = torch.rand(n, dtype=torch.float32, device=device)

    def triad():
        torch.add(b, c, alpha=TRIAD_SCALAR, out=a)

    sampler = sampler or ClockSampler(None, None)
    with sampler:
        warm = warm_up(triad, timer, warmup_s)
        seconds = timed(triad, timer, iterations)
    # Spot checks spread over the arrays (integer maths: float32 cannot count to 2^28 by ones).
    picks = torch.tensor(sorted({i * (n - 1) // 63 for i in range(64)}), device=device)
    if not torch.allclose(a[picks], b[picks] + TRIAD_SCALAR * c[picks]):
        raise ProbeError("the triad kernel computed wrong values")
    return {**triad_figures(n * 4, seconds, warm), **sampler.figures()}


class ClockSampler:
    """Samples SM and memory clocks and clock event (throttle) reasons through NVML in a
    background thread while a measurement runs; with no NVML handle (the CPU) it samples
    nothing and reports empty lists."""

    def __init__(self, nvml, handle, interval_s: float = CLOCK_SAMPLE_S):
        self.nvml, self.handle, self.interval_s = nvml, handle, interval_s
        self.sm, self.memory, self.reasons = set(), set(), set()
        self._stop = threading.Event()
        self._thread = None

    def sample(self):
        sm, memory, reasons = nv.clock_sample(self.nvml, self.handle)
        if sm is not None:
            self.sm.add(sm)
        if memory is not None:
            self.memory.add(memory)
        self.reasons.update(reasons)

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self):
        if self.handle is not None:
            self.sample()
            self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()  # a short run still gets a sample taken under load

    def figures(self) -> dict:
        return {"sm_clock_mhz": sorted(self.sm), "memory_clock_mhz": sorted(self.memory),
                "throttle_reasons": sorted(self.reasons)}


# --- dense BF16 matmul ------------------------------------------------------------------------

def matmul_figures(n: int, seconds: list[float]) -> dict:
    flops = 2 * n**3  # n^2 outputs, n multiply-adds each
    rates = _rates(flops, seconds, 1e12)
    return {"dtype": "bfloat16", "n": n, "iterations": len(seconds),
            "best_tflops": _sig(max(rates)), "median_tflops": _sig(statistics.median(rates))}


def measure_matmul(torch, device, timer, *, n: int, warmup_s: float, iterations: int) -> dict:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)

    def matmul():
        torch.mm(a, b, out=out)

    warm_up(matmul, timer, warmup_s)
    seconds = timed(matmul, timer, iterations)
    rows = min(n, 4)
    expected = a[:rows].float() @ b[:, :rows].float()
    if not torch.allclose(out[:rows, :rows].float(), expected, rtol=0.02, atol=0.02 * math.sqrt(n)):
        raise ProbeError("the matmul computed wrong values")
    return matmul_figures(n, seconds)


# --- host <-> device copy -----------------------------------------------------------------------

class LinkProbe:
    """Reads the PCIe link while a copy is in flight and keeps the highest values seen."""

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        self.gen = self.width = None

    def __call__(self):
        gen, width = nv.pcie_link(self.nvml, self.handle)
        if gen is not None:
            self.gen = max(gen, self.gen or 0)
        if width is not None:
            self.width = max(width, self.width or 0)


def copy_figures(nbytes: int, h2d: list[float], d2h: list[float]) -> dict:
    # Best of each direction: what the link can do, which is what is being verified.
    return {"pinned": True, "bytes": nbytes, "h2d_gbs": _sig(max(_rates(nbytes, h2d, 1e9))),
            "d2h_gbs": _sig(max(_rates(nbytes, d2h, 1e9)))}


def measure_host_device(torch, device, timer, *, nbytes: int, iterations: int,
                        link=None) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(0x5A)  # touch every page before timing
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def h2d():
        on_device.copy_(host, non_blocking=True)

    def d2h():
        host.copy_(on_device, non_blocking=True)

    for fn in (h2d, d2h, h2d, d2h):
        timer.measure(fn)
    up = timed(h2d, timer, iterations, during=link)
    down = timed(d2h, timer, iterations, during=link)
    return copy_figures(nbytes, up, down)


# --- VRAM pattern check -----------------------------------------------------------------------

def check_vram(torch, device, *, fraction: float = VRAM_FRACTION) -> dict:
    """Fill ~90% of free memory with each word's own index, then with its complement (every
    bit both ways), and read it all back after the whole fill, so memory that aliases or
    does not exist shows as a mismatch."""
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    words = int(free * fraction) // 8
    if words < 1:
        raise ProbeError(f"no free memory to test ({free} bytes free)")
    chunk = max(1, min(256 * MIB, int(free * (1 - fraction) / 4)) // 8)
    memory = torch.empty(words, dtype=torch.int64, device=device)
    ok = True
    try:
        for invert in (False, True):
            def pattern(start, stop, invert=invert):
                values = torch.arange(start, stop, dtype=torch.int64, device=device)
                return torch.bitwise_not(values, out=values) if invert else values

            for start in range(0, words, chunk):
                stop = min(start + chunk, words)
                memory[start:stop].copy_(pattern(start, stop))
            for start in range(0, words, chunk):
                stop = min(start + chunk, words)
                ok = ok and bool(torch.equal(memory[start:stop], pattern(start, stop)))
    finally:
        del memory
    return {"free_bytes": free, "tested_bytes": words * 8, "pattern_ok": ok}


# --- the whole run ----------------------------------------------------------------------------

def is_wsl(release: str) -> bool:
    # WSL kernels say so in their release: "5.15.153.1-microsoft-standard-WSL2".
    return "microsoft" in release.lower()


def load_torch():
    """(torch, None), or (None, why) when it cannot be imported."""
    try:
        with warnings.catch_warnings():
            # torch without numpy warns at import; the probes use no numpy.
            warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
            import torch
    except Exception as exc:  # ImportError, or a broken install's OSError
        return None, _describe(exc)
    return torch, None


def run_probes(params: dict | None = None, *, nvml=None, device: str | None = None,
               log=None) -> dict:
    """The probes result of docs/agent-protocol.md. `device`: None or "auto" (CUDA when torch
    sees a GPU, else "none"), "cuda", or "cpu" (measure the CPU: a check of the probes
    themselves). `nvml`: the pynvml module for the GPU facts, clocks and link (None: no NVML
    reads). Raises ProbeError only for bad params; anything that breaks while measuring is
    reported in `errors`."""
    log = log or (lambda message: None)
    if device not in (None, "auto", "cuda", "cpu"):
        raise ProbeError(f"unknown device {device!r}; use auto, cuda or cpu.")
    resolve_params(params, gpu=device != "cpu")  # refuse bad params before anything runs
    release = platform.release()
    result = {"device": "none", "kernel_release": release, "wsl": is_wsl(release), "gpus": [],
              "errors": []}

    torch, why = load_torch()
    if torch is None:
        return {**result, "message": f"no GPU: torch is not installed ({why}); "
                                     "install torch to run the probes"}
    if device != "cpu":
        reason = _no_cuda_reason(torch)
        if reason is not None:
            return {**result, "message": f"no GPU: {reason}"}
    result["device"] = "cpu" if device == "cpu" else "cuda"
    settings = resolve_params(params, gpu=result["device"] == "cuda")
    errors = result["errors"]

    if result["device"] == "cpu":
        result["gpus"].append(_probe_cpu(torch, settings, errors, log))
        return result
    if nvml is not None:
        try:
            nv.open_nvml(nvml)
        except nv.NoNvidia as exc:
            errors.append(_error("NVML:", f"{exc}; its facts, clocks and link are null"))
            nvml = None
    try:
        for index in range(torch.cuda.device_count()):
            try:
                entry = _probe_gpu(torch, index, settings, nvml, errors, log)
            except Exception as exc:  # CUDA cannot even describe it: the others still run
                errors.append(_error(f"GPU {index}", _describe(exc)))
                entry = {"index": index, "uuid": None, "facts": None, **dict.fromkeys(PARTS)}
            result["gpus"].append(entry)
    finally:
        if nvml is not None:
            nv.close_nvml(nvml)
    return result


def _no_cuda_reason(torch) -> str | None:
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
    except Exception as exc:
        return f"torch cannot use CUDA ({_describe(exc)})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
    return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is false)"


def _probe_gpu(torch, cuda_index: int, settings: Settings, nvml, errors: list, log) -> dict:
    device = torch.device("cuda", cuda_index)
    properties = torch.cuda.get_device_properties(cuda_index)
    cuda_uuid = _cuda_uuid(properties)
    index, handle = cuda_index, None
    facts = dict.fromkeys(FACT_KEYS)
    facts["name"] = properties.name
    if nvml is not None:
        nvml_index, handle = nv.find_handle(nvml, uuid=cuda_uuid, index=cuda_index)
        if handle is None:
            errors.append(_error(f"GPU {cuda_index}",
                                 f"NVML does not know CUDA's {cuda_uuid}; its NVML facts are null"))
        else:
            index = nvml_index
            nvml_facts = nv.read_probe_facts(nvml, handle)
            cuda_uuid = nvml_facts.pop("uuid") or cuda_uuid
            facts |= {key: value for key, value in nvml_facts.items() if key in facts}
    facts["compute_capability_cuda"] = f"{properties.major}.{properties.minor}"
    facts["sm_count"] = properties.multi_processor_count
    entry = {"index": index, "uuid": cuda_uuid, "facts": facts}
    timer = CudaTimer(torch, device)
    label = f"GPU {index}"
    array_bytes = settings.array_bytes or default_array_bytes(properties)
    link = LinkProbe(nvml, handle)
    with torch.cuda.device(cuda_index):
        _part(entry, "bandwidth", label, errors, log, torch, lambda: measure_bandwidth(
            torch, device, timer, array_bytes=array_bytes, warmup_s=settings.warmup_s,
            iterations=settings.iterations, sampler=ClockSampler(nvml, handle)))
        _part(entry, "matmul", label, errors, log, torch, lambda: measure_matmul(
            torch, device, timer, n=settings.matmul_n, warmup_s=settings.warmup_s,
            iterations=settings.iterations))
        _part(entry, "host_device", label, errors, log, torch, lambda: measure_host_device(
            torch, device, timer, nbytes=settings.copy_bytes, iterations=settings.iterations,
            link=link))
        _part(entry, "vram", label, errors, log, torch, lambda: check_vram(torch, device))
    # The link as it ran under the copy; idle links downshift, so an idle reading is kept
    # only when the copy could not run.
    if link.gen is not None:
        facts["pcie_gen_current"] = link.gen
    if link.width is not None:
        facts["pcie_width_current"] = link.width
    return entry


def _probe_cpu(torch, settings: Settings, errors: list, log) -> dict:
    device = torch.device("cpu")
    timer = CpuTimer()
    facts = dict.fromkeys(FACT_KEYS)
    facts["name"] = _cpu_name()
    entry = {"index": 0, "uuid": None, "facts": facts}
    label = "CPU"
    _part(entry, "bandwidth", label, errors, log, None, lambda: measure_bandwidth(
        torch, device, timer, array_bytes=settings.array_bytes, warmup_s=settings.warmup_s,
        iterations=settings.iterations))
    _part(entry, "matmul", label, errors, log, None, lambda: measure_matmul(
        torch, device, timer, n=settings.matmul_n, warmup_s=settings.warmup_s,
        iterations=settings.iterations))
    entry["host_device"] = None
    errors.append(_error(label, "host_device: no host<->device copy on the CPU"))
    entry["vram"] = None
    errors.append(_error(label, "vram: no device memory to check on the CPU"))
    return entry


def _part(entry: dict, name: str, label: str, errors: list, log, torch, measure) -> None:
    """entry[name] = measure(), or None with the reason in errors: one part that breaks
    (out of memory, a CUDA error) never loses the others."""
    log(f"{label}: {name}...")
    try:
        entry[name] = measure()
    except Exception as exc:
        entry[name] = None
        errors.append(_error(label, f"{name}: {_describe(exc)}"))
    finally:
        # The part's tensors died with its frame (and its traceback, at the end of except):
        # hand their memory back so the next part, the VRAM check above all, can have it.
        if torch is not None:
            try:
                torch.cuda.empty_cache()
            except Exception:
                pass  # a broken context; the next part reports it


def _cuda_uuid(properties) -> str | None:
    # torch prints the bare UUID; NVML and the heartbeat say "GPU-<uuid>".
    value = getattr(properties, "uuid", None)
    if value is None:
        return None
    text = str(value)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _describe(exc: Exception) -> str:
    detail = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _error(label: str, text: str) -> str:
    return f"{label} {text}"[:MAX_ERROR]
