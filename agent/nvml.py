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


def _read_gpu(nvml, index: int) -> dict:
    handle = _call(nvml, "nvmlDeviceGetHandleByIndex", index)

    def ask(name):
        # A GPU whose handle cannot be had (e.g. "GPU is lost") is still reported, all nulls,
        # so the platform sees the card in trouble rather than a card that vanished.
        return None if handle is None else _call(nvml, name, handle)

    memory = ask("nvmlDeviceGetMemoryInfo")
    capability = ask("nvmlDeviceGetCudaComputeCapability")
    power_mw = ask("nvmlDeviceGetPowerManagementLimit")
    return {
        "index": index,
        "name": _text(ask("nvmlDeviceGetName")),
        "uuid": _text(ask("nvmlDeviceGetUUID")),
        "memory_total_mib": None if memory is None else memory.total // MIB,
        "compute_capability": None if capability is None else f"{capability[0]}.{capability[1]}",
        "pcie_gen_current": ask("nvmlDeviceGetCurrPcieLinkGeneration"),
        "pcie_gen_max": ask("nvmlDeviceGetMaxPcieLinkGeneration"),
        "pcie_width_current": ask("nvmlDeviceGetCurrPcieLinkWidth"),
        "pcie_width_max": ask("nvmlDeviceGetMaxPcieLinkWidth"),
        "power_limit_w": None if power_mw is None else round(power_mw / 1000),
    }


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
