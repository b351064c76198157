"""What the benchmarks read from /proc to say where the CPU went: a process's (or thread's)
CPU seconds, the whole machine's busy seconds, processes by command line, a process's
children."""

import os


def cpu_s(pid: int, thread: int | None = None) -> float:
    """CPU seconds a process (or one of its threads) has used, user + system, from
    /proc/<pid>/stat; 0 once gone."""
    try:
        with open(f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (not idle, not waiting on I/O) since boot."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return (sum(cpu[:8]) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK")


def pids_of(prefix: bytes, needle: bytes = b"") -> list[int]:
    """Processes whose command line starts with `prefix` and holds `needle`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ")
            except OSError:
                continue
            if cmd.startswith(prefix) and needle in cmd:
                found.append(int(entry))
    return found


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found
