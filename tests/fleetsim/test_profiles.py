import math
import re

import pytest

from fleetsim.profiles import PROFILES, get_profile, gpu_uuid, simulated_facts

EXPECTED_KEYS = {"rtx-pro-6000", "2x-rtx-4090", "2x-rtx-5090", "h200", "2x-rtx-4090-wsl2",
                 "m4-max-llamacpp", "rtx-4090", "liar-3090-as-4090", "liar-48gb",
                 "liar-bandwidth-starved", "liar-power-capped", "liar-gen3-x1",
                 "liar-duplicate-uuid", "liar-slow-engine", "rtx-pro-6000-llama8b",
                 "2x-rtx-4090-mistral24b", "liar-slow-llama8b", "liar-slow-mistral24b",
                 "liar-h200-300w", "liar-nosize-5090x2", "liar-3x4090", "liar-twin-5090-24b",
                 "liar-slow-m4"}


def test_the_shipped_profiles():
    assert set(PROFILES) == EXPECTED_KEYS
    for key, profile in PROFILES.items():
        assert profile.key == key
        assert profile.engine in ("vllm", "llama.cpp")
        assert profile.sources
        assert profile.prefill_tps > 0 and profile.context_length > 0


@pytest.mark.parametrize(("key", "alone", "n", "at_n"), [
    ("rtx-pro-6000", 106, 32, 1342),
    ("2x-rtx-4090", 94, 32, 435),
    ("2x-rtx-5090", 152, 32, 1318),
    ("h200", 170, 128, 3342),
])
def test_published_fleet_figures(key, alone, n, at_n):
    p = get_profile(key)
    assert p.aggregate_tps(1) == alone
    assert p.aggregate_tps(n) == at_n
    assert p.engine == "vllm" and p.prefix_cache


def test_published_ranges_hold_the_chosen_single_stream_figures():
    assert 149 <= get_profile("2x-rtx-5090").aggregate_tps(1) <= 156
    assert 163 <= get_profile("h200").aggregate_tps(1) <= 176


def test_single_4090_serves_what_the_pairs_card_character_says():
    """No figure is published for one RTX 4090: it serves the 27B as the 4090's character,
    fitted on the published pair, says (fleetsim/physics.py); its 4-bit weights read about
    what each card of the pair reads, and it pays no tensor-parallel cost under load."""
    single, pair = get_profile("rtx-4090"), get_profile("2x-rtx-4090")
    assert single.gpu_count == 1 and single.engine == "vllm" and single.prefix_cache
    assert pair.aggregate_tps(1) * 0.9 < single.aggregate_tps(1) < pair.aggregate_tps(1) * 1.25
    assert single.aggregate_tps(32) > pair.aggregate_tps(32)
    assert "ESTIMATE" in single.sources
    # 4-bit weights (~14 GiB) leave KV room for several full-length requests on 24 GB.
    assert single.kv_cache_tokens >= 4 * single.context_length


def test_nvml_memory_readings():
    assert get_profile("h200").memory_total_mib == 143_771
    assert get_profile("2x-rtx-4090").memory_total_mib == 24_564


def test_interpolation_is_linear_in_log2_and_flat_beyond_the_last_point():
    p = get_profile("2x-rtx-4090")  # (1, 94), (32, 435): 5 doublings
    assert p.aggregate_tps(2) == pytest.approx(94 + (435 - 94) / 5)
    assert p.aggregate_tps(8) == pytest.approx(94 + (435 - 94) * 3 / 5)
    assert p.aggregate_tps(math.sqrt(2)) == pytest.approx(94 + (435 - 94) / 10)
    assert p.aggregate_tps(64) == p.aggregate_tps(1000) == 435
    assert p.per_stream_tps(8) == pytest.approx(p.aggregate_tps(8) / 8)
    assert p.per_stream_tps(1) == 94


def test_wsl2_serves_at_52_percent_of_native_on_the_same_hardware():
    native, wsl = get_profile("2x-rtx-4090"), get_profile("2x-rtx-4090-wsl2")
    for n in (1, 2, 8, 32, 100):
        assert wsl.aggregate_tps(n) == pytest.approx(0.52 * native.aggregate_tps(n), rel=1e-3)
    assert "microsoft-standard-WSL2" in wsl.os
    assert "48%" in wsl.sources
    for field in ("gpu_name", "gpu_count", "memory_total_mib", "compute_capability",
                  "pcie_gen_max", "pcie_width_max", "power_limit_w"):
        assert getattr(wsl, field) == getattr(native, field)


def test_mac_profile_is_a_labelled_estimate():
    p = get_profile("m4-max-llamacpp")
    assert p.engine == "llama.cpp" and not p.nvidia
    assert p.max_concurrency in (4, 8)
    assert "estimate" in p.sources.lower() and "546" in p.sources
    # One stream cannot beat the bandwidth ceiling: 546 GB/s over ~16 GB of weights.
    assert p.aggregate_tps(1) < 546 / 16


def test_prefill_is_derived_from_the_13000_token_figure():
    p = get_profile("rtx-pro-6000")
    assert p.prefill_tps == pytest.approx(13_000 / (7.2 - 1.6), rel=1e-3)
    assert "13,000" in p.sources


def test_get_profile_names_the_known_keys():
    with pytest.raises(KeyError) as exc:
        get_profile("a100")
    assert "h200" in str(exc.value) and "a100" in str(exc.value)


UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def test_gpu_uuids_are_deterministic_and_unique_per_machine():
    assert UUID_RE.match(gpu_uuid("h200-1", 0))
    assert gpu_uuid("h200-1", 0) == gpu_uuid("h200-1", 0)
    seen = {gpu_uuid(m, i) for m in ("a", "b", "h200-1", "h200-2") for i in range(2)}
    assert len(seen) == 8
    one = simulated_facts("2x-rtx-4090", "box-1")
    again = simulated_facts("2x-rtx-4090", "box-1")
    other = simulated_facts("2x-rtx-4090", "box-2")
    assert [g["uuid"] for g in one["gpus"]] == [g["uuid"] for g in again["gpus"]]
    assert not {g["uuid"] for g in one["gpus"]} & {g["uuid"] for g in other["gpus"]}


GPU_FIELDS = {"index", "name", "uuid", "memory_total_mib", "compute_capability",
              "pcie_gen_current", "pcie_gen_max", "pcie_width_current", "pcie_width_max",
              "power_limit_w", "nvlink_links"}
HOST_FIELDS = {"cpu_model", "cpu_cores", "ram_mib", "disk_free_gb", "net_link_mbps"}


@pytest.mark.parametrize("key", sorted(EXPECTED_KEYS))
def test_simulated_facts_follow_the_heartbeat_format(key):
    p = get_profile(key)
    facts = simulated_facts(key, "m1")
    assert set(facts) == {"nvidia", "driver_version", "cuda_version", "os", "host", "gpus"}
    assert set(facts["host"]) <= HOST_FIELDS
    assert facts["nvidia"] is p.nvidia
    assert len(facts["gpus"]) == p.gpu_count
    for i, gpu in enumerate(facts["gpus"]):
        assert set(gpu) == GPU_FIELDS
        assert gpu["index"] == i
        assert UUID_RE.match(gpu["uuid"])
        assert isinstance(gpu["memory_total_mib"], int)
        for name in ("name", "uuid", "compute_capability"):
            assert gpu[name] is None or len(gpu[name]) <= 256  # the protocol's string limit


def test_h200_facts_as_nvml_reports_them():
    gpu = simulated_facts("h200", "m1")["gpus"][0]
    assert gpu["name"] == "NVIDIA H200"
    assert gpu["memory_total_mib"] == 143_771
    assert gpu["compute_capability"] == "9.0"
    assert gpu["power_limit_w"] == 700
    assert gpu["nvlink_links"] == 18  # an SXM board: every NVLink link up


@pytest.mark.parametrize("key", ["2x-rtx-4090", "2x-rtx-5090", "rtx-pro-6000", "rtx-4090"])
def test_consumer_and_workstation_cards_are_joined_by_pcie_alone(key):
    assert {gpu["nvlink_links"] for gpu in simulated_facts(key, "m1")["gpus"]} == {0}


def test_mac_facts_have_one_unified_memory_gpu_and_no_nvidia_fields():
    facts = simulated_facts("m4-max-llamacpp", "mac-1")
    assert facts["nvidia"] is False and facts["driver_version"] is None
    (gpu,) = facts["gpus"]
    assert gpu["name"] == "Apple M4 Max" and gpu["memory_total_mib"] == 128 * 1024
    assert gpu["compute_capability"] is None and gpu["power_limit_w"] is None
    assert gpu["pcie_gen_current"] is None and gpu["nvlink_links"] is None
