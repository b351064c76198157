"""The machine the agent reports on: NVML on NVIDIA machines, the chip itself on Apple Silicon,
and the verification probes measured here with torch.

The agent asks a machine for four things only (`Machine`): its hostname, its facts, its probe
results and, while the platform measures it, its GPUs' power draw. `LocalMachine` is this computer; whoever starts the agent may hand it another
(fleetsim's simulated machines, through `agent.cli.main(argv, machine=...)`), so the agent
itself never knows about simulators."""

import platform
import re
import socket
import subprocess
import uuid
from typing import Protocol

from agent import host, probes
from agent.nvml import MIB, NoNvidia, read_nvidia, read_power_draw

# Apple GPU uuids are derived from the Mac's hardware UUID through this namespace, so the same
# Mac always reports the same uuid (duplicate detection works) without sending the raw
# hardware identifier anywhere.
APPLE_UUID_NAMESPACE = uuid.UUID("6f6c8f0e-2b0f-4d5c-9a57-52a6c1f0a5e1")


class FactsError(Exception):
    """Facts cannot be produced at all (e.g. a simulated machine with an unknown profile); the
    agent stops."""


class Machine(Protocol):
    def hostname(self) -> str:
        """The name to report when --hostname does not give one."""

    def facts(self) -> tuple[dict, str | None]:
        """The heartbeat's hardware part, and a line to print once (else None). Raises
        FactsError when there are no facts to be had."""

    def probes(self, params: dict, *, device: str | None = None, log=None) -> dict:
        """The probes result of docs/agent-protocol.md; raises probes.ProbeError for a job
        that cannot run as asked."""

    def power_draw(self) -> dict[int, int]:
        """Each GPU's power draw now, in W, by index; those it cannot read are left out."""


class LocalMachine:
    """This computer. pynvml is loaded on first use: enrolling needs none of it."""

    def __init__(self):
        self._nvml = None
        self._loaded = False

    def nvml(self):
        if not self._loaded:
            self._nvml, self._loaded = load_pynvml(), True
        return self._nvml

    def hostname(self) -> str:
        return hostname()

    def facts(self) -> tuple[dict, str | None]:
        facts, notice = hardware_facts(self.nvml())
        return {**facts, "host": host.host_facts()}, notice

    def probes(self, params: dict, *, device: str | None = None, log=None) -> dict:
        return probes.run_probes(params, nvml=self.nvml(), device=device, log=log)

    def power_draw(self) -> dict[int, int]:
        # NVML's reading; a Mac has no NVML and reports none.
        return read_power_draw(self.nvml())


def load_pynvml():
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def run_command(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=5).stdout


def host_os(system: str | None = None, release: str | None = None) -> str:
    # The release matters: WSL kernels say "microsoft" there, and WSL serves much slower.
    return f"{system or platform.system()} {release or platform.release()}"


def hostname() -> str:
    return socket.gethostname()[:256]


def hardware_facts(nvml, *, system=None, release=None, run=run_command) -> tuple[dict, str | None]:
    """This machine's facts, and the line to print once when it has no NVIDIA GPU (else None)."""
    system = system or platform.system()
    facts = {"os": host_os(system, release), "simulated": False}
    try:
        return {**facts, **read_nvidia(nvml)}, None
    except NoNvidia as exc:
        reason = str(exc)
    facts |= {"nvidia": False, "driver_version": None, "cuda_version": None, "gpus": []}
    if system == "Darwin":
        gpu = apple_gpu(run)
        if gpu is not None:
            facts["gpus"] = [gpu]
            return facts, f"No NVIDIA GPU found (NVML: {reason}); reporting the {gpu['name']}."
    return facts, (
        f"No NVIDIA GPU found on this machine (NVML: {reason}); reporting it without GPUs."
    )


def apple_gpu(run) -> dict | None:
    """The Apple Silicon chip as one GPU entry (its memory is the unified memory), or None on an
    Intel Mac or when sysctl does not answer."""
    try:
        brand = run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not brand.startswith("Apple"):
        return None
    try:
        memory_mib = int(run(["sysctl", "-n", "hw.memsize"]).strip()) // MIB
    except (OSError, subprocess.SubprocessError, ValueError):
        memory_mib = None
    try:
        registry = run(["ioreg", "-rd1", "-c", "IOPlatformExpertDevice"])
        found = re.search(r'"IOPlatformUUID"\s*=\s*"([^"]+)"', registry)
    except (OSError, subprocess.SubprocessError):
        found = None
    gpu_uuid = f"APPLE-{uuid.uuid5(APPLE_UUID_NAMESPACE, found[1])}" if found else None
    return {
        "index": 0,
        "name": brand,
        "uuid": gpu_uuid,
        "memory_total_mib": memory_mib,
        "compute_capability": None,
        "pcie_gen_current": None,
        "pcie_gen_max": None,
        "pcie_width_current": None,
        "pcie_width_max": None,
        "power_limit_w": None,
        "nvlink_links": None,
    }
