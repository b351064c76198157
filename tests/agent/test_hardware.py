import subprocess

import pytest

from agent.hardware import hardware_facts
from agent.nvml import NoNvidia, read_nvidia, read_power_draw
from tests.agent.fakes import (
    H200,
    MIB,
    RTX_4090,
    NVMLError_DriverNotLoaded,
    NVMLError_GpuIsLost,
    NVMLError_InvalidArgument,
    NVMLError_LibraryNotFound,
    NVMLError_NotSupported,
    fake_nvml,
)

H200_FACTS = {
    "index": 0,
    "name": "NVIDIA H200",
    "uuid": "GPU-5b1c0d2e-1111-2222-3333-444455556666",
    "memory_total_mib": 143_771,
    "compute_capability": "9.0",
    "pcie_gen_current": 5,
    "pcie_gen_max": 5,
    "pcie_width_current": 16,
    "pcie_width_max": 16,
    "power_limit_w": 700,
    "nvlink_links": 18,
}


def test_h200():
    nvml = fake_nvml([H200], driver="560.35.03", cuda=12060)
    assert read_nvidia(nvml) == {
        "nvidia": True,
        "driver_version": "560.35.03",
        "cuda_version": "12.6",
        "gpus": [H200_FACTS],
    }
    assert nvml.calls[0] == "init" and nvml.calls[-1] == "shutdown"


def test_two_gpu_box():
    facts = read_nvidia(fake_nvml([RTX_4090, {**RTX_4090, "uuid": "GPU-second"}], cuda=12080))
    assert facts["cuda_version"] == "12.8"
    assert [(g["index"], g["uuid"]) for g in facts["gpus"]] == [
        (0, "GPU-4090aaaa-0000-0000-0000-000000000000"),
        (1, "GPU-second"),
    ]
    first = facts["gpus"][0]
    assert first["memory_total_mib"] == 24_564
    assert first["compute_capability"] == "8.9"
    assert (first["pcie_gen_current"], first["pcie_gen_max"]) == (1, 4)
    assert first["power_limit_w"] == 450
    assert first["nvlink_links"] == 0  # GeForce cards: PCIe alone


@pytest.mark.parametrize(("nvlink", "links"), [
    ([1, 1, 0, 1, 1, 0], 4),  # some links down (a bridge or switch port that is not)
    ([NVMLError_NotSupported("Not Supported")] * 2 + [1, 1], 2),  # a refused link is not up
])
def test_nvlink_links_counts_the_links_up(nvlink, links):
    facts = read_nvidia(fake_nvml([{**H200, "nvlink": nvlink}]))
    assert facts["gpus"][0]["nvlink_links"] == links


@pytest.mark.parametrize("refusal", [NVMLError_NotSupported("Not Supported"),
                                     NVMLError_InvalidArgument("Invalid Argument")])
def test_a_gpu_without_nvlink_has_no_links_up(refusal):
    # A PCIe card: NVML refuses every link it is asked about.
    facts = read_nvidia(fake_nvml([{**H200, "nvlink": refusal}, RTX_4090]))
    assert [gpu["nvlink_links"] for gpu in facts["gpus"]] == [0, 0]


def test_nvlink_links_asks_as_many_links_as_this_pynvml_knows():
    nvml = fake_nvml([{**H200, "nvlink": [1] * 36}])
    assert read_nvidia(nvml)["gpus"][0]["nvlink_links"] == 18  # nvml.h's 18 when not named
    nvml.NVML_NVLINK_MAX_LINKS = 36  # pynvml 12.x's
    assert read_nvidia(nvml)["gpus"][0]["nvlink_links"] == 36


def test_an_older_pynvml_without_nvlink_state_gives_null():
    nvml = fake_nvml([H200])
    del nvml.nvmlDeviceGetNvLinkState
    assert read_nvidia(nvml)["gpus"][0] == {**H200_FACTS, "nvlink_links": None}


def test_a_query_nvml_refuses_is_null_and_the_rest_is_read():
    gpu = {**H200, "power_mw": NVMLError_NotSupported("Not Supported")}
    facts = read_nvidia(fake_nvml([gpu], driver=NVMLError_NotSupported("Not Supported")))
    assert facts["driver_version"] is None
    assert facts["gpus"][0] == {**H200_FACTS, "power_limit_w": None}


def test_an_older_pynvml_without_a_function_gives_null():
    nvml = fake_nvml([H200])
    del nvml.nvmlSystemGetCudaDriverVersion_v2
    assert read_nvidia(nvml)["cuda_version"] is None


def test_a_lost_gpu_is_reported_with_null_fields():
    facts = read_nvidia(fake_nvml([H200, NVMLError_GpuIsLost("GPU is lost")]))
    assert facts["gpus"][0] == H200_FACTS
    assert facts["gpus"][1]["index"] == 1
    assert all(value is None for key, value in facts["gpus"][1].items() if key != "index")


def test_bytes_from_older_pynvml_are_decoded():
    gpu = {**H200, "name": b"NVIDIA H200", "uuid": H200["uuid"].encode()}
    facts = read_nvidia(fake_nvml([gpu], driver=b"535.104.05"))
    assert facts["driver_version"] == "535.104.05"
    assert facts["gpus"][0]["name"] == "NVIDIA H200"
    assert facts["gpus"][0]["uuid"] == H200["uuid"]


@pytest.mark.parametrize(
    ("nvml", "reason"),
    [
        (fake_nvml([H200], init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found")),
         "NVML Shared Library Not Found"),
        (fake_nvml([H200], init_error=NVMLError_DriverNotLoaded("Driver Not Loaded")),
         "Driver Not Loaded"),
        (fake_nvml([]), "no devices"),
        (None, "pynvml is not installed"),
    ],
)
def test_no_nvidia_gpu(nvml, reason):
    facts, notice = hardware_facts(nvml, system="Linux", release="6.8.0-45-generic")
    assert facts == {"os": "Linux 6.8.0-45-generic", "simulated": False, "nvidia": False,
                     "driver_version": None, "cuda_version": None, "gpus": []}
    assert notice == (f"No NVIDIA GPU found on this machine (NVML: {reason}); "
                      "reporting it without GPUs.")


def test_nvml_is_shut_down_even_when_counting_fails():
    nvml = fake_nvml([H200], count_error=NVMLError_DriverNotLoaded("Driver Not Loaded"))
    with pytest.raises(NoNvidia, match="Driver Not Loaded"):
        read_nvidia(nvml)
    assert nvml.calls == ["init", "shutdown"]


def test_nvidia_machine_has_no_notice_and_reports_its_kernel():
    facts, notice = hardware_facts(fake_nvml([H200]), system="Linux",
                                   release="5.15.153.1-microsoft-standard-WSL2")
    assert notice is None
    assert facts["nvidia"] is True
    assert facts["os"] == "Linux 5.15.153.1-microsoft-standard-WSL2"  # how WSL shows


def mac(brand="Apple M4 Max", hardware_uuid="8C3A2B1D-0000-4E5F-9A8B-7C6D5E4F3A2B"):
    """A command runner answering as a Mac would; ioreg fails when hardware_uuid is None."""
    def run(argv):
        if argv == ["sysctl", "-n", "machdep.cpu.brand_string"]:
            return brand + "\n"
        if argv == ["sysctl", "-n", "hw.memsize"]:
            return f"{128 * 1024 * MIB}\n"
        if argv[0] == "ioreg" and hardware_uuid:
            return f'  | "IOPlatformUUID" = "{hardware_uuid}"\n  | "IOPlatformSerialNumber" = "X"\n'
        raise subprocess.CalledProcessError(1, argv)

    return run


def test_apple_silicon_is_reported_as_one_gpu():
    facts, notice = hardware_facts(None, system="Darwin", release="24.3.0", run=mac())
    assert facts["nvidia"] is False
    assert facts["os"] == "Darwin 24.3.0"
    [gpu] = facts["gpus"]
    assert gpu["name"] == "Apple M4 Max"
    assert gpu["memory_total_mib"] == 128 * 1024
    assert gpu["uuid"].startswith("APPLE-")
    assert "8C3A2B1D" not in gpu["uuid"]  # derived from the hardware UUID, not the raw one
    assert gpu["compute_capability"] is None and gpu["power_limit_w"] is None
    assert gpu["nvlink_links"] is None
    assert "Apple M4 Max" in notice


def test_apple_gpu_uuid_is_stable_per_mac():
    def uuid_of(run):
        return hardware_facts(None, system="Darwin", release="24.3.0", run=run)[0]["gpus"][0]["uuid"]

    assert uuid_of(mac()) == uuid_of(mac())
    assert uuid_of(mac()) != uuid_of(mac(hardware_uuid="11111111-2222-3333-4444-555555555555"))
    assert uuid_of(mac(hardware_uuid=None)) is None


def test_intel_mac_reports_no_gpu():
    facts, notice = hardware_facts(None, system="Darwin", release="21.6.0",
                                   run=mac(brand="Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz"))
    assert facts["gpus"] == []
    assert "without GPUs" in notice


def test_power_draw_is_read_in_watts_where_nvml_can():
    # NVML answers in milliwatts: 112,640 mW is 113 W. A GPU that cannot say is left out.
    nvml = fake_nvml([H200, {**RTX_4090, "power_usage_mw": NVMLError_NotSupported("Not Sup")},
                      {**RTX_4090, "uuid": "GPU-third", "power_usage_mw": 402_499}])
    assert read_power_draw(nvml) == {0: 113, 2: 402}
    assert nvml.calls[0] == "init" and nvml.calls[-1] == "shutdown"
    assert read_power_draw(None) == {}  # no pynvml
    assert read_power_draw(fake_nvml([], init_error=NVMLError_DriverNotLoaded("no"))) == {}
