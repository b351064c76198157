"""Test doubles for the agent: a fake pynvml module and a recording HTTP server."""

import json
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

MIB = 1024 * 1024


# Same class names as pynvml, so the agent's `except nvml.NVMLError` is what is exercised.
class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


# An H200 as NVML reports it (FACTS.md: 143,771 MiB); the total is not a whole number of MiB,
# as on real cards, so the conversion must round down.
H200 = {
    "name": "NVIDIA H200",
    "uuid": "GPU-5b1c0d2e-1111-2222-3333-444455556666",
    "memory_total": 143_771 * MIB + 4096,
    "capability": (9, 0),
    "pcie_gen_current": 5,
    "pcie_gen_max": 5,
    "pcie_width_current": 16,
    "pcie_width_max": 16,
    "power_mw": 700_000,
    "power_usage_mw": 112_640,  # idle: the draw NVML reads now
    "nvlink": [1] * 18,  # each link's state (NVML_FEATURE_ENABLED): an SXM H200's 18, all up
    # What only the probes read (FACTS.md: H200 SXM, 4,800 GB/s spec).
    "serial": "1654922012345",
    "architecture": 9,  # NVML_DEVICE_ARCH_HOPPER
    "memory_bus_width": 6144,
    "max_memory_clock": 3201,
    "power_default_mw": 700_000,
    "virtualization_mode": 0,
    "ecc_mode": [1, 1],  # [current, pending]
    "ecc_errors": 0,
    "sm_clock": 1980,
    "memory_clock": 3201,
    "clocks_event_reasons": 0,
}

RTX_4090 = {
    "name": "NVIDIA GeForce RTX 4090",
    "uuid": "GPU-4090aaaa-0000-0000-0000-000000000000",
    "memory_total": 24_564 * MIB,
    "capability": (8, 9),
    "pcie_gen_current": 1,  # idle links downshift
    "pcie_gen_max": 4,
    "pcie_width_current": 16,
    "pcie_width_max": 16,
    "power_mw": 450_000,
    "serial": NVMLError_NotSupported("Not Supported"),  # GeForce cards have none
    "architecture": 8,  # NVML_DEVICE_ARCH_ADA
    "memory_bus_width": 384,
    "max_memory_clock": 10501,
    "power_default_mw": 450_000,
    "virtualization_mode": 0,
    "ecc_mode": NVMLError_NotSupported("Not Supported"),
    "ecc_errors": NVMLError_NotSupported("Not Supported"),
    "sm_clock": 2520,
    "memory_clock": 10501,
    "clocks_event_reasons": 0x4,  # sw_power_cap
}


CLOCK_FIELDS = {1: "sm_clock", 2: "memory_clock"}  # NVML_CLOCK_SM, NVML_CLOCK_MEM


def fake_nvml(gpus, *, driver="560.35.03", cuda=12060, init_error=None, count_error=None):
    """A module-like object with pynvml's function names. A GPU field (or driver/cuda) whose
    value is an exception instance raises it, as NVML does for an unsupported query; a field
    the GPU dict lacks is Not Supported; a callable field is called (a reading that changes,
    e.g. a PCIe link that speeds up under load). `nvlink` is a list of each link's state
    (1 up, 0 down, or an exception); an index past its end is an Invalid Argument, as NVML
    answers past a GPU's last link."""
    calls = []

    def answer(value):
        if callable(value):
            value = value()
        if isinstance(value, BaseException):
            raise value
        return value

    def device(field):
        def query(handle):
            calls.append(field)
            if field not in handle:
                raise NVMLError_NotSupported("Not Supported")
            return answer(handle[field])

        return query

    def clock(handle, clock_type):
        return device(CLOCK_FIELDS[clock_type])(handle)

    def max_clock(handle, clock_type):
        if clock_type != 2:  # only the memory clock's maximum is asked
            raise NVMLError_NotSupported("Not Supported")
        return device("max_memory_clock")(handle)

    def ecc_errors(handle, error_type, counter_type):
        # Uncorrected (1), aggregate over the card's life (1): what the probes report.
        assert (error_type, counter_type) == (1, 1), (error_type, counter_type)
        return device("ecc_errors")(handle)

    def nvlink_state(handle, link):
        states = device("nvlink")(handle)
        if link >= len(states):
            raise NVMLError_InvalidArgument("Invalid Argument")
        return answer(states[link])

    def init():
        calls.append("init")
        if init_error is not None:
            raise init_error

    def count():
        if count_error is not None:
            raise count_error
        return len(gpus)

    def handle(index):
        return answer(gpus[index])  # a GPU given as an exception is a lost handle

    memory = device("memory_total")
    return SimpleNamespace(
        calls=calls,
        NVMLError=NVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: answer(driver),
        nvmlSystemGetCudaDriverVersion_v2=lambda: answer(cuda),
        nvmlDeviceGetCount=count,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=device("name"),
        nvmlDeviceGetUUID=device("uuid"),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=memory(h), free=0, used=0),
        nvmlDeviceGetCudaComputeCapability=device("capability"),
        nvmlDeviceGetCurrPcieLinkGeneration=device("pcie_gen_current"),
        nvmlDeviceGetMaxPcieLinkGeneration=device("pcie_gen_max"),
        nvmlDeviceGetCurrPcieLinkWidth=device("pcie_width_current"),
        nvmlDeviceGetMaxPcieLinkWidth=device("pcie_width_max"),
        nvmlDeviceGetPowerManagementLimit=device("power_mw"),
        nvmlDeviceGetPowerUsage=device("power_usage_mw"),
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlDeviceGetSerial=device("serial"),
        nvmlDeviceGetArchitecture=device("architecture"),
        nvmlDeviceGetMemoryBusWidth=device("memory_bus_width"),
        nvmlDeviceGetMaxClockInfo=max_clock,
        nvmlDeviceGetClockInfo=clock,
        nvmlDeviceGetPowerManagementDefaultLimit=device("power_default_mw"),
        nvmlDeviceGetVirtualizationMode=device("virtualization_mode"),
        nvmlDeviceGetEccMode=device("ecc_mode"),
        nvmlDeviceGetTotalEccErrors=ecc_errors,
        nvmlDeviceGetCurrentClocksEventReasons=device("clocks_event_reasons"),
        nvmlDeviceGetCurrentClocksThrottleReasons=device("clocks_event_reasons"),
    )


class FakeEvent:
    """torch.cuda.Event on the CPU: records perf_counter, answers milliseconds."""

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1000


class CudaOnCpu:
    """Real torch, dressed as a CUDA build with these GPUs (torch.cuda.get_device_properties
    objects) whose tensors live on the CPU: the probes' GPU path (CUDA events, NVML facts,
    the link under load, the VRAM check) runs for real without a GPU."""

    def __init__(self, torch, properties, *, free_bytes=8 * MIB, total_bytes=16 * MIB):
        self._torch = torch
        self.pinned = []  # pin_memory of each torch.empty
        self.synchronized = 0
        self.version = SimpleNamespace(cuda="12.8")
        self.cuda = SimpleNamespace(
            is_available=lambda: True,
            device_count=lambda: len(properties),
            get_device_properties=lambda index: properties[index],
            Event=FakeEvent,
            synchronize=self._synchronize,
            mem_get_info=lambda device=None: (free_bytes, total_bytes),
            empty_cache=lambda: None,
            device=lambda index: nullcontext(),
        )

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def _synchronize(self, device=None):
        self.synchronized += 1

    def device(self, kind, index=None):
        assert kind == "cuda"
        return self._torch.device("cpu")

    def empty(self, *size, pin_memory=False, **kwargs):
        self.pinned.append(pin_memory)
        return self._torch.empty(*size, **kwargs)


def gpu_properties(name="NVIDIA H200", uuid="5b1c0d2e-1111-2222-3333-444455556666",
                   major=9, minor=0, sm_count=132, l2_bytes=50 * MIB):
    """What torch.cuda.get_device_properties says (its uuid has no "GPU-" prefix)."""
    return SimpleNamespace(name=name, uuid=uuid, major=major, minor=minor,
                           multi_processor_count=sm_count, L2_cache_size=l2_bytes,
                           total_memory=143_771 * MIB)


@dataclass
class Request:
    method: str
    path: str
    headers: Message
    body: object
    at: float  # time.monotonic() when it arrived


class FakeServer:
    """A real HTTP server on 127.0.0.1 in a thread that records every request and answers
    with `respond(request) -> (status, json_body)`. It can be stopped and started again on
    the same port, to play a platform that restarts."""

    def __init__(self, respond):
        self.respond = respond
        self.requests: list[Request] = []
        self.port = 0
        self._server = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        server = ThreadingHTTPServer(("127.0.0.1", self.port), _Handler)
        server.fake = self
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
        self._server = server

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Handler(BaseHTTPRequestHandler):
    def _handle(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fake = self.server.fake
        request = Request(self.command, self.path, self.headers,
                          json.loads(raw) if raw else None, time.monotonic())
        fake.requests.append(request)
        status, reply = fake.respond(request)
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _handle

    def log_message(self, *args):
        pass


def scripted(*replies):
    """A `respond` that gives these (status, body) replies in turn, then repeats the last."""
    queue = list(replies)

    def respond(request):
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return respond
