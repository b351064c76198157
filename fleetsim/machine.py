"""A simulated machine handed to the real node agent.

`python -m fleetsim agent --profile KEY --machine-id ID COMMAND ...` runs the agent's COMMAND
(`run`, `facts`, `probe`, `enroll`) with a `SimulatedMachine` in place of this computer: the
heartbeat's hardware facts, the probe results and the GPUs' power draw come from the profile,
faults included; everything else (engine status, heartbeats, jobs) is the agent's own code.
The agent never imports fleetsim: fleetsim imports the agent and hands it the machine.
"""

import re

import httpx

from agent import hardware
from fleetsim.profiles import (
    get_profile,
    power_draw_w,
    simulated_facts,
    simulated_probe_results,
)

# The batch an engine runs now, as its /metrics says: vLLM's and llama-server's names.
_RUNNING = re.compile(r"^(?:vllm:num_requests_running|llamacpp:requests_processing)(?:\{[^}]*\})?"
                      r"\s+([0-9.eE+-]+)\s*$", re.M)


class SimulatedMachine:
    """`agent.hardware.Machine` for one simulated machine. Raises KeyError (naming the known
    profiles) for an unknown profile. `engine_url`: the machine's simulated engine, whose
    load its GPUs' power draw follows (none: idle)."""

    def __init__(self, profile_key: str, machine_id: str, engine_url: str | None = None):
        self.profile = get_profile(profile_key)
        self.machine_id = machine_id
        self.engine_url = engine_url

    def hostname(self) -> str:
        return self.machine_id  # simulated machines share one host: ids tell them apart

    def facts(self) -> tuple[dict, str | None]:
        facts = simulated_facts(self.profile.key, self.machine_id)
        return {"os": hardware.host_os(), **facts, "simulated": True}, None

    def probes(self, params: dict, *, device: str | None = None, log=None) -> dict:
        return simulated_probe_results(self.profile.key, self.machine_id, params or {})

    def power_draw(self) -> dict[int, int]:
        """Each GPU's draw for the batch the engine runs now (fleetsim.profiles.power_draw_w);
        nothing where NVML would read nothing."""
        watts = power_draw_w(self.profile, engine_running(self.engine_url))
        return {} if watts is None else dict.fromkeys(range(self.profile.gpu_count), watts)


def engine_running(engine_url: str | None) -> int:
    """Requests in the engine's batch now (0 when it cannot be asked: an idle GPU)."""
    if not engine_url:
        return 0
    try:
        text = httpx.get(f"{engine_url.rstrip('/')}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0
    found = _RUNNING.search(text)
    return int(float(found[1])) if found else 0
