"""Test doubles for the agent: a fake pynvml module and a recording HTTP server."""

import json
import threading
import time
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
}


def fake_nvml(gpus, *, driver="560.35.03", cuda=12060, init_error=None, count_error=None):
    """A module-like object with pynvml's function names. A GPU field (or driver/cuda) whose
    value is an exception instance raises it, as NVML does for an unsupported query."""
    calls = []

    def answer(value):
        if isinstance(value, BaseException):
            raise value
        return value

    def device(field):
        def query(handle):
            calls.append(field)
            return answer(handle[field])

        return query

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
    )


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
