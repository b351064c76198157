"""agent/host.py: the host facts read from /proc, /sys and the standard library, each left
out when it cannot be read or is out of the platform's bounds."""

import os
import shutil
from pathlib import Path

from agent import host

CPUINFO_X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9354 32-Core Processor
cpu MHz\t\t: 3250.000

processor\t: 1
model name\t: AMD EPYC 9354 32-Core Processor
"""
CPUINFO_ARM = """processor\t: 0
BogoMIPS\t: 108.00
CPU implementer\t: 0x41

Hardware\t: NVIDIA Grace
"""
MEMINFO = "MemTotal:       527993344 kB\nMemFree:        12345 kB\n"


def proc(tmp_path: Path, cpuinfo: str | None = CPUINFO_X86, meminfo: str | None = MEMINFO):
    root = tmp_path / "proc"
    root.mkdir()
    if cpuinfo is not None:
        (root / "cpuinfo").write_text(cpuinfo)
    if meminfo is not None:
        (root / "meminfo").write_text(meminfo)
    return root


def net(tmp_path: Path, links: dict[str, tuple[bool, str | None]]) -> Path:
    """/sys/class/net with interfaces name -> (physical, speed file content or None)."""
    root = tmp_path / "net"
    root.mkdir()
    for name, (physical, speed) in links.items():
        interface = root / name
        interface.mkdir()
        if physical:
            (interface / "device").mkdir()
        if speed is not None:
            (interface / "speed").write_text(speed + "\n")
    return root


def test_a_linux_server_reports_every_fact(tmp_path):
    links = net(tmp_path, {"lo": (False, "10"), "eno1": (True, "1000"),
                           "ens2f0": (True, "100000"), "docker0": (False, "10000")})
    facts = host.host_facts(proc=proc(tmp_path), net=links, disk_path=str(tmp_path))
    assert facts == {"cpu_model": "AMD EPYC 9354 32-Core Processor",
                     "cpu_cores": os.cpu_count(), "ram_mib": 527993344 // 1024,
                     "disk_free_gb": shutil.disk_usage(tmp_path).free // 10**9,
                     "net_link_mbps": 100_000}


def test_an_arm_host_names_its_cpu_from_hardware(tmp_path):
    assert host.cpu_model(proc(tmp_path, cpuinfo=CPUINFO_ARM)) == "NVIDIA Grace"


def test_what_cannot_be_read_is_left_out(tmp_path, monkeypatch):
    # No /proc files, no network interface that says its speed (a VM's virtio NIC reads -1,
    # a link that is down refuses the read), a path that does not exist.
    monkeypatch.setattr(host.platform, "processor", lambda: "x86_64")
    monkeypatch.setattr(host.os, "cpu_count", lambda: None)

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(host.os, "sysconf", no_sysconf)
    links = net(tmp_path, {"eth0": (True, "-1"), "eth1": (True, None)})
    facts = host.host_facts(proc=proc(tmp_path, cpuinfo=None, meminfo=None), net=links,
                            disk_path=str(tmp_path / "missing"))
    assert facts == {}


def test_ram_falls_back_to_the_page_count(tmp_path, monkeypatch):
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 2 * 1024 * 256}
    monkeypatch.setattr(host.os, "sysconf", pages.__getitem__)
    assert host.ram_mib(proc(tmp_path, meminfo=None)) == 2 * 1024


def test_a_value_the_platform_would_refuse_is_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(host.os, "cpu_count", lambda: 70_000)
    links = net(tmp_path, {"eth0": (True, "99999999999")})
    facts = host.host_facts(proc=proc(tmp_path, cpuinfo="model name\t: " + "x" * 300 + "\n"),
                            net=links, disk_path=str(tmp_path))
    assert "cpu_cores" not in facts and "net_link_mbps" not in facts
    assert len(facts["cpu_model"]) == host.MAX_CPU_MODEL


def test_the_local_machine_reports_host_facts_in_its_heartbeat_facts(monkeypatch):
    from agent import hardware

    monkeypatch.setattr(hardware.host, "host_facts", lambda: {"cpu_cores": 8})
    facts, _ = hardware.LocalMachine().facts()
    assert facts["host"] == {"cpu_cores": 8}
