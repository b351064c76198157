"""Hardware facts from NVML, behind one narrow function.

`read_nvidia` takes the pynvml module as an argument so tests pass a fake with the same names.
"""

MIB = 1024 * 1024


class NoNvidia(Exception):
    """This machine has no usable NVIDIA GPU; the message says why (NVML's own words)."""


def read_nvidia(nvml) -> dict:
    """Return {"nvidia": True, "driver_version", "cuda_version", "gpus": [...]} as the protocol
    sends them, or raise NoNvidia. A single call that fails gives null for its field: older
    drivers and some cards (GeForce power limits, vGPU) refuse individual queries."""
    if nvml is None:
        raise NoNvidia("pynvml is not installed")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NoNvidia(str(exc)) from None
    try:
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            raise NoNvidia(str(exc)) from None
        if not count:
            raise NoNvidia("no devices")
        cuda = _call(nvml, "nvmlSystemGetCudaDriverVersion_v2")  # e.g. 12060 for CUDA 12.6
        return {
            "nvidia": True,
            "driver_version": _text(_call(nvml, "nvmlSystemGetDriverVersion")),
            "cuda_version": None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
            "gpus": [_read_gpu(nvml, index) for index in range(count)],
        }
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def read_power_draw(nvml) -> dict[int, int]:
    """Each GPU's power draw now, in whole watts, by NVML index (nvmlDeviceGetPowerUsage, which
    answers in milliwatts); a GPU that cannot say is left out, and so is every GPU when NVML
    cannot be had."""
    if nvml is None:
        return {}
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return {}
    try:
        draws = {}
        for index in range(_call(nvml, "nvmlDeviceGetCount") or 0):
            handle = _call(nvml, "nvmlDeviceGetHandleByIndex", index)
            milliwatts = None if handle is None else _call(nvml, "nvmlDeviceGetPowerUsage",
                                                           handle)
            if milliwatts is not None:
                draws[index] = round(milliwatts / 1000)
        return draws
    finally:
        close_nvml(nvml)


def _read_gpu(nvml, index: int) -> dict:
    handle = _call(nvml, "nvmlDeviceGetHandleByIndex", index)
    return {"index": index, **_gpu_fields(nvml, handle)}


def _gpu_fields(nvml, handle) -> dict:
    def ask(name):
        # A GPU whose handle cannot be had (e.g. "GPU is lost") is still reported, all nulls,
        # so the platform sees the card in trouble rather than a card that vanished.
        return None if handle is None else _call(nvml, name, handle)

    memory = ask("nvmlDeviceGetMemoryInfo")
    capability = ask("nvmlDeviceGetCudaComputeCapability")
    power_mw = ask("nvmlDeviceGetPowerManagementLimit")
    return {
        "name": _text(ask("nvmlDeviceGetName")),
        "uuid": _text(ask("nvmlDeviceGetUUID")),
        "memory_total_mib": None if memory is None else memory.total // MIB,
        "compute_capability": None if capability is None else f"{capability[0]}.{capability[1]}",
        "pcie_gen_current": ask("nvmlDeviceGetCurrPcieLinkGeneration"),
        "pcie_gen_max": ask("nvmlDeviceGetMaxPcieLinkGeneration"),
        "pcie_width_current": ask("nvmlDeviceGetCurrPcieLinkWidth"),
        "pcie_width_max": ask("nvmlDeviceGetMaxPcieLinkWidth"),
        "power_limit_w": None if power_mw is None else round(power_mw / 1000),
        "nvlink_links": _nvlink_links(nvml, handle),
    }


def _nvlink_links(nvml, handle) -> int | None:
    """How many of the GPU's NVLink links are up. NVML refuses each link of a card without
    NVLink (Not Supported) and each index past a card's last link, so a refused link is not up
    and a card without NVLink gives 0; None where it cannot be asked (a lost handle, a pynvml
    too old to have the function)."""
    if handle is None or getattr(nvml, "nvmlDeviceGetNvLinkState", None) is None:
        return None
    enabled = _const(nvml, "NVML_FEATURE_ENABLED", FEATURE_ENABLED)
    return sum(1 for link in range(_const(nvml, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS))
               if _call(nvml, "nvmlDeviceGetNvLinkState", handle, link) == enabled)


def _call(nvml, name: str, *args):
    """One NVML query; None when it fails or this pynvml is too old to have it."""
    function = getattr(nvml, name, None)
    if function is None:
        return None
    try:
        return function(*args)
    except nvml.NVMLError:
        return None


def _text(value):
    # Older pynvml releases return bytes for strings.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# --- what the verification probes read (docs/agent-protocol.md, section 3) ------------------

# nvmlDeviceGetArchitecture's numbers (nvml.h NVML_DEVICE_ARCH_*), stable across releases.
ARCHITECTURES = {2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing",
                 7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell", 13: "rubin"}

# nvmlClocksEventReason* bits (formerly nvmlClocksThrottleReason*). GPU idle is left out on
# purpose: samples taken between kernels would report it on every healthy card.
CLOCK_EVENT_REASONS = {0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                       0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                       0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
                       0x100: "display_clock_setting"}
GPU_IDLE = 0x1

# pynvml's constants, with their nvml.h values for fakes and older releases that lack a name.
CLOCK_SM, CLOCK_MEM = 1, 2
MEMORY_ERROR_UNCORRECTED, AGGREGATE_ECC = 1, 1
FEATURE_ENABLED = 1
NVLINK_MAX_LINKS = 18  # Hopper's links; newer pynvml releases name more (NVML_NVLINK_MAX_LINKS)


def _const(nvml, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    return value if isinstance(value, int) else default


def open_nvml(nvml) -> None:
    """nvmlInit for a longer piece of work (the probes); raises NoNvidia. NVML counts inits,
    so this nests with read_nvidia; pair it with close_nvml."""
    if nvml is None:
        raise NoNvidia("pynvml is not installed")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NoNvidia(str(exc)) from None


def close_nvml(nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass


def find_handle(nvml, *, uuid: str | None, index: int):
    """(NVML index, handle) of a GPU that CUDA knows by uuid and index. The uuid decides when
    it is known: CUDA_VISIBLE_DEVICES and CUDA's fastest-first order renumber GPUs, so CUDA's
    index need not be NVML's. (None, None) when NVML cannot find it."""
    count = _call(nvml, "nvmlDeviceGetCount") or 0
    if uuid:
        for nvml_index in range(count):
            handle = _call(nvml, "nvmlDeviceGetHandleByIndex", nvml_index)
            if handle is not None and _text(_call(nvml, "nvmlDeviceGetUUID", handle)) == uuid:
                return nvml_index, handle
        return None, None
    handle = _call(nvml, "nvmlDeviceGetHandleByIndex", index) if index < count else None
    return (index, handle) if handle is not None else (None, None)


def read_probe_facts(nvml, handle) -> dict:
    """The probe result's NVML facts for one GPU; every query that fails is None, and a None
    handle gives all None. NVML must be open (open_nvml)."""

    def ask(name, *args):
        return None if handle is None else _call(nvml, name, handle, *args)

    base = _gpu_fields(nvml, handle)
    architecture = ask("nvmlDeviceGetArchitecture")
    bus_width = ask("nvmlDeviceGetMemoryBusWidth")
    max_memory_clock = ask("nvmlDeviceGetMaxClockInfo", _const(nvml, "NVML_CLOCK_MEM", CLOCK_MEM))
    default_limit_mw = ask("nvmlDeviceGetPowerManagementDefaultLimit")
    ecc = ask("nvmlDeviceGetEccMode")  # [current, pending]
    ecc_errors = ask(
        "nvmlDeviceGetTotalEccErrors",
        # Uncorrected errors over the card's life: corrected ones are routine, these are not.
        _const(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", MEMORY_ERROR_UNCORRECTED),
        _const(nvml, "NVML_AGGREGATE_ECC", AGGREGATE_ECC),
    )
    cuda = _call(nvml, "nvmlSystemGetCudaDriverVersion_v2")
    power_mw = ask("nvmlDeviceGetPowerUsage")
    return {
        "name": base["name"],
        "uuid": base["uuid"],
        "serial": _text(ask("nvmlDeviceGetSerial")),
        "architecture": (None if architecture is None
                         else ARCHITECTURES.get(architecture, f"unknown ({architecture})")),
        "compute_capability": base["compute_capability"],
        "memory_total_mib": base["memory_total_mib"],
        "memory_bus_width_bits": bus_width,
        "max_memory_clock_mhz": max_memory_clock,
        "theoretical_bandwidth_gbs": theoretical_bandwidth_gbs(max_memory_clock, bus_width),
        "pcie_gen_current": base["pcie_gen_current"],
        "pcie_gen_max": base["pcie_gen_max"],
        "pcie_width_current": base["pcie_width_current"],
        "pcie_width_max": base["pcie_width_max"],
        "power_limit_w": base["power_limit_w"],
        # The draw now: whether this machine can report it in heartbeats (report_power).
        "power_draw_w": None if power_mw is None else round(power_mw / 1000),
        "power_default_limit_w": None if default_limit_mw is None else round(default_limit_mw / 1000),
        "virtualization_mode": ask("nvmlDeviceGetVirtualizationMode"),
        "ecc_mode": None if ecc is None else ecc[0],
        "ecc_errors": ecc_errors,
        "driver_version": _text(_call(nvml, "nvmlSystemGetDriverVersion")),
        "cuda_version": None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
    }


def theoretical_bandwidth_gbs(max_memory_clock_mhz, bus_width_bits) -> float | None:
    """Max memory clock x bus width x 2 (double data rate) / 8 bits, in GB/s (FACTS.md):
    an H200's 3,201 MHz x 6,144 bits gives 4,917 GB/s."""
    if not max_memory_clock_mhz or not bus_width_bits:
        return None
    return float(round(max_memory_clock_mhz * bus_width_bits * 2 / 8 / 1000))


def pcie_link(nvml, handle) -> tuple[int | None, int | None]:
    """The link's current (generation, width); read it under load, idle links downshift."""
    if handle is None:
        return None, None
    return (_call(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle),
            _call(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle))


def clock_sample(nvml, handle) -> tuple[int | None, int | None, list[str]]:
    """(SM MHz, memory MHz, clock event reasons) right now."""
    if handle is None:
        return None, None, []
    sm = _call(nvml, "nvmlDeviceGetClockInfo", handle, _const(nvml, "NVML_CLOCK_SM", CLOCK_SM))
    memory = _call(nvml, "nvmlDeviceGetClockInfo", handle,
                   _const(nvml, "NVML_CLOCK_MEM", CLOCK_MEM))
    reasons = _call(nvml, "nvmlDeviceGetCurrentClocksEventReasons", handle)
    if reasons is None:  # pynvml before 12.535 only has the old name
        reasons = _call(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    return sm, memory, clock_event_reasons(reasons)


def clock_event_reasons(mask: int | None) -> list[str]:
    if not mask:
        return []
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~(GPU_IDLE | sum(CLOCK_EVENT_REASONS))
    return names + ([f"other ({unknown:#x})"] if unknown else [])
