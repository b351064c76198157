"""The heartbeat's host part: CPU, RAM, free disk and network link of the machine the GPUs sit
in, read from the standard library and Linux's /proc and /sys (docs/agent-protocol.md).

Each fact is optional: one that cannot be read here is left out, never guessed, so a renter
sees "unknown" rather than a wrong figure. Nothing here may stop a heartbeat.
"""

import os
import platform
import shutil
from pathlib import Path

# The bounds the platform accepts (marketplace.serializers.HostReportSerializer): a value
# outside them is left out here rather than get the whole heartbeat refused.
MAX_CPU_MODEL = 256
MAX_CPU_CORES = 65_535
MAX_RAM_MIB = 2_000_000_000  # ~1.9 PiB
MAX_DISK_FREE_GB = 2_000_000_000
MAX_LINK_MBPS = 10_000_000  # 10 Tb/s

# Names /proc/cpuinfo gives the CPU's model under: x86, then the ARM and POWER kernels.
_CPUINFO_MODEL_KEYS = ("model name", "Hardware", "Model", "cpu")
# platform.processor() answers with an architecture, not a model, on most systems.
_NOT_A_MODEL = {"", "x86_64", "amd64", "i386", "i686", "arm", "arm64", "aarch64"}
# Interfaces that are not a network link of the machine: loopback and software bridges,
# tunnels and containers' pairs have no /sys/class/net/<name>/device.
_NET = Path("/sys/class/net")


def host_facts(*, proc: Path = Path("/proc"), net: Path = _NET, disk_path: str = "/") -> dict:
    """{"cpu_model", "cpu_cores", "ram_mib", "disk_free_gb", "net_link_mbps"}, each present only
    when it could be read and is within the platform's bounds."""
    facts = {
        "cpu_model": cpu_model(proc),
        "cpu_cores": _bounded(os.cpu_count(), MAX_CPU_CORES),
        "ram_mib": _bounded(ram_mib(proc), MAX_RAM_MIB),
        "disk_free_gb": _bounded(disk_free_gb(disk_path), MAX_DISK_FREE_GB),
        "net_link_mbps": _bounded(net_link_mbps(net), MAX_LINK_MBPS),
    }
    return {name: value for name, value in facts.items() if value is not None}


def _bounded(value: int | None, limit: int) -> int | None:
    return value if isinstance(value, int) and 0 < value <= limit else None


def cpu_model(proc: Path = Path("/proc")) -> str | None:
    fields = {}
    try:
        for line in (proc / "cpuinfo").read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    for key in _CPUINFO_MODEL_KEYS:
        if fields.get(key):
            return _clean_model(fields[key])
    processor = platform.processor().strip()
    return _clean_model(processor) if processor.lower() not in _NOT_A_MODEL else None


def _clean_model(text: str) -> str | None:
    text = " ".join(text.replace("\x00", "").split())[:MAX_CPU_MODEL]
    return text or None


def ram_mib(proc: Path = Path("/proc")) -> int | None:
    """Total memory: MemTotal from /proc/meminfo, else the page count times the page size."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    return int(parts[1]) // 1024  # kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (AttributeError, ValueError, OSError):
        return None


def disk_free_gb(path: str = "/") -> int | None:
    """Free space of the filesystem holding `path`, in GB (10^9 bytes, as disks are sold)."""
    try:
        return shutil.disk_usage(path).free // 10**9
    except OSError:
        return None


def net_link_mbps(net: Path = _NET) -> int | None:
    """The fastest link of a physical network interface that is up, in Mb/s, as the kernel
    reports it; None where no interface says (a VM's virtio NIC, macOS, a link that is down:
    the kernel reads -1 or refuses the read)."""
    best = None
    try:
        interfaces = list(net.iterdir())
    except OSError:
        return None
    for interface in interfaces:
        if not (interface / "device").exists():
            continue
        try:
            speed = int((interface / "speed").read_text().strip())
        except (OSError, ValueError):
            continue
        if speed > 0 and (best is None or speed > best):
            best = speed
    return best
